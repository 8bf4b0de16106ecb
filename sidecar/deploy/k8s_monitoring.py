"""The Prometheus side of the Kubernetes manifests: a ServiceMonitor that
scrapes every sidecar pod and a PrometheusRule carrying the shipped rules.

The rules and the dashboard read ``up{job="model-router-sidecar"}``;
prometheus-operator names a ServiceMonitor's job after the Service, so the
ServiceMonitor relabels ``job`` to :data:`SCRAPE_JOB`, the one name both
sides use (tests check the rules, the dashboard and the test Prometheus
against it). The PrometheusRule's groups are the rules file
(``deploy/observability/model-router.rules.yml``, packaged with the
sidecar), unchanged, so the file and the object cannot drift apart.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from .k8s import Options

SCRAPE_JOB = "model-router-sidecar"
RULES_FILE = "model-router.rules.yml"
SCRAPE_INTERVAL = "15s"


def rules_text() -> str:
    """The shipped recording and alerting rules (a Prometheus rule file)."""
    return resources.files("sidecar").joinpath("templates", RULES_FILE).read_text(encoding="utf-8")


def service_monitor(opts: Options) -> dict[str, Any]:
    from .k8s import _meta, _selector

    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": _meta(opts.name, opts, "sidecar"),
        "spec": {"selector": {"matchLabels": _selector(opts, "sidecar")},
                 "endpoints": [{"port": "http-admin", "path": "/metrics", "interval": SCRAPE_INTERVAL,
                                # The job the rules and the dashboard read, not the Service's name.
                                "relabelings": [{"action": "replace", "targetLabel": "job",
                                                 "replacement": SCRAPE_JOB}]}]},
    }


def prometheus_rule(opts: Options, rules: str | None = None) -> dict[str, Any]:
    from .k8s import _meta

    groups = yaml.safe_load(rules if rules is not None else rules_text())["groups"]
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": _meta(opts.name, opts, "sidecar"), "spec": {"groups": groups}}


def monitoring(opts: Options) -> list[dict[str, Any]]:
    """``monitoring.yaml``: needs prometheus-operator's CRDs, so it is a file of its own."""
    return [service_monitor(opts), prometheus_rule(opts)]

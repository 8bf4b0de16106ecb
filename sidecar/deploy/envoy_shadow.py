"""The Envoy side of shadow arms (see :mod:`sidecar.routing.shadow`, docs/envoy.md).

- per shadow arm, a copy of every route that matches the decision's
  ``x-model-router-shadow`` header naming the arm's cluster and mirrors the
  request there (no header: no copy; the share is drawn by the sidecar, per
  experiment);
- per shadow arm, a cluster named ``shadow~<experiment>``: its backend's
  cluster without outlier ejection (the copies' failures must not eject the
  hosts live traffic uses through the backend's own cluster), a circuit
  breaker of ``max_in_flight`` requests (pending ones included) and no
  retries, and
  an upstream filter chain whose ext_proc filter hands each copy to the
  sidecar (the arm's model in the body; the response metered).

The building blocks come from :mod:`sidecar.deploy.envoy`; this module only
arranges them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..config.schema import Config
from ..contract import SHADOW_HEADER
from ..routing.shadow import targets

SHADOW_FILTER = "envoy.filters.http.ext_proc/shadow"


def routes(config: Config, routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before ``routes``, per shadow arm a copy of each route that sends
    traffic upstream, matching the decision's shadow header too, with a
    mirror policy to the arm's cluster. The route configuration removes the
    header before the request goes on; the policy puts it back on the copy
    alone (the shadow stream reads it)."""
    sending = [r for r in routes if "route" in r and r["name"] != "fail_open"]
    out = []
    for t in targets(config):
        header = {"header": {"key": SHADOW_HEADER, "value": t.cluster}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
        policy = {
            "cluster": t.cluster,
            # The copy keeps the live request's Host (a "-shadow" suffix would reach the engine).
            "disable_shadow_host_suffix_append": True,
            "request_headers_mutations": [{"append": header}],
        }
        for r in sending:
            match = dict(r["match"])
            match["headers"] = [*match.get("headers", []), {"name": SHADOW_HEADER, "string_match": {"exact": t.cluster}}]
            out.append({**copy.deepcopy(r), "name": f"{t.cluster}/{r['name']}", "match": match,
                        "route": {**copy.deepcopy(r["route"]), "request_mirror_policies": [policy]}})
    return out + routes


def clusters(config: Config, backend_cluster: Callable[[str, str], dict[str, Any]], ext_proc: dict[str, Any], codec: dict[str, Any]) -> list[dict[str, Any]]:
    """``backend_cluster(name, backend)`` builds a plain cluster for a backend
    under another name; ``ext_proc`` is the shadow filter, ``codec`` the
    upstream codec filter."""
    out = []
    for t in targets(config):
        cluster = backend_cluster(t.cluster, t.backend)
        cluster.pop("outlier_detection", None)
        cap = t.arm.shadow.max_in_flight
        cluster["circuit_breakers"] = {"thresholds": [{
            "max_requests": cap, "max_pending_requests": cap, "max_retries": 0, "max_connections": cap,
        }]}
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        options["http_filters"] = [copy.deepcopy(ext_proc), copy.deepcopy(codec)]
        out.append(cluster)
    return out


def filter_config(ext_proc: dict[str, Any]) -> dict[str, Any]:
    """The shadow ext_proc filter (a copy of ``ext_proc``'s shape): the
    request whole, then the response as it streams. It never fails open: the
    copy as it stands names the live model."""
    config = dict(ext_proc["typed_config"])
    config.update(
        stat_prefix="shadow",
        failure_mode_allow=False,
        processing_mode={
            "request_header_mode": "SEND", "request_body_mode": "BUFFERED", "response_header_mode": "SEND",
            "response_body_mode": "STREAMED", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
        },
    )
    config.pop("metadata_options", None)
    return {"name": SHADOW_FILTER, "typed_config": config}

"""Every generated custom resource against the upstream CRD schemas: Gateway
API (HTTPRoute, BackendTLSPolicy, ReferenceGrant), Istio (EnvoyFilter,
DestinationRule) and prometheus-operator (ServiceMonitor, PrometheusRule), as
the kubernetes-models npm packages compile them from each project's CRDs
(pinned in tests/crd/package-lock.json, installed by `python -m tests.support.servers`).

These schemas check types, enums, patterns, formats and required fields, as
the API server does; like the API server they do not refuse unknown fields.
No package registry ships Envoy Gateway's CRDs (EnvoyExtensionPolicy,
EnvoyProxy, ClientTrafficPolicy): those are checked by what Envoy makes of
them (tests/integration/test_k8s.py, tests/integration/test_gateways_live.py)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar.config import schema as config_mod
from sidecar.deploy import k8s
from tests.support.servers import CRD_SCHEMAS

from .test_k8s import BUILT_IN, TEMPLATE

# No registry package ships these CRDs' schemas.
NO_REGISTRY_SCHEMA = {"EnvoyExtensionPolicy", "EnvoyProxy", "ClientTrafficPolicy"}

WIDE = """
backends:
  - {name: hosted, url: "https://api.example.com/v1", type: openai, api_key: "${HOSTED_KEY}"}
  - {name: local, url: "http://vllm.llm.svc.cluster.local:8000", models: [m]}
  - {name: tls-local, url: "https://tgi.llm.svc:443", models: [n]}
"""


def validate(docs: list[dict]) -> list[dict]:
    node = shutil.which("node")
    if node is None or not (CRD_SCHEMAS / "node_modules").is_dir():
        pytest.fail("the CRD schema packages are not installed: run `python -m tests.support.servers`")
    done = subprocess.run([node, str(CRD_SCHEMAS / "validate.mjs")], input=json.dumps(docs), cwd=CRD_SCHEMAS,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _custom(files: dict[str, list[dict]]) -> list[dict]:
    return [d for docs in files.values() for d in docs if d["kind"] not in BUILT_IN]


def _every_shape() -> list[dict]:
    """The template's manifests, and a config with external and in-cluster
    https backends whose Gateway is in another namespace."""
    template = k8s.manifests(config_mod.load(TEMPLATE).config, Path(TEMPLATE).read_text(), k8s.Options())
    wide_cfg = config_mod.parse(WIDE, env={"HOSTED_KEY": "x"}).config
    wide = k8s.manifests(wide_cfg, WIDE, k8s.Options(namespace="llm", gateway="edge", gateway_namespace="gateways"))
    return _custom(template) + _custom(wide)


def test_every_generated_custom_resource_matches_its_upstream_crd():
    docs = _every_shape()
    results = validate(docs)
    kinds = {d["kind"] for d in docs}
    assert {"HTTPRoute", "BackendTLSPolicy", "ReferenceGrant", "EnvoyFilter", "DestinationRule", "ServiceMonitor",
            "PrometheusRule"} <= kinds
    for doc, got in zip(docs, results):
        if doc["kind"] in NO_REGISTRY_SCHEMA:
            assert got["result"] == "no-schema", got
        else:
            assert got["result"] == "ok", (doc["apiVersion"], got)


def test_the_schemas_catch_what_an_api_server_would_refuse():
    """A negative control: one error per kind, each caught."""
    docs = {d["kind"]: d for d in _every_shape()}
    broken = []
    route = copy.deepcopy(docs["HTTPRoute"])
    route["spec"]["rules"][0]["timeouts"]["request"] = "5 seconds"
    broken.append(route)
    tls = copy.deepcopy(docs["BackendTLSPolicy"])
    tls["spec"]["validation"]["wellKnownCACertificates"] = "Everyone"
    broken.append(tls)
    envoy_filter = copy.deepcopy(docs["EnvoyFilter"])
    envoy_filter["spec"]["configPatches"][0]["applyTo"] = "HTTP_FILTERS"
    broken.append(envoy_filter)
    rule = copy.deepcopy(docs["DestinationRule"])
    rule["spec"]["trafficPolicy"]["tls"]["mode"] = "TLS"
    broken.append(rule)
    monitor = copy.deepcopy(docs["ServiceMonitor"])
    monitor["spec"]["endpoints"][0]["relabelings"][0]["action"] = "rename"
    broken.append(monitor)
    prom_rule = copy.deepcopy(docs["PrometheusRule"])
    del prom_rule["spec"]["groups"][0]["name"]
    broken.append(prom_rule)
    for doc, got in zip(broken, validate(broken)):
        assert got["result"] not in ("ok", "no-schema"), (doc["kind"], got)

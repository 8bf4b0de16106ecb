"""The manifests' access rules: the NetworkPolicy, and the gRPC secret's wiring."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar.config import schema as config_mod
from sidecar.contract import MAX_WAIT_METADATA
from sidecar.deploy import k8s
from sidecar.serve.grpc_auth import METADATA_KEY

TEMPLATE = Path("sidecar/templates/ab-testing.yaml")
SECRET = "k8s-grpc-secret-0123456789"


def _files(text: str, env: dict[str, str] | None = None, **opts) -> dict[str, list[dict]]:
    loaded = config_mod.parse(text, env=env or {})
    return k8s.manifests(loaded.config, text, k8s.Options(**opts))


def _sidecar(files) -> dict:
    return next(d for d in files["sidecar.yaml"] if d["kind"] == "Deployment" and d["metadata"]["name"] == "model-router")


def test_the_network_policy_admits_the_gateway_to_grpc_and_monitoring_to_admin():
    files = _files(TEMPLATE.read_text(), gateway="edge", gateway_namespace="gw", monitoring_namespace="prom")
    (policy,) = [d for d in files["sidecar.yaml"] if d["kind"] == "NetworkPolicy"]
    assert kubernetes_validate.validate(policy, "1.30", strict=True) == "1.30"
    pod_labels = _sidecar(files)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc, admin = policy["spec"]["ingress"]
    assert grpc["ports"] == [{"protocol": "TCP", "port": k8s.GRPC_PORT}]
    istio, envoy_gateway = grpc["from"]
    assert istio == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}},
                     "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "edge"}}}
    assert envoy_gateway["podSelector"]["matchLabels"] == {
        "gateway.envoyproxy.io/owning-gateway-name": "edge", "gateway.envoyproxy.io/owning-gateway-namespace": "gw"}
    assert admin == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "prom"}}}],
                     "ports": [{"protocol": "TCP", "port": k8s.ADMIN_PORT}]}


def test_without_a_secret_the_sidecar_is_told_the_policy_guards_it():
    files = _files(TEMPLATE.read_text())
    args = _sidecar(files)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--grpc-trust-network" in args and args[args.index("--grpc-listen") + 1] == f"0.0.0.0:{k8s.GRPC_PORT}"
    assert "envoy-gateway.yaml" in files
    assert METADATA_KEY not in yaml.safe_dump(files["istio.yaml"])


def test_a_secret_from_the_environment_goes_to_a_secret_the_pod_and_the_gateway_use():
    text = TEMPLATE.read_text().replace("server:\n", "server:\n  grpc_auth: {secret: '${MR_GRPC}'}\n", 1)
    files = _files(text, env={"MR_GRPC": SECRET})
    (secret,) = [d for d in files["sidecar.yaml"] if d["kind"] == "Secret" and d["metadata"]["name"] == "model-router-grpc"]
    assert secret["stringData"] == {"secret": SECRET}
    assert kubernetes_validate.validate(secret, "1.30", strict=True) == "1.30"
    container = _sidecar(files)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "MR_GRPC", "valueFrom": {"secretKeyRef": {"name": "model-router-grpc", "key": "secret"}}} in container["env"]
    assert "--grpc-trust-network" not in container["args"]
    config_secret = next(d for d in files["sidecar.yaml"] if d["kind"] == "Secret" and d["metadata"]["name"] == "model-router-config")
    assert SECRET not in config_secret["stringData"]["config.yaml"]  # the config keeps the reference
    patches = files["istio.yaml"][0]["spec"]["configPatches"]
    values = [p["patch"]["value"] for p in patches]
    decision = next(v for v in values if v.get("name") == "envoy.filters.http.ext_proc")
    hcm = next(v for v in values if "access_log" in v.get("typed_config", {}))
    decides = decision["typed_config"]["extension_config"]["typed_config"]["grpc_service"]
    logs = hcm["typed_config"]["access_log"][0]["typed_config"]["common_config"]["grpc_service"]
    assert logs["initial_metadata"] == [{"key": METADATA_KEY, "value": SECRET}]
    # The secret joins what the decision filter's streams already say: how long Envoy waits when asked.
    assert decides["initial_metadata"] == [{"key": MAX_WAIT_METADATA, "value": "610000"},
                                           {"key": METADATA_KEY, "value": SECRET}]
    assert "envoy-gateway.yaml" not in files  # its EnvoyExtensionPolicy cannot send the secret


@pytest.mark.parametrize("auth, error", [
    ("{secret: inline-secret-0123456789}", "server.grpc_auth.secret: give it as ${VAR}"),
    ("{secret_file: /run/s}", "server.grpc_auth.secret_file: give the secret as ${VAR}"),
    ("{tls: {cert_file: a, key_file: b, client_ca_file: c, envoy_cert_file: d, envoy_key_file: e}}",
     "server.grpc_auth.tls: in Kubernetes use the mesh's mTLS"),
])
def test_what_the_manifests_cannot_carry_is_refused(auth, error):
    text = TEMPLATE.read_text().replace("server:\n", f"server:\n  grpc_auth: {auth}\n", 1)
    with pytest.raises(k8s.K8sError, match=error.replace("$", r"\$").replace("{", r"\{").replace("}", r"\}")):
        _files(text)

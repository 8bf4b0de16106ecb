"""Who reaches the sidecar's ports in Kubernetes: the NetworkPolicy, and the
gRPC secret's wiring (:mod:`sidecar.serve.grpc_auth`).

- The NetworkPolicy admits the gateway's Envoy pods (Istio's, labelled with
  the Gateway's name in its namespace, and Envoy Gateway's, labelled with
  their owning Gateway in ``envoy-gateway-system``) to the gRPC port, and the monitoring
  namespace to the admin port. Nothing else in the cluster reaches either.
- With ``server.grpc_auth.secret: ${VAR}`` the value (read from the
  generating shell's environment) goes into a Secret the pod takes ``VAR``
  from, and into the Istio EnvoyFilter's gRPC calls. Without a secret the
  sidecar is told the NetworkPolicy guards it (``--grpc-trust-network``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.schema import _ENV_RE, Config
from ..serve import grpc_auth

if TYPE_CHECKING:
    from .k8s import Options

ENVOY_GATEWAY_LABEL = "gateway.envoyproxy.io/owning-gateway-name"
ENVOY_GATEWAY_NS_LABEL = "gateway.envoyproxy.io/owning-gateway-namespace"
ENVOY_GATEWAY_SYSTEM = "envoy-gateway-system"  # where Envoy Gateway runs the proxies it deploys
NAMESPACE_LABEL = "kubernetes.io/metadata.name"


class AccessError(ValueError):
    """What the manifests cannot wire (the message names the field)."""


def secret_env(config: Config, raw_text_secret: str | None) -> str | None:
    """The variable the config's gRPC secret comes from, or None without one.
    Raises :class:`AccessError` for a form the manifests cannot carry."""
    auth = config.server.grpc_auth
    if auth.tls is not None:
        raise AccessError("server.grpc_auth.tls: in Kubernetes use the mesh's mTLS (Istio PeerAuthentication) "
                          "or the gRPC secret; the manifests do not mount certificates")
    if auth.secret_file is not None:
        raise AccessError("server.grpc_auth.secret_file: give the secret as ${VAR}; the manifests put it in a Secret")
    if auth.secret is None:
        return None
    m = _ENV_RE.fullmatch(raw_text_secret or "")
    if m is None:
        raise AccessError("server.grpc_auth.secret: give it as ${VAR} so the manifests keep it in a Secret, "
                          "not in the config")
    return m.group(1)


def raw_secret(config_text: str) -> str | None:
    """``server.grpc_auth.secret`` as written (before ``${ENV}`` expansion)."""
    import yaml

    doc = yaml.safe_load(config_text)
    server = doc.get("server") if isinstance(doc, dict) else None
    auth = server.get("grpc_auth") if isinstance(server, dict) else None
    value = auth.get("secret") if isinstance(auth, dict) else None
    return value if isinstance(value, str) else None


def wire(config: Config, config_text: str, opts: Options, container: dict[str, Any]) -> list[dict[str, Any]]:
    """Put the gRPC secret (or the trust in the NetworkPolicy) into the sidecar
    container; the Secret it needs, if any."""
    var = secret_env(config, raw_secret(config_text))
    if var is None:
        container["args"].append("--grpc-trust-network")
        return []
    name = f"{opts.name}-grpc"
    container.setdefault("env", []).append(
        {"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": "secret"}}})
    return [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
             "metadata": {"name": name, "namespace": opts.namespace,
                          "labels": {"app.kubernetes.io/name": opts.name, "app.kubernetes.io/component": "sidecar"}},
             "stringData": {"secret": config.server.grpc_auth.secret}}]


def with_secret(config: Config, docs: list[dict[str, Any]], cluster: str) -> list[dict[str, Any]]:
    """The gateway's gRPC calls to ``cluster`` carry the secret."""
    secret = config.server.grpc_auth.secret
    if secret is not None:
        grpc_auth.with_secret(docs, cluster, secret)
    return docs


def network_policy(opts: Options, selector: dict[str, Any], grpc_port: int, admin_port: int, monitoring: str) -> dict[str, Any]:
    gateway_ns = opts.gateway_namespace or opts.namespace
    istio: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: gateway_ns}},
                             "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": opts.gateway}}}
    envoy_gateway: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: ENVOY_GATEWAY_SYSTEM}},
        "podSelector": {"matchLabels": {ENVOY_GATEWAY_LABEL: opts.gateway, ENVOY_GATEWAY_NS_LABEL: gateway_ns}},
    }
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": opts.name, "namespace": opts.namespace,
                     "labels": {"app.kubernetes.io/name": opts.name, "app.kubernetes.io/component": "sidecar"}},
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [istio, envoy_gateway], "ports": [{"protocol": "TCP", "port": grpc_port}]},
                {"from": [{"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: monitoring}}}],
                 "ports": [{"protocol": "TCP", "port": admin_port}]},
            ],
        },
    }

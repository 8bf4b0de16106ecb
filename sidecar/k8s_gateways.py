"""The gateway recipes that put the sidecar in front of the routes.

- **Istio**: an ``EnvoyFilter`` on the gateway's Envoy that inserts the same
  ext_proc filter the bootstrap has (:func:`sidecar.envoyconf.decision_filter`)
  and the usage filter before the router, and merges the client-header guard
  and the usage access log into the connection manager, all calling the
  sidecar Service through Istio's outbound cluster for it.
- **Envoy Gateway**: an ``EnvoyExtensionPolicy`` with the same ext_proc
  settings in Envoy Gateway's terms, and a ``ClientTrafficPolicy`` that strips
  the routing headers a client sends before any route is matched.

Both attach to the Gateway the HTTPRoute of :mod:`sidecar.k8s` names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .envoyconf import (
    REPLY_NAMESPACE,
    access_log,
    body_buffer,
    buffer_limit_bytes,
    decision_filter,
    header_guard,
    json_usage_filter,
)
from .response_stream import RESPONSE_HEADER
from .snapshot import BACKEND_HEADER

if TYPE_CHECKING:
    from .config import Config
    from .k8s import Options

HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"  # on the pods Istio deploys for a Gateway


def _gateway_namespace(opts: Options) -> str:
    return opts.gateway_namespace or opts.namespace


def istio_cluster(opts: Options) -> str:
    """Istio's name for the outbound cluster of the sidecar Service's gRPC port."""
    from .k8s import GRPC_PORT

    return f"outbound|{GRPC_PORT}||{opts.name}.{opts.namespace}.svc.cluster.local"


def istio(config: Config, opts: Options, context: str = "GATEWAY") -> list[dict]:
    """The EnvoyFilter for the gateway's Envoy (``context: SIDECAR_OUTBOUND``
    and a workload selector of the calling app put it into a mesh sidecar)."""
    cluster = istio_cluster(opts)
    before_router = {"context": context, "listener": {"filterChain": {"filter": {
        "name": HCM, "subFilter": {"name": "envoy.filters.http.router"}}}}}
    patches: list[dict[str, Any]] = [
        # The body whole before the decision stream opens (slow uploads hold no stream).
        {"applyTo": "HTTP_FILTER", "match": before_router,
         "patch": {"operation": "INSERT_BEFORE", "value": body_buffer(config)}},
        {"applyTo": "HTTP_FILTER", "match": before_router,
         "patch": {"operation": "INSERT_BEFORE", "value": decision_filter(config, cluster)}},
        {"applyTo": "HTTP_FILTER", "match": before_router,
         "patch": {"operation": "INSERT_BEFORE", "value": json_usage_filter()}},
        {"applyTo": "NETWORK_FILTER", "match": {"context": context, "listener": {"filterChain": {"filter": {"name": HCM}}}},
         "patch": {"operation": "MERGE", "value": {"name": HCM, "typed_config": {
             "@type": HCM_TYPE,
             "early_header_mutation_extensions": [header_guard()],
             "access_log": [access_log(config.metering.flush_interval_ms, cluster)],
         }}}},
    ]
    return [{
        "apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter",
        "metadata": {"name": opts.name, "namespace": _gateway_namespace(opts)},
        "spec": {"workloadSelector": {"labels": {GATEWAY_LABEL: opts.gateway}}, "configPatches": patches},
    }]


def envoy_gateway(config: Config, opts: Options) -> list[dict]:
    from .k8s import GRPC_PORT

    ns = _gateway_namespace(opts)
    target = [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": opts.gateway}]
    ref: dict[str, Any] = {"group": "", "kind": "Service", "name": opts.name, "port": GRPC_PORT}
    if ns != opts.namespace:
        ref["namespace"] = opts.namespace
    server = config.server
    docs: list[dict] = [
        {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy",
         "metadata": {"name": opts.name, "namespace": ns},
         "spec": {"targetRefs": target, "extProc": [{
             "backendRefs": [ref],
             # As the bootstrap's decision filter: request headers and buffered
             # body, response headers offered (the sidecar turns them off).
             "processingMode": {"request": {"body": "Buffered"}, "response": {}, "allowModeOverride": True},
             "messageTimeout": f"{server.message_timeout_ms}ms",
             "failOpen": server.failure_mode == "open",
             "metadata": {"writableNamespaces": [REPLY_NAMESPACE]},
         }]}},
        {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "ClientTrafficPolicy",
         "metadata": {"name": opts.name, "namespace": ns},
         "spec": {"targetRefs": target,
                  "headers": {"earlyRequestHeaders": {"remove": [BACKEND_HEADER, RESPONSE_HEADER]}},
                  "connection": {"bufferLimit": str(buffer_limit_bytes(server))}}},
    ]
    if ns != opts.namespace:
        docs.append({
            "apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": f"{opts.name}-extproc", "namespace": opts.namespace},
            "spec": {"from": [{"group": "gateway.envoyproxy.io", "kind": "EnvoyExtensionPolicy", "namespace": ns}],
                     "to": [{"group": "", "kind": "Service", "name": opts.name}]},
        })
    return docs

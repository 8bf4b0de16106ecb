"""The gateway recipes that put the sidecar in front of the routes.

- **Istio**: an ``EnvoyFilter`` on the gateway's Envoy that inserts the same
  ext_proc filter the bootstrap has (:func:`sidecar.deploy.envoy.decision_filter`)
  and the usage filter before the router, and merges the client-header guard
  and the usage access log into the connection manager, all calling the
  sidecar Service through Istio's outbound cluster for it.
- **Envoy Gateway**: an ``EnvoyExtensionPolicy`` on the HTTPRoute with the
  same ext_proc settings in Envoy Gateway's terms, an ``EnvoyProxy`` whose
  access log goes to the sidecar (metering), and a ``ClientTrafficPolicy``
  that strips the routing headers a client sends before any route is matched.

The EnvoyFilter and the ClientTrafficPolicy attach to the Gateway the
HTTPRoute of :mod:`sidecar.deploy.k8s` names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..contract import REPLY_NAMESPACE, RESPONSE_HEADER
from ..routing.snapshot import BACKEND_HEADER
from .envoy import (
    access_log,
    body_buffer,
    buffer_limit_bytes,
    decision_filter,
    header_guard,
    json_usage_filter,
    not_on_header_overflow,
)

if TYPE_CHECKING:
    from ..config.schema import Config
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


def istio(config: Config, opts: Options, context: str = "GATEWAY") -> list[dict[str, Any]]:
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
         "patch": {"operation": "INSERT_BEFORE", "value": not_on_header_overflow(decision_filter(config, cluster))}},
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


ACCESS_LOG_NAME = "model_router"
# Only the requests the sidecar decided on reach its access-log service, not
# the other routes' of the same proxy.
DECIDED = f"has(metadata.filter_metadata.{REPLY_NAMESPACE})"
STATUS_ON_ERROR = 503  # a dead sidecar: 503, as the bootstrap's status_on_error


def internal_headers() -> list[str]:
    """Every fixed name of a request header the router sets for Envoy: what
    Envoy Gateway's early removal (exact names only, where the bootstrap
    strips the whole namespace) takes from a client."""
    from .envoy_limits import INTERNAL_REQUEST_HEADERS

    return [BACKEND_HEADER, RESPONSE_HEADER, *INTERNAL_REQUEST_HEADERS]


def _sidecar_ref(opts: Options, from_namespace: str) -> dict[str, Any]:
    from .k8s import GRPC_PORT

    ref: dict[str, Any] = {"group": "", "kind": "Service", "name": opts.name, "port": GRPC_PORT}
    if from_namespace != opts.namespace:
        ref["namespace"] = opts.namespace
    return ref


def envoy_gateway_ext_proc(config: Config, opts: Options) -> dict[str, Any]:
    """The EnvoyExtensionPolicy: targets the LLM HTTPRoute only (other routes
    of the Gateway never meet the sidecar), so it lives in its namespace."""
    server = config.server
    fail_open = server.failure_mode == "open"
    ext_proc: dict[str, Any] = {
        "backendRefs": [_sidecar_ref(opts, opts.namespace)],
        # As the bootstrap's decision filter: request headers and buffered
        # body, response headers offered (the sidecar turns them off).
        "processingMode": {"request": {"body": "Buffered"}, "response": {}, "allowModeOverride": True},
        "messageTimeout": f"{server.message_timeout_ms}ms",
        "failOpen": fail_open,
        "metadata": {"writableNamespaces": [REPLY_NAMESPACE]},
    }
    if not fail_open:
        ext_proc["statusOnError"] = STATUS_ON_ERROR  # Envoy Gateway >= 1.9; older ones answer 500
    return {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy",
            "metadata": {"name": opts.name, "namespace": opts.namespace},
            "spec": {"targetRefs": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": opts.name}],
                     "extProc": [ext_proc]}}


def envoy_proxy(opts: Options) -> dict[str, Any]:
    """The EnvoyProxy the Gateway names in ``infrastructure.parametersRef``:
    Envoy's gRPC access log to the sidecar (metering, SRM, traces, usage
    records, passive health), for the requests it decided, with the client's
    trace context; and Envoy's usual stdout log beside it."""
    ns = _gateway_namespace(opts)
    als = {"backendRefs": [_sidecar_ref(opts, ns)], "logName": ACCESS_LOG_NAME, "type": "HTTP",
           "http": {"requestHeaders": ["traceparent", "tracestate"]}}
    return {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyProxy",
            "metadata": {"name": opts.name, "namespace": ns},
            "spec": {"telemetry": {"accessLog": {"settings": [
                {"type": "Route", "matches": [DECIDED], "sinks": [{"type": "ALS", "als": als}]},
                {"sinks": [{"type": "File", "file": {"path": "/dev/stdout"}}]},
            ]}}}}


def envoy_gateway(config: Config, opts: Options) -> list[dict[str, Any]]:
    ns = _gateway_namespace(opts)
    gateway = [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": opts.gateway}]
    docs: list[dict[str, Any]] = [
        envoy_gateway_ext_proc(config, opts),
        envoy_proxy(opts),
        {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "ClientTrafficPolicy",
         "metadata": {"name": opts.name, "namespace": ns},
         "spec": {"targetRefs": gateway,
                  "headers": {"earlyRequestHeaders": {"remove": internal_headers()}},
                  "connection": {"bufferLimit": str(buffer_limit_bytes(config.server))}}},
    ]
    if ns != opts.namespace:
        docs.append({
            "apiVersion": "gateway.networking.k8s.io/v1beta1", "kind": "ReferenceGrant",
            "metadata": {"name": f"{opts.name}-access-log", "namespace": opts.namespace},
            "spec": {"from": [{"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "namespace": ns}],
                     "to": [{"group": "", "kind": "Service", "name": opts.name}]},
        })
    return docs


def istio_tls(config: Config, opts: Options) -> list[dict[str, Any]]:
    """Istio: a DestinationRule per ``https://`` backend, so the gateway
    originates TLS (SNI and certificate check on the backend's host) instead
    of speaking plaintext to port 443."""
    from .k8s import _meta, backend_refs

    out = []
    for r in backend_refs(config, opts.backend_urls).values():
        if not r.tls:
            continue
        ns = r.namespace or opts.namespace
        meta = _meta(r.service, opts, "backend", namespace=ns)
        out.append({"apiVersion": "networking.istio.io/v1beta1", "kind": "DestinationRule", "metadata": meta,
                    "spec": {"host": f"{r.service}.{ns}.svc.cluster.local",
                             "trafficPolicy": {"tls": {"mode": "SIMPLE", "sni": r.host}}}})
    return out

"""The Envoy bootstrap for a config: the one place that knows Envoy's API.

The layout:

- one public listener whose HTTP connection manager strips every client
  header in the router's namespaces (``x-model-router-*``, ``x-continuum-*``)
  before any filter runs, calls the sidecar through
  ``envoy.filters.http.ext_proc`` and routes on the sidecar's
  ``x-model-router-backend`` header (``cluster_header``);
- one cluster per backend, named after it (TLS with SNI for https URLs);
- one ``model-router-sidecar`` cluster whose endpoints are the sidecar
  processes (HTTP/2, round robin across them);
- buffer limits sized for the configured body limit, and JSON bodies for
  Envoy's own error replies.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from .. import decision
from ..config import address
from ..config.schema import RESERVED_BACKEND_NAME, Config, Server
from ..contract import (
    HEALTH_FAILURES,
    HEALTH_INTERVAL_S,
    MAX_WAIT_METADATA,
    REPLY_NAMESPACE,
    RESPONSE_HEADER,
    SHADOW_HEADER,
    USAGE_NAMESPACE,
)
from ..routing import snapshot
from ..routing.snapshot import (
    ATTRIBUTION_HEADERS,
    BACKEND_HEADER,
    CACHE_HEADER,
    CLIENT_ROUTER_HEADERS,
    EXPLAIN_HEADER,
    ROUTER_HEADER_PREFIXES,
)
from ..serve import grpc_auth, workers
from . import envoy_fallback, envoy_limits, envoy_replies, envoy_shadow

_T = "type.googleapis.com/"
MAX_MESSAGE_TIMEOUT_S = 610  # the decision filter's max_message_timeout (the longest :online deadline, and a margin)


def _addr(listen: str) -> dict[str, Any]:
    host, port = address.split(listen)
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _backend_cluster(name: str, url: str, buffer_limit: int) -> dict[str, Any]:
    host, port, tls, _ = address.split_url(url)
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "per_connection_buffer_limit_bytes": buffer_limit,
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(f"{host}:{port}"), "hostname": host}}]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
                "common_http_protocol_options": {"idle_timeout": "60s"},
            }
        },
    }
    # Hosts inside a backend that keep failing are ejected by Envoy itself.
    cluster["outlier_detection"] = {
        "consecutive_5xx": 5, "interval": "5s", "base_ejection_time": "15s", "max_ejection_percent": 50,
    }
    if not _is_ip(host):
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if tls:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": host,
                "common_tls_context": {
                    "validation_context": {
                        "trusted_ca": {"filename": "/etc/ssl/certs/ca-certificates.crt"},
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": host}}
                        ],
                    }
                },
            },
        }
    return cluster




# The decision's metadata keys that become response headers.
_ATTRIBUTION_KEYS = {
    "x-continuum-experiment": decision.X_EXPERIMENT,
    "x-continuum-experiment-variant": decision.X_EXPERIMENT_VARIANT,
    "x-continuum-model-variant": decision.X_MODEL_VARIANT,
    "x-continuum-model-variant-applied": decision.X_MODEL_VARIANT_APPLIED,
    "x-continuum-fallback-model": decision.X_FALLBACK_MODEL,
    EXPLAIN_HEADER: decision.X_EXPLAIN,
    CACHE_HEADER: decision.X_CACHE,
}
RESPONSE_FILTER = "envoy.filters.http.ext_proc/response"


# Anthropic ingresses also return the request id as ``request-id`` (what the
# Anthropic SDK reads); the OpenAI SDK reads ``x-request-id``, always sent.
_ANTHROPIC_REQUEST_ID = ("request-id", decision.X_REQUEST_ID)


def _attribution_headers() -> list[dict[str, Any]]:
    return [
        {
            "header": {"key": name, "value": f"%DYNAMIC_METADATA({REPLY_NAMESPACE}:{key})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            "keep_empty_value": False,
        }
        for name, key in (*_ATTRIBUTION_KEYS.items(), _ANTHROPIC_REQUEST_ID)
    ]


def not_one_of(words: Sequence[str]) -> str:
    """An RE2 pattern (matched whole) for every string except ``words``: RE2 has
    no lookahead, so the complement is spelled out over the words' prefixes."""
    firsts = sorted({w[0] for w in words if w})
    alternatives = [""] if "" not in words else []
    alternatives.append("[^" + "".join(re.escape(c) for c in firsts) + "].*" if firsts else ".+")
    for c in firsts:
        alternatives.append(re.escape(c) + "(?:" + not_one_of([w[1:] for w in words if w[:1] == c]) + ")")
    return "|".join(alternatives)


def _namespace_matchers(prefix: str) -> list[dict[str, Any]]:
    """Key matchers for every header of a router namespace but the ones an
    operator may send; one pattern per first letter of those, since Envoy
    refuses an RE2 program past 100 instructions."""
    spared = [h[len(prefix):] for h in CLIENT_ROUTER_HEADERS if h.startswith(prefix)]
    if not spared:
        return [{"prefix": prefix}]
    firsts = sorted({w[0] for w in spared})
    head = re.escape(prefix)
    patterns = [head + "(?:[^" + "".join(re.escape(c) for c in firsts) + "].*)?"]
    patterns += [head + re.escape(c) + "(?:" + not_one_of([w[1:] for w in spared if w[0] == c]) + ")" for c in firsts]
    return [{"safe_regex": {"regex": p}} for p in patterns]


def backend_routes(config: Config) -> list[tuple[str, str]]:
    """The routing table every generated route set is built from: the value of
    the sidecar's routing header (``x-model-router-backend``) and the backend
    it selects. The header-match routes here and the Kubernetes routes
    (:mod:`sidecar.deploy.k8s`) both come from it, so they cannot drift apart."""
    return [(b.name, b.name) for b in config.backends]


# header_match: the route a request matches before the sidecar has decided
# (the filters run on it), and the one a request whose routing header names no
# backend ends on: Envoy's own 404, in the ingress's error shape.
UNROUTED = {"name": "unrouted", "match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {
    "inline_string": "no backend was selected for this request"}}}


def _routes(
    timeout_s: int, idle_timeout_s: int, fail_open_cluster: str | None, table: list[tuple[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """Two routes per target: the one the decision selects with
    ``x-model-router-response`` runs the response processor among its
    upstream filters; the other skips it. The target is the cluster named by
    the routing header (``cluster_header``) or, given ``table``, one route pair
    per backend matching the header's value exactly (``header_match``).
    Failing open, a request the sidecar never saw (no backend header) goes to
    ``fail_open_cluster``."""
    action = {
        # A reasoning model may stream for many minutes: the route bounds silence
        # (idle_timeout) and, far larger, the whole exchange (timeout, 0: none).
        "timeout": f"{timeout_s}s",
        "idle_timeout": f"{idle_timeout_s}s",
        "auto_host_rewrite": True,
        "retry_policy": {"retry_on": "connect-failure,reset-before-request", "num_retries": 1},
    }
    disabled = {"@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}
    rewrite = {"name": RESPONSE_HEADER, "string_match": {"exact": "rewrite"}}
    routes: list[dict[str, Any]] = []
    if fail_open_cluster is not None:
        routes.append({
            "name": "fail_open",
            "match": {"prefix": "/", "headers": [{"name": BACKEND_HEADER, "present_match": False}]},
            "route": {**action, "cluster": fail_open_cluster},
            "typed_per_filter_config": {RESPONSE_FILTER: disabled},
        })
    targets: list[tuple[str | None, list[dict[str, Any]], dict[str, str]]]
    targets = [(None, [], {"cluster_header": BACKEND_HEADER})] if table is None else [
        (value, [{"name": BACKEND_HEADER, "string_match": {"exact": value}}], {"cluster": cluster})
        for value, cluster in table
    ]
    for value, match, target in targets:
        prefix = "" if value is None else f"{value}/"
        route = {**target, **action}
        routes += [
            {"name": f"{prefix}rewrite", "match": {"prefix": "/", "headers": [*match, rewrite]}, "route": route},
            {"name": f"{prefix}default", "match": {"prefix": "/", **({"headers": match} if match else {})},
             "route": route, "typed_per_filter_config": {RESPONSE_FILTER: disabled}},
        ]
    return routes if table is None else [*routes, UNROUTED]


def _with_fallback(config: Config, routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The routes of decisions with hops to fall back to come first. They name
    composite clusters, which only Envoy's own configuration has, so in either
    routing mode they take the cluster from the routing header."""
    if not config.fallback_chains:
        return routes
    if config.envoy.routing == "header_match":
        routes_by_header = _routes(config.envoy.upstream_timeout_s, config.envoy.idle_timeout_s, None)
    else:
        routes_by_header = routes
    plain = [r for r in routes_by_header if r["name"] in ("rewrite", "default")]
    return envoy_fallback.routes(config.fallback_attempts, plain) + routes


def _url(config: Config, backend: str) -> str:
    return next(b.url for b in config.backends if b.name == backend)


def _codec() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.upstream_codec",
        "typed_config": {"@type": _T + "envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"},
    }


def _upstream_filters(message_timeout_ms: int, buffer_limit: int, fail_open: bool) -> list[dict[str, Any]]:
    return [_response_ext_proc(message_timeout_ms, buffer_limit, fail_open), _codec()]


def _ext_proc(
    name: str, message_timeout_ms: int, buffer_limit: int, modes: tuple[str, ...], fail_open: bool,
    cluster: str = RESERVED_BACKEND_NAME, initial_metadata: list[dict[str, str]] | None = None, **extra: Any,
) -> dict[str, Any]:
    """An ext_proc filter on the sidecar cluster. ``modes``: request headers,
    request body, response headers, response body (trailers are never sent).
    When the sidecar cannot be reached the request fails (503) or, with
    ``fail_open``, goes on untouched."""
    keys = ("request_header_mode", "request_body_mode", "response_header_mode", "response_body_mode")
    return {
        "name": name,
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster, "max_receive_message_length": buffer_limit},
                "timeout": "30s",
                **({"initial_metadata": initial_metadata} if initial_metadata else {}),
            },
            "failure_mode_allow": fail_open,
            "status_on_error": {"code": 503},
            "message_timeout": f"{message_timeout_ms / 1000:.3f}s",
            "allow_mode_override": True,
            # The sidecar may remove x-envoy-external-address (the client's
            # address) on its way to a hosted backend.
            "mutation_rules": {"allow_envoy": True},
            **extra,
            "processing_mode": {
                **dict(zip(keys, modes)), "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
            },
        },
    }


def _response_ext_proc(message_timeout_ms: int, buffer_limit: int, fail_open: bool) -> dict[str, Any]:
    """The response processor: an upstream filter, so the route chosen after
    the body decision decides whether it runs. Its own gRPC stream starts at
    the response headers and carries the decision in its metadata context."""
    return _ext_proc(
        RESPONSE_FILTER, message_timeout_ms, buffer_limit, ("SKIP", "NONE", "SEND", "STREAMED"), fail_open,
        stat_prefix="response",
        metadata_options={
            "receiving_namespaces": {"untyped": [REPLY_NAMESPACE, USAGE_NAMESPACE]},
            "forwarding_namespaces": {"untyped": [REPLY_NAMESPACE]},
        },
    )


# Where each API family reports usage: OpenAI chat/completions/embeddings
# (usage.prompt_tokens...), Responses and Anthropic bodies (usage.input_tokens...),
# Responses stream events (response.usage...), Anthropic message_start (message.usage).
_USAGE_PATHS = [
    (("usage", "prompt_tokens"), "prompt_tokens"),
    (("usage", "completion_tokens"), "completion_tokens"),
    (("usage", "input_tokens"), "input_tokens"),
    (("usage", "output_tokens"), "output_tokens"),
]
_SSE_USAGE_PATHS = _USAGE_PATHS[:2] + [
    (("response", "usage", "input_tokens"), "input_tokens"),
    (("response", "usage", "output_tokens"), "output_tokens"),
    (("message", "usage", "input_tokens"), "input_tokens"),
    (("usage", "output_tokens"), "output_tokens"),  # Anthropic message_delta: cumulative
]


# What a JSON answer says about itself, for the span (GenAI conventions'
# gen_ai.response.id / .model / .finish_reasons): the id, the model that
# answered, Anthropic's top-level stop_reason (OpenAI's sit inside the choices
# array, which json_to_metadata cannot select).
_RESPONSE_FACTS = [(("id",), "response_id"), (("model",), "response_model"), (("stop_reason",), "finish_reason")]


def _usage_rule(path: tuple[str, ...], key: str, kind: str = "NUMBER") -> dict[str, Any]:
    return {
        "selectors": [{"key": k} for k in path],
        "on_present": {"metadata_namespace": USAGE_NAMESPACE, "key": key, "type": kind},
    }


def json_usage_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.json_to_metadata",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
            "response_rules": {
                "rules": [_usage_rule(p, k) for p, k in _USAGE_PATHS]
                + [_usage_rule(p, k, "STRING") for p, k in _RESPONSE_FACTS],
                # The default matches only a bare application/json; never SSE (it
                # would hold the whole stream).
                "allow_content_types_regex": {"regex": r"^application/json(\s*;.*)?$"},
            },
        },
    }


def _sse_usage_filter() -> dict[str, Any]:
    # Work in progress in Envoy 1.40 (it warns at start); its protos are not in
    # xds-protos yet, so the shape is pinned by tests/integration/test_metering.py.
    return {
        "name": "envoy.filters.http.sse_to_metadata",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.sse_to_metadata.v3.SseToMetadata",
            "response_rules": {
                "content_parser": {
                    "name": "envoy.content_parsers.json",
                    "typed_config": {
                        "@type": _T + "envoy.extensions.content_parsers.json.v3.JsonContentParser",
                        "rules": [{"rule": _usage_rule(p, k)} for p, k in _SSE_USAGE_PATHS],
                    },
                },
                "max_event_size": 1024 * 1024,
            },
        },
    }


def access_log(flush_interval_ms: int, cluster: str = RESERVED_BACKEND_NAME) -> dict[str, Any]:
    """One entry per request to the sidecar's AccessLogService, batched."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "model_router",
                "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                "transport_api_version": "V3",
                "buffer_flush_interval": f"{flush_interval_ms / 1000:.3f}s",
                "buffer_size_bytes": 16384,
            },
            # The client's trace context: the sidecar's spans join its trace.
            "additional_request_headers_to_log": ["traceparent", "tracestate"],
        },
    }


def _fail_open_cluster(config: Config) -> str | None:
    """Where a request goes when the sidecar cannot be reached and the config
    fails open: the passthrough backend, else the first enabled backend."""
    if config.server.failure_mode != "open":
        return None
    if config.proxy.passthrough_backend is not None:
        return config.proxy.passthrough_backend
    return next((b.name for b in config.backends if b.enabled), None)


def _sidecar_guards(server: Server, endpoints: int) -> dict[str, Any]:
    """The ext_proc cluster's protection. A gRPC health check per endpoint: a
    worker that is draining, dead, or a recycling slot's idle port gets no new
    streams (and no panic routing to them: with no healthy worker, Envoy
    answers 503 at once). A worker whose connections fail twice in a row
    is ejected until its health check passes again (at most half the workers;
    a lone one too). A circuit breaker a little above what the workers admit
    refuses a flood at once instead of queueing it on the workers' connections."""
    streams = endpoints * server.max_in_flight * 2 + 64  # request and response streams, and the access log
    return {
        "health_checks": [{
            "timeout": "1s", "interval": f"{HEALTH_INTERVAL_S}s", "no_traffic_interval": f"{HEALTH_INTERVAL_S}s",
            "unhealthy_threshold": HEALTH_FAILURES, "healthy_threshold": 1,
            "grpc_health_check": {},
        }],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "outlier_detection": {
            "split_external_local_origin_errors": True, "consecutive_local_origin_failure": 2,
            "enforcing_consecutive_local_origin_failure": 100, "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0, "enforcing_success_rate": 0,
            "interval": "1s", "base_ejection_time": "1s", "max_ejection_percent": 50,
        },
        "circuit_breakers": {"thresholds": [{
            "max_connections": 1024, "max_pending_requests": streams, "max_requests": streams,
        }]},
    }


def buffer_limit_bytes(server: Server) -> int:
    return server.max_body_bytes + 1024 * 1024


def decision_filter(config: Config, cluster: str = RESERVED_BACKEND_NAME) -> dict[str, Any]:
    """The ext_proc filter that asks the sidecar for the decision, calling it
    through ``cluster``. Two messages per request: the decision needs the
    request only. The sidecar turns the response headers off on every request
    it lets on (see _MODE_BODY_NEXT in handlers/request_stream.py)."""
    server = config.server
    return _ext_proc(
        "envoy.filters.http.ext_proc", server.message_timeout_ms, buffer_limit_bytes(server),
        ("SEND", "BUFFERED", "SEND", "NONE"), server.failure_mode == "open", cluster,
        # The :online loop and a held refusal ask for more time
        # (override_message_timeout), up to this; the streams say so.
        max_message_timeout=f"{MAX_MESSAGE_TIMEOUT_S}s",
        metadata_options={"receiving_namespaces": {"untyped": [REPLY_NAMESPACE]}},
        initial_metadata=[{"key": MAX_WAIT_METADATA, "value": str(MAX_MESSAGE_TIMEOUT_S * 1000)}],
    )


def not_on_header_overflow(http_filter: dict[str, Any]) -> dict[str, Any]:
    """``http_filter``, skipped on Envoy's own 431 (request headers past its
    limit, refused by the codec before any filter saw the request): that
    reply then reaches the client instead of waiting on the sidecar while
    the codec closes the connection. The decision filter never processes
    upstream responses (the sidecar turns them off), so nothing else changes."""
    status = {"name": "status", "typed_config": {
        "@type": _T + "envoy.type.matcher.v3.HttpResponseHeaderMatchInput", "header_name": ":status"}}
    return {"name": http_filter["name"], "typed_config": {
        "@type": _T + "envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        "extension_config": http_filter,
        "xds_matcher": {"matcher_list": {"matchers": [{
            "predicate": {"single_predicate": {"input": status, "value_match": {"exact": "431"}}},
            "on_match": {"action": {"name": "skip", "typed_config": {
                "@type": _T + "envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}},
        }]}},
    }}


def body_buffer(config: Config) -> dict[str, Any]:
    """Envoy holds each request body until it is complete (up to
    ``max_body_bytes``; past it Envoy answers 413) before the decision filter
    opens its stream: a slow upload holds a connection, never one of the
    sidecar's streams. A body bigger than the limit never reaches the sidecar."""
    return {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": config.server.max_body_bytes,
        },
    }


def header_guard() -> dict[str, Any]:
    """The early header mutation that strips every client header in the
    router's namespaces (but the ones an operator may send) before any filter
    or route match sees the request."""
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [
                {"remove_on_match": {"key_matcher": matcher}}
                for prefix in ROUTER_HEADER_PREFIXES for matcher in _namespace_matchers(prefix)
            ],
        },
    }


def bootstrap(
    config: Config,
    *,
    sidecar_addresses: Sequence[str] | None = None,
    backend_urls: Mapping[str, str] | None = None,
    listen: str | None = None,
    admin_listen: str | None = None,
    grpc_secret: str | None = None,
    standby: bool = True,
) -> dict[str, Any]:
    """Build the Envoy bootstrap (as a dict) for ``config``.

    ``sidecar_addresses`` are the ext_proc endpoints (default: the config's
    gRPC listen address); ``backend_urls`` replaces backend URLs (the local
    stack passes the demo engines' addresses for ``demo://`` backends);
    ``grpc_secret`` is what Envoy sends the sidecar (default: the config's
    ``server.grpc_auth``; raises :class:`sidecar.serve.grpc_auth.SecretError` when
    its file cannot be read). With ``server.max_requests_per_worker`` the
    cluster also lists each worker's standby port, where the supervisor starts
    its replacement; ``standby=False`` leaves them out, for sidecars run
    without the supervisor (``serve --no-supervisor``).
    """
    server = config.server
    sidecars = list(sidecar_addresses or [server.grpc_listen])
    endpoints = sidecars + (workers.standby_addresses(sidecars) if standby and server.max_requests_per_worker else [])
    buffer_limit = buffer_limit_bytes(server)
    boot = {
        "admin": {"address": _addr(admin_listen or config.envoy.admin_listen)},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _T + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": config.envoy.max_connections,
            },
        }]},
        "static_resources": {
            "listeners": [_listener(listen or config.envoy.listen, buffer_limit, _connection_manager(config))],
            "clusters": [
                _sidecar_cluster(config, sidecars, endpoints),
                *_backend_clusters(config, dict(backend_urls or {})),
            ],
        },
    }
    secret = grpc_secret if grpc_secret is not None else grpc_auth.secret_of(server.grpc_auth)
    if secret is not None:
        grpc_auth.with_secret(boot, RESERVED_BACKEND_NAME, secret)
    return boot


def _http_filters(config: Config) -> list[dict[str, Any]]:
    """The listener's HTTP filter chain, in the order a request meets it."""
    server = config.server
    return [
        body_buffer(config),  # first: the sidecar sees a request only once it is whole
        not_on_header_overflow(decision_filter(config)),
        # Request rates, on the descriptor the decision names (none: no filter).
        *envoy_limits.filters(config),
        # Token usage into metadata, read from the upstream's bytes (the
        # encode path meets these before ext_proc).
        json_usage_filter(),
        _sse_usage_filter(),
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.router.v3.Router",
                "upstream_http_filters": _upstream_filters(
                    server.message_timeout_ms, buffer_limit_bytes(server), server.failure_mode == "open"),
            },
        },
    ]


def _connection_manager(config: Config) -> dict[str, Any]:
    """The public listener's HTTP connection manager: path normalisation, the
    header guard, client timeouts, the route table and the access log."""
    filters = _http_filters(config)
    return {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "model_router",
        "codec_type": "AUTO",
        "use_remote_address": True,
        # Decide on the path a backend will see: dot segments resolved, slashes
        # merged, escaped slashes decoded (the sidecar decodes the rest).
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "early_header_mutation_extensions": [header_guard()],
        # An upgraded stream has no end to wait for: its chain is the same
        # without the body buffer.
        "upgrade_configs": [{"upgrade_type": "websocket", "filters": filters[1:]}],
        # The id Envoy gives each request names its usage record; the client
        # gets it back to quote.
        "always_set_request_id_in_response": True,
        # The sidecar knows these limits too: it answers 431 rather than send a
        # header mutation that would take a request past them.
        "common_http_protocol_options": {"max_headers_count": config.envoy.max_request_headers},
        "max_request_headers_kb": config.envoy.max_request_headers_kb,
        "stream_idle_timeout": f"{config.envoy.idle_timeout_s}s",
        # How long a client may take to send its request (408 past it).
        "request_headers_timeout": f"{config.envoy.request_headers_timeout_s}s",
        "request_timeout": f"{config.envoy.request_timeout_s}s",
        "route_config": _route_config(config),
        "http_filters": filters,
        "access_log": [access_log(config.metering.flush_interval_ms)],
        "local_reply_config": envoy_replies.local_reply_config(config.server.max_body_bytes),
    }


def _route_config(config: Config) -> dict[str, Any]:
    """One virtual host: the routes (shadow copies and fallback hops woven in)
    and the headers the router owns, removed from requests and responses."""
    return {
        "name": "model_router",
        "request_headers_to_remove": [
            BACKEND_HEADER, RESPONSE_HEADER, SHADOW_HEADER, *CLIENT_ROUTER_HEADERS,
            *envoy_limits.INTERNAL_REQUEST_HEADERS,
        ],
        # An upstream cannot forge the router's attribution; the router's own
        # comes from the decision's metadata (applied after the removal).
        "response_headers_to_remove": [*ATTRIBUTION_HEADERS, *envoy_limits.response_headers_to_remove(config)],
        "response_headers_to_add": _attribution_headers() + envoy_limits.response_headers_to_add(),
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                # The fallback filter reads which attempt it sees.
                **({"include_request_attempt_count": True} if config.fallback_chains and config.fallback_attempts else {}),
                "routes": envoy_shadow.routes(config, _with_fallback(config, _routes(
                    config.envoy.upstream_timeout_s, config.envoy.idle_timeout_s, _fail_open_cluster(config),
                    backend_routes(config) if config.envoy.routing == "header_match" else None,
                ))),
            }
        ],
    }


def _listener(listen: str, buffer_limit: int, hcm: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "public",
        "address": _addr(listen),
        # Without this, a second Envoy on the same address would bind too and
        # silently take half the traffic.
        "enable_reuse_port": False,
        "per_connection_buffer_limit_bytes": buffer_limit,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _sidecar_cluster(config: Config, sidecars: list[str], endpoints: list[str]) -> dict[str, Any]:
    """The sidecar's ext_proc endpoints (standby ports included), over HTTP/2,
    with the health check and circuit breakers its workers expect."""
    server = config.server
    cluster: dict[str, Any] = {
        "name": RESERVED_BACKEND_NAME,
        "type": "STATIC" if all(_is_ip(address.host_of(a)) for a in sidecars) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "per_connection_buffer_limit_bytes": buffer_limit_bytes(server),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "initial_stream_window_size": 16 * 1024 * 1024,
                        "initial_connection_window_size": 64 * 1024 * 1024,
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": RESERVED_BACKEND_NAME,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(a)}} for a in endpoints]}],
        },
        **_sidecar_guards(server, len(sidecars)),
    }
    if server.grpc_auth.tls is not None:
        cluster["transport_socket"] = grpc_auth.upstream_tls(server.grpc_auth.tls)
    return cluster


def _backend_clusters(config: Config, urls: dict[str, str]) -> list[dict[str, Any]]:
    """A cluster per backend, then the fallback hops' and the shadow arms'."""
    server = config.server
    buffer_limit = buffer_limit_bytes(server)
    clusters = []
    for b in config.backends:
        url = urls.get(b.name, b.url)
        if url == "demo://":
            raise ValueError(f"backend '{b.name}' is served by a demo engine; pass its address")
        clusters.append(_backend_cluster(b.name, url, buffer_limit))

    def cluster_for(name: str, backend: str) -> dict[str, Any]:
        return _backend_cluster(name, urls.get(backend) or _url(config, backend), buffer_limit)

    clusters += envoy_fallback.clusters(
        snapshot.build(config, urls), config.fallback_attempts, cluster_for,
        _upstream_filters(server.message_timeout_ms, buffer_limit, server.failure_mode == "open"),
    )
    clusters += envoy_shadow.clusters(
        config, cluster_for,
        envoy_shadow.filter_config(_response_ext_proc(server.message_timeout_ms, buffer_limit, False)),
        _codec(),
    )
    return clusters


def render(boot: dict[str, Any]) -> str:
    return yaml.safe_dump(boot, sort_keys=False, default_flow_style=False)

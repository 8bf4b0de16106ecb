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
from typing import Any, Mapping, Sequence

import yaml

from .config import RESERVED_BACKEND_NAME, Config
from .snapshot import ATTRIBUTION_HEADERS, BACKEND_HEADER, ROUTER_HEADER_PREFIXES, _split

_T = "type.googleapis.com/"


def _addr(listen: str) -> dict:
    host, _, port = listen.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _backend_cluster(name: str, url: str, buffer_limit: int) -> dict:
    host, port, tls, _ = _split(url)
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


# Envoy's own refusals (sidecar unreachable or too slow, body over the buffer
# limit, no upstream, timeouts) get a JSON body in the ingress's error shape.
# The sidecar's immediate responses carry the dynamic metadata below and are
# already JSON: the first mapper matches them and leaves them untouched.
REPLY_NAMESPACE = "model_router"


def _status_at_least(code: int) -> dict:
    return {"status_code_filter": {"comparison": {"op": "GE", "value": {"default_value": code, "runtime_key": "model_router.local_reply_min_status"}}}}


def _local_reply_config() -> dict:
    ours = {
        "metadata_filter": {
            "matcher": {"filter": REPLY_NAMESPACE, "path": [{"key": "reply"}], "value": {"present_match": True}},
            "match_if_key_not_found": False,
        }
    }
    anthropic_path = {"header_filter": {"header": {"name": ":path", "string_match": {"prefix": "/anthropic/"}}}}
    return {
        "mappers": [
            {"filter": ours},
            {
                "filter": {"and_filter": {"filters": [_status_at_least(400), anthropic_path]}},
                "body_format_override": {
                    "json_format": {"type": "error", "error": {"type": "api_error", "message": "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"}},
                    "content_type": "application/json",
                },
            },
            {
                "filter": _status_at_least(400),
                "body_format_override": {
                    "json_format": {
                        "error": {
                            "message": "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)",
                            "type": "server_error",
                            "param": None,
                            "code": "%RESPONSE_CODE%",
                        }
                    },
                    "content_type": "application/json",
                },
            },
        ]
    }


def bootstrap(
    config: Config,
    *,
    sidecar_addresses: Sequence[str] | None = None,
    backend_urls: Mapping[str, str] | None = None,
    listen: str | None = None,
    admin_listen: str | None = None,
) -> dict:
    """Build the Envoy bootstrap (as a dict) for ``config``.

    ``sidecar_addresses`` are the ext_proc endpoints (default: the config's
    gRPC listen address); ``backend_urls`` replaces backend URLs (the local
    stack passes the demo engines' addresses for ``demo://`` backends).
    """
    urls = dict(backend_urls or {})
    server = config.server
    sidecars = list(sidecar_addresses or [server.grpc_listen])
    buffer_limit = server.max_body_bytes + 1024 * 1024
    timeout_s = config.envoy.upstream_timeout_s

    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": RESERVED_BACKEND_NAME, "max_receive_message_length": buffer_limit},
                "timeout": "30s",
            },
            "failure_mode_allow": False,
            "status_on_error": {"code": 503},
            "message_timeout": f"{server.message_timeout_ms / 1000:.3f}s",
            # The :online loop asks for more time (override_message_timeout), up to this.
            "max_message_timeout": "610s",
            "allow_mode_override": True,
            "metadata_options": {"receiving_namespaces": {"untyped": [REPLY_NAMESPACE]}},
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    hcm = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "model_router",
        "codec_type": "AUTO",
        "use_remote_address": True,
        # Decide on the path a backend will see: dot segments resolved, slashes
        # merged, escaped slashes decoded (the sidecar decodes the rest).
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": {
                    "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    "mutations": [
                        {"remove_on_match": {"key_matcher": {"prefix": prefix}}} for prefix in ROUTER_HEADER_PREFIXES
                    ],
                },
            }
        ],
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        # The sidecar knows these limits too: it answers 431 rather than send a
        # header mutation that would take a request past them.
        "common_http_protocol_options": {"max_headers_count": config.envoy.max_request_headers},
        "max_request_headers_kb": config.envoy.max_request_headers_kb,
        "stream_idle_timeout": f"{timeout_s}s",
        "request_timeout": "0s",
        "route_config": {
            "name": "model_router",
            "request_headers_to_remove": [BACKEND_HEADER],
            # An upstream cannot forge the router's attribution either.
            "response_headers_to_remove": list(ATTRIBUTION_HEADERS),
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster_header": BACKEND_HEADER,
                                "timeout": f"{timeout_s}s",
                                "auto_host_rewrite": True,
                                "retry_policy": {"retry_on": "connect-failure,reset-before-request", "num_retries": 1},
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [
            ext_proc,
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _T + "envoy.extensions.filters.http.router.v3.Router"}},
        ],
        "local_reply_config": _local_reply_config(),
    }
    clusters = [
        {
            "name": RESERVED_BACKEND_NAME,
            "type": "STATIC",
            "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "per_connection_buffer_limit_bytes": buffer_limit,
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
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(a)}} for a in sidecars]}],
            },
        }
    ]
    if not all(_is_ip(a.rpartition(":")[0].strip("[]")) for a in sidecars):
        clusters[0]["type"] = "STRICT_DNS"
    for b in config.backends:
        url = urls.get(b.name, b.url)
        if url == "demo://":
            raise ValueError(f"backend '{b.name}' is served by a demo engine; pass its address")
        clusters.append(_backend_cluster(b.name, url, buffer_limit))

    return {
        "admin": {"address": _addr(admin_listen or config.envoy.admin_listen)},
        "static_resources": {
            "listeners": [
                {
                    "name": "public",
                    "address": _addr(listen or config.envoy.listen),
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
            ],
            "clusters": clusters,
        },
    }


def render(boot: dict) -> str:
    return yaml.safe_dump(boot, sort_keys=False, default_flow_style=False)

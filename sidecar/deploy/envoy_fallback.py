"""The Envoy side of fallback after a failed attempt (see docs/envoy.md).

- per hop count n (1..``fallback_attempts``), a route for decisions whose
  routing header names a composite cluster of n hops (``fallback<n>~...``):
  the plain route's action with a retry policy of n retries on connect
  failure, reset, 5xx and 429;
- per (first backend, hops' backends) a decision can name, a composite cluster
  (``envoy.clusters.composite``): attempt n goes to its n-th member. Its
  upstream filter chain starts with the fallback filter: ext_proc behind a
  matcher that skips it when ``x-envoy-attempt-count`` is 1, so only a later
  attempt asks the sidecar to rewrite the request for its hop;
- per backend in any composite, a member cluster: the backend's cluster
  without outlier ejection (a composite moves an attempt on to the next
  member when one has no host, which would send the wrong model).

The building blocks of a plain backend cluster and of the filters come from
:mod:`sidecar.deploy.envoy`; this module only arranges them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..contract import ATTEMPT_HEADER, NAMESPACE
from ..routing import attempts
from ..routing.attempts import COMPOSITE_PREFIX
from ..routing.snapshot import BACKEND_HEADER, Snapshot

_T = "type.googleapis.com/"
HOP_FILTER = "envoy.filters.http.ext_proc/hop"
# Retries a composite cluster lets run at once (Envoy's default is 3 per
# cluster, which would turn fallbacks off under a burst of failures).
MAX_CONCURRENT_RETRIES = 1024


def retry_policy(hops: int) -> dict[str, Any]:
    return {
        "retry_on": "connect-failure,reset,5xx,retriable-status-codes",
        "retriable_status_codes": [429],
        "num_retries": hops,
        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.05s"},
    }


def routes(max_hops: int, plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each of the ``plain`` routes (rewrite, default), one per hop count
    that also matches the composite prefix and retries that many times."""
    out = []
    for n in range(1, max_hops + 1):
        for route in plain:
            match = dict(route["match"])
            match["headers"] = [*match.get("headers", []),
                                {"name": BACKEND_HEADER, "string_match": {"prefix": f"{COMPOSITE_PREFIX}{n}~"}}]
            out.append({**route, "name": f"{route['name']}_fallback{n}", "match": match,
                        "route": {**route["route"], "retry_policy": retry_policy(n)}})
    return out


def clusters(
    snap: Snapshot, max_hops: int, backend_cluster: Callable[[str, str], dict[str, Any]], filters: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """The member and composite clusters. ``backend_cluster(name, backend)``
    builds a plain cluster for a backend under another name; ``filters`` is
    the composites' upstream filter chain after the fallback filter."""
    if max_hops == 0 or not snap.config.fallback_chains:
        return []
    composites = attempts.composites(snap, max_hops)
    out = []
    for backend in sorted({b for members in composites.values() for b in members}):
        cluster = backend_cluster(attempts.member_cluster(backend), backend)
        cluster.pop("outlier_detection", None)
        out.append(cluster)
    chain = [fallback_filter(filters[0]), *filters]
    out.extend(_composite(name, members, chain) for name, members in sorted(composites.items()))
    return out


def fallback_filter(ext_proc: dict[str, Any]) -> dict[str, Any]:
    """The hop ext_proc filter (a copy of ``ext_proc``'s shape), skipped on a
    request's first attempt."""
    config = dict(ext_proc["typed_config"])
    config.update(
        stat_prefix="hop",
        failure_mode_allow=False,  # the request as it stands names another model
        processing_mode={
            "request_header_mode": "SEND", "request_body_mode": "BUFFERED", "response_header_mode": "SKIP",
            "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
        },
        metadata_options={"receiving_namespaces": {"untyped": [NAMESPACE]},
                          "forwarding_namespaces": {"untyped": [NAMESPACE]}},
    )
    skip = {"name": "first-attempt", "typed_config": {
        "@type": _T + "envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}
    return {
        "name": HOP_FILTER,
        "typed_config": {
            "@type": _T + "envoy.extensions.common.matching.v3.ExtensionWithMatcher",
            "extension_config": {"name": HOP_FILTER, "typed_config": config},
            "xds_matcher": {"matcher_tree": {
                "input": {"name": "attempt", "typed_config": {
                    "@type": _T + "envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                    "header_name": ATTEMPT_HEADER}},
                "exact_match_map": {"map": {"1": {"action": skip}}},
            }},
        },
    }


def _composite(name: str, members: list[str], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "connect_timeout": "5s",
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.composite",
            "typed_config": {
                "@type": _T + "envoy.extensions.clusters.composite.v3.ClusterConfig",
                "clusters": [{"name": attempts.member_cluster(m)} for m in members],
            },
        },
        # The route's cluster supplies the upstream filter chain of every attempt.
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": filters,
        }},
        "circuit_breakers": {"thresholds": [{"max_retries": MAX_CONCURRENT_RETRIES}]},
    }

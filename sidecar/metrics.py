"""Prometheus metrics. Every label value comes from config or a closed set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

EXPERIMENT_REQUESTS = Counter(
    "model_experiment_requests_total",
    "Requests resolved by a model experiment, by arm, status class and assignment kind.",
    ["experiment", "variant", "status", "assignment"],
    registry=REGISTRY,
)
EXPERIMENT_DURATION = Histogram(
    "model_experiment_request_duration_seconds",
    "Time from the request reaching the sidecar to the response headers (stream start), per arm.",
    ["experiment", "variant"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
EXPERIMENT_TOKENS = Counter(
    "model_experiment_tokens_total",
    "Tokens reported in responses of experiment requests, per arm.",
    ["experiment", "variant", "kind"],
    registry=REGISTRY,
)
RESERVED_REFUSALS = Counter(
    "model_experiment_reserved_refusals_total",
    "Direct requests for a reserved variant model that were refused.",
    ["experiment"],
    registry=REGISTRY,
)
VARIANT_REQUESTS = Counter(
    "continuum_model_variant_requests_total",
    "Requests carrying a model variant suffix, by variant and whether it took effect.",
    ["variant", "applied"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "model_router_decisions_total",
    "Routing decisions, by outcome (routed, passthrough, or the refusal's HTTP status).",
    ["outcome"],
    registry=REGISTRY,
)
CONFIG_RELOADS = Counter(
    "model_router_config_reloads_total",
    "Config reload attempts, by result.",
    ["result"],
    registry=REGISTRY,
)
CONFIG_LOADED = Gauge(
    "model_router_config_last_success_timestamp_seconds",
    "Unix time of the last config load that took effect.",
    registry=REGISTRY,
)
STREAM_ERRORS = Counter(
    "model_router_stream_errors_total",
    "ext_proc streams that ended with an error inside the sidecar.",
    registry=REGISTRY,
)


WEB_SEARCH_REQUESTS = Counter(
    "model_router_web_search_requests_total",
    ":online requests by outcome (success, provider_error, upstream_error, deadline).",
    ["result"],
    registry=REGISTRY,
)
WEB_SEARCHES = Counter(
    "model_router_web_searches_total", "Searches sent to the web-search provider.", registry=REGISTRY,
)
WEB_SEARCH_ITERATIONS = Counter(
    "model_router_web_search_iterations_total", "Model calls made by :online tool loops.", registry=REGISTRY,
)
WEB_SEARCH_ERRORS = Counter(
    "model_router_web_search_provider_errors_total", "Failed calls to the web-search provider.", registry=REGISTRY,
)


def status_class(status: int) -> str:
    if status >= 500:
        return "server_error"
    if status >= 400:
        return "client_error"
    return "success"

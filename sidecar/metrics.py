"""Prometheus metrics. Every label value comes from config or a closed set.

Every label set the config implies is created when the config loads
(:func:`prime`), so ``rate()`` and ``increase()`` see a series' first event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from .config.schema import Config

# A *_created series per label set doubles what a scrape carries and no query here uses it.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry(auto_describe=True)
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)

# Seconds, for every latency histogram: short answers to hour-long streams' headers.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

EXPERIMENT_REQUESTS = Counter(
    "model_experiment_requests_total",
    "Requests resolved by a model experiment, by arm, status class and assignment kind.",
    ["experiment", "variant", "status", "assignment"],
    registry=REGISTRY,
)
EXPERIMENT_DURATION = Histogram(
    "model_experiment_request_duration_seconds",
    "Time from the request reaching Envoy to the response headers sent to the client, per arm.",
    ["experiment", "variant"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
EXPERIMENT_TOKENS = Counter(
    "model_experiment_tokens_total",
    "Tokens reported in responses of experiment requests, per arm.",
    ["experiment", "variant", "kind"],
    registry=REGISTRY,
)
EXPERIMENT_ESTIMATED_TOKENS = Counter(
    "model_experiment_estimated_tokens_total",
    "The part of model_experiment_tokens_total that is an estimate: requests whose usage never arrived "
    "(a stream cut before its usage event, a background create).",
    ["experiment", "variant", "kind"],
    registry=REGISTRY,
)
# Shadow arms have names of their own: a shadow copy is not a request any
# caller made, so sums over the live arms' series (traffic, SRM, error rates)
# stay what they were (docs/experiments.md).
SHADOW_COPIES = Counter(
    "model_experiment_shadow_copies_total",
    "Requests the router asked Envoy to copy to a shadow arm (those it let on upstream).",
    ["experiment", "variant"],
    registry=REGISTRY,
)
SHADOW_REQUESTS = Counter(
    "model_experiment_shadow_requests_total",
    "Shadow copies that reached the shadow arm's upstream filter, by status class; a copy Envoy could not "
    "connect for, or dropped at max_in_flight, is in model_experiment_shadow_copies_total only.",
    ["experiment", "variant", "status"],
    registry=REGISTRY,
)
SHADOW_DURATION = Histogram(
    "model_experiment_shadow_request_duration_seconds",
    "Time from the shadow copy leaving Envoy to its response headers, per shadow arm.",
    ["experiment", "variant"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SHADOW_TTFT = Histogram(
    "model_experiment_shadow_time_to_first_token_seconds",
    "Time from the shadow copy leaving Envoy to the first body bytes of its event stream, per shadow arm.",
    ["experiment", "variant"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SHADOW_TOKENS = Counter(
    "model_experiment_shadow_tokens_total",
    "Tokens reported in shadow arms' responses.",
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
WORKER_RESTARTS = Gauge(
    "model_router_worker_restarts",
    "Times this worker's slot was started again before this process: after a crash, or recycled "
    "(server.max_requests_per_worker).",
    ["reason"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "model_router_in_flight_streams",
    "ext_proc streams this worker holds open.",
    registry=REGISTRY,
)
SHED = Counter(
    "model_router_shed_total",
    "Requests refused with 503 because the worker held server.max_in_flight streams.",
    registry=REGISTRY,
)


# At selection (the model had no admissible backend); after a failed attempt
# (connect failure, reset, 5xx, 429).
FALLBACK_REASONS = ("no_admissible_backend", "upstream_error")
FALLBACKS = Counter(
    "model_router_fallbacks_total",
    "Requests served by a fallback-chain hop (experiment and variant empty outside experiments; "
    "the arm's own metrics still count them).",
    ["experiment", "variant", "from_model", "to_model", "reason"],
    registry=REGISTRY,
)

BACKEND_METRICS_MISSING = Gauge(
    "model_router_backend_engine_metrics_missing",
    "1 while a scraped backend answers its metrics path without any series of its engine (SGLang without "
    "--enable-metrics answers 404): :nitro cannot rank it and max_waiting cannot gate it. Set by the monitor.",
    ["backend"],
    registry=REGISTRY,
)

ACCESS_LOG_ENTRIES = Counter(
    "model_router_access_log_entries_total",
    "Per-request access-log entries received from Envoy (compare with Envoy's own count to see loss).",
    registry=REGISTRY,
)
GRPC_UNAUTHENTICATED = Counter(
    "model_router_grpc_unauthenticated_total",
    "gRPC calls refused with UNAUTHENTICATED: no or a wrong server.grpc_auth secret (or Assignment token), by service.",
    ["service"],
    registry=REGISTRY,
)
USAGE_RECORDS_DROPPED = Counter(
    "model_router_usage_records_dropped_total",
    "Usage records that could not be written to their sink.",
    registry=REGISTRY,
)
TRACE_SPANS_EXPORTED = Counter(
    "model_router_trace_spans_exported_total",
    "router.request spans the OTLP collector accepted.",
    registry=REGISTRY,
)
TRACE_SPANS_DROPPED = Counter(
    "model_router_trace_spans_dropped_total",
    "router.request spans lost: the export queue was full, the export failed, or the collector rejected them.",
    ["reason"],
    registry=REGISTRY,
)
for _reason in ("queue_full", "export_failed", "rejected"):
    TRACE_SPANS_DROPPED.labels(_reason)

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

EXPERIMENT_CACHE_HITS = Counter(
    "model_experiment_cache_hits_total",
    "The arm's requests answered from the response cache (also counted in model_experiment_requests_total).",
    ["experiment", "variant"],
    registry=REGISTRY,
)
VARIANT_PAUSED = Gauge(
    "model_experiment_variant_paused",
    "1 while the arm is paused (out of the race, its weight kept), else 0; set when the config loads.",
    ["experiment", "variant"],
    registry=REGISTRY,
)
VARIANT_WEIGHT = Gauge(
    "model_experiment_variant_weight",
    "The arm's weight in the race (0 while paused); role is control for the first declared variant, which "
    "the error-rate rules compare the others with, else treatment.",
    ["experiment", "variant", "role"],
    registry=REGISTRY,
)


class Tally:
    """A counter family the request path bumps once per request: each label
    set's count a plain number, exposed when the registry is scraped.
    ``prometheus_client``'s ``Counter.inc`` checks its labels and takes a lock
    on every call; here an increment is one dict update. Increments only on
    the event loop's thread; a scrape may run on another (the experiments
    report reads the registry in a worker thread) and copies the counts in
    one native call. Label values from a closed set."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self._counts: dict[tuple[str, ...], int] = {}
        registry.register(self)

    def inc(self, *values: str) -> None:
        """One more of the label set ``values``."""
        counts = self._counts
        counts[values] = counts.get(values, 0) + 1

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, n in list(self._counts.items()):
            family.add_metric(values, n)
        return [family]


DECISIONS = Tally(
    "model_router_decisions_total",
    "Routing decisions, by outcome (routed, passthrough, or the refusal's HTTP status).",
    ("outcome",),
    registry=REGISTRY,
)


class Children:
    """A labelled metric's children, each looked up once: ``labels()`` checks,
    converts and locks on every call, a dict lookup does not. Only for metrics
    whose children are never removed (a removed child would stay cached)."""

    __slots__ = ("metric", "_known")
    LIMIT = 10_000  # label sets kept before starting over (they come from config and closed sets)

    def __init__(self, metric: Counter | Gauge | Histogram) -> None:
        self.metric = metric
        self._known: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._known.get(values)
        if child is None:
            if len(self._known) >= self.LIMIT:
                self._known.clear()
            child = self._known[values] = self.metric.labels(*values)
        return child


EXPERIMENT_REQUESTS_OF = Children(EXPERIMENT_REQUESTS)
EXPERIMENT_DURATION_OF = Children(EXPERIMENT_DURATION)
EXPERIMENT_TOKENS_OF = Children(EXPERIMENT_TOKENS)


STATUSES = ("success", "client_error", "server_error")
ASSIGNMENTS = ("sticky", "random")
SUFFIXES = ("nitro", "floor", "thinking", "online")


LIMIT_REFUSALS = Counter(
    "model_router_limit_refusals_total",
    "Requests refused by a limit: kind requests (Envoy's request-rate filter) or tokens (a spent token budget).",
    ["model", "key_id", "kind"],
    registry=REGISTRY,
)


def prime(config: Config) -> None:
    """Create every label set ``config`` implies, at zero."""
    for result in ("success", "failure"):
        CONFIG_RELOADS.labels(result)
    VARIANT_PAUSED.clear()  # arms the config no longer has leave the page
    VARIANT_WEIGHT.clear()
    for e in config.model_experiments:
        for j, v in enumerate(e.variants):
            VARIANT_PAUSED.labels(e.name, v.id).set(1 if v.paused else 0)
            VARIANT_WEIGHT.labels(e.name, v.id, "control" if j == 0 else "treatment").set(v.race_weight)
        if e.hide_variant_models:
            RESERVED_REFUSALS.labels(e.name)
        for arm in e.shadows:
            SHADOW_COPIES.labels(e.name, arm.id)
            SHADOW_DURATION.labels(e.name, arm.id)
            SHADOW_TTFT.labels(e.name, arm.id)
            for kind in ("prompt", "completion"):
                SHADOW_TOKENS.labels(e.name, arm.id, kind)
            for status in STATUSES:
                SHADOW_REQUESTS.labels(e.name, arm.id, status)
        for v in e.variants:
            EXPERIMENT_DURATION.labels(e.name, v.id)
            for kind in ("prompt", "completion"):
                EXPERIMENT_TOKENS.labels(e.name, v.id, kind)
                EXPERIMENT_ESTIMATED_TOKENS.labels(e.name, v.id, kind)
            for status in STATUSES:
                for assignment in ASSIGNMENTS:
                    EXPERIMENT_REQUESTS.labels(e.name, v.id, status, assignment)
    chains = config.fallback_chains
    reasons = FALLBACK_REASONS if config.fallback_attempts else FALLBACK_REASONS[:1]
    for origin, chain in chains.items():
        for hop in chain:
            for reason in reasons:
                FALLBACKS.labels("", "", origin, hop, reason)
    for e in config.model_experiments:
        if e.fallback == "cross_variant":
            for v in e.variants:
                for hop in chains.get(v.model, ()):
                    for reason in reasons:
                        FALLBACKS.labels(e.name, v.id, v.model, hop, reason)
    if config.cache is not None:
        for e in config.model_experiments:
            for v in e.variants:
                EXPERIMENT_CACHE_HITS.labels(e.name, v.id)
    for lim in config.limits:
        for kind, on in (("requests", lim.rate is not None), ("tokens", lim.tokens is not None)):
            if on:
                LIMIT_REFUSALS.labels(lim.model, lim.key_id or "", kind)
    if config.proxy.variant_suffixes.enabled:
        for suffix in SUFFIXES:
            for applied in ("true", "false"):
                VARIANT_REQUESTS.labels(suffix, applied)


STREAMS_CUT = Counter(
    "model_router_streams_cut_total",
    "Event streams the router ended itself with an error event, by reason (idle: the upstream fell silent).",
    ["reason"],
    registry=REGISTRY,
)

"""Configuration: one YAML file loaded into frozen pydantic models.

Loading has three stages, each of which reports every problem it finds with
the dotted path of the offending field:

1. YAML parsing and ``${ENV}`` substitution inside string values,
2. schema validation (types, ranges, unknown fields are errors),
3. cross-field checks (duplicate names, pins naming unknown backends, ...),
   which also produce warnings.

The result is an immutable :class:`Config`; the request path reads derived
lookup tables from :class:`sidecar.routing.snapshot.Snapshot`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..payload.body import model_name_problem
from . import address
from .engines import ENGINES, LIVENESS, EngineSpec, HealthCheck

# Matched against the whole string (fullmatch): "$" alone would accept a
# trailing newline, which a YAML block scalar adds silently.
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
# The Envoy cluster that carries the ext_proc gRPC stream; no backend may take it.
RESERVED_BACKEND_NAME = "model-router-sidecar"
MAX_EXPERIMENTS = 32
MAX_VARIANTS = 16
MAX_WEIGHT = 1_000_000
TTL_MIN = 60
TTL_MAX = 365 * 86400
# Requests a worker answers before the supervisor replaces it: at the measured
# native growth (about 70 bytes per request, docs/performance.md) a worker stays
# within about 5 MB of a fresh one (its bound is drawn within 10 %).
DEFAULT_MAX_REQUESTS_PER_WORKER = 50_000
# Without the supervisor (a pod) a recycle is a container restart: rarer.
DEFAULT_RETIRE_AFTER = 2_000_000
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_TTL_RE = re.compile(r"([0-9]+)([smhd]?)")
_TTL_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class ConfigError(Exception):
    """A configuration that cannot be used; ``errors`` lists every problem."""

    def __init__(self, errors: list[str], warnings: list[str] | None = None):
        self.errors = errors
        self.warnings = warnings or []
        super().__init__("; ".join(errors))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_duration(value: Any) -> int:
    """Parse a whole number of seconds with an optional s/m/h/d unit."""
    if isinstance(value, bool):
        raise ValueError("must be a whole number with an optional s, m, h or d unit")
    if isinstance(value, int):
        return value
    m = _TTL_RE.fullmatch(str(value).strip())
    if not m:
        raise ValueError("must be a whole number with an optional s, m, h or d unit")
    return int(m.group(1)) * _TTL_UNIT[m.group(2)]


def _listen(value: str) -> str:
    host, _ = address.split(value)
    if not host:
        raise ValueError("must be host:port")
    return value


def _check_model_name(v: str) -> str:
    problem = model_name_problem(v)
    if problem is not None:
        raise ValueError(f"a model name {problem[1]}")
    return v


def _check_name(v: str) -> str:
    if not NAME_RE.fullmatch(v):
        raise ValueError(f"must be 1 to 64 of A-Z a-z 0-9 . _ - (got {v!r})")
    return v


# A backend, experiment or variant identifier, and a model name.
Name = Annotated[str, AfterValidator(_check_name)]
ModelName = Annotated[str, AfterValidator(_check_model_name)]


class GrpcTls(_Model):
    """mTLS on the gRPC port: the sidecar's certificate, the CA its callers'
    certificates must chain to, and the client certificate Envoy presents."""

    cert_file: str  # the sidecar's certificate chain (PEM)
    key_file: str  # its private key (PEM)
    client_ca_file: str  # a caller without a certificate signed by this CA is refused at the handshake
    envoy_cert_file: str  # written into the Envoy bootstrap: the certificate Envoy presents
    envoy_key_file: str
    ca_file: str | None = None  # what Envoy trusts for the sidecar's certificate; default client_ca_file
    server_name: str | None = None  # the SNI and SAN Envoy expects from the sidecar; default: any


class GrpcAuth(_Model):
    """Who may call the gRPC port (docs/security.md, "Control plane")."""

    # The per-deployment secret Envoy sends in gRPC metadata; give it as
    # ${ENV} or in a file. Unset (and no tls): the port trusts its network and
    # serve refuses to listen beyond loopback.
    secret: str | None = None
    secret_file: str | None = None
    tls: GrpcTls | None = None
    # The Assignment API's own credential (other services call it, never Envoy):
    # sent as "authorization: Bearer <token>" metadata.
    assignment_token: str | None = None

    @field_validator("secret", "assignment_token")
    @classmethod
    def _long_enough(cls, v: str | None) -> str | None:
        if v is not None and len(v) < 16:
            raise ValueError("must be at least 16 characters (model-router up generates 43)")
        if v is not None and any(ord(c) < 0x21 or ord(c) == 0x7F for c in v):
            raise ValueError("must not contain spaces or control characters (it travels as gRPC metadata)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> GrpcAuth:
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("give secret or secret_file, not both")
        return self


class Server(_Model):
    grpc_listen: str = "127.0.0.1:50051"
    admin_listen: str = "127.0.0.1:9190"
    # Sidecar processes: worker i listens on the gRPC and admin ports plus i,
    # and each is a separate endpoint of Envoy's ext_proc cluster.
    workers: Annotated[int, Field(ge=1, le=16)] = 1
    max_body_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 32 * 1024 * 1024
    admin_token: str | None = None
    # Envoy's wait for one sidecar answer; past it the request fails closed.
    message_timeout_ms: Annotated[int, Field(ge=50, le=60_000)] = 5000
    reload_interval_ms: Annotated[int, Field(ge=100, le=60_000)] = 1000
    # ext_proc streams one worker holds open at once; past it a request is
    # refused at once with 503 and retry-after rather than queued.
    max_in_flight: Annotated[int, Field(ge=1, le=100_000)] = 256
    # Recycle a worker after about this many requests (each worker draws its
    # bound within 10 % of it, so they do not recycle together); 0: never.
    # On by default: grpc.aio keeps native memory per stream (docs/performance.md).
    max_requests_per_worker: Annotated[int, Field(ge=0)] = DEFAULT_MAX_REQUESTS_PER_WORKER
    # On SIGTERM, how long a worker lets its in-flight streams finish.
    drain_timeout_s: Annotated[int, Field(ge=0, le=3600)] = 30
    # closed: a request fails (503) when the sidecar cannot be reached; open:
    # it goes on with the client's model untouched (refused when a key gate or
    # a hidden experiment exists, since those would then be skipped).
    failure_mode: Literal["closed", "open"] = "closed"
    grpc_auth: GrpcAuth = GrpcAuth()

    @field_validator("grpc_listen", "admin_listen")
    @classmethod
    def _listen_addr(cls, v: str) -> str:
        return _listen(v)


class Envoy(_Model):
    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9901"
    concurrency: Annotated[int, Field(ge=1, le=64)] = 2
    # Downstream connections Envoy holds at once; past it new ones are refused.
    max_connections: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000
    # The longest silence between bytes of a request or its answer (covers the
    # wait for a buffered answer's first byte); a live stream is never cut by it.
    idle_timeout_s: Annotated[int, Field(ge=1, le=3600)] = 300
    # The whole exchange, long streams included; 0: no bound beyond the idle timeout.
    upstream_timeout_s: Annotated[int, Field(ge=0, le=86_400)] = 3600
    # How long a client may take to send its request headers, and its whole
    # request (headers, body and the decision on it; 0: no bound). Envoy holds a
    # body until it is complete before the sidecar sees the request, so a slow
    # upload holds a connection, never a decision stream, and no longer than this.
    request_headers_timeout_s: Annotated[int, Field(ge=1, le=3600)] = 10
    request_timeout_s: Annotated[int, Field(ge=0, le=86_400)] = 300
    # Envoy's limits for a request's headers (its own defaults). The sidecar
    # answers 431 when its routing headers would push a request past them.
    max_request_headers: Annotated[int, Field(ge=32, le=1000)] = 100
    max_request_headers_kb: Annotated[int, Field(ge=8, le=8192)] = 60
    # How the route reads the sidecar's choice: "cluster_header" (one route,
    # the cluster named by the routing header) or "header_match" (one route per
    # backend matching that header's value: the form Gateway API and Istio express).
    routing: Literal["cluster_header", "header_match"] = "cluster_header"

    @field_validator("listen", "admin_listen")
    @classmethod
    def _listen_addr(cls, v: str) -> str:
        return _listen(v)


BackendType = Literal["openai", "vllm", "sglang", "tgi", "llamacpp", "anthropic"]


class Backend(_Model):
    name: Name
    url: str
    type: BackendType = "openai"
    models: list[ModelName] | None = None
    internal: bool = False
    api_key: str | None = None
    weight: Annotated[int, Field(ge=1, le=MAX_WEIGHT)] = 1
    enabled: bool = True
    # "" turns a default off; None keeps the default for the backend's type.
    health_path: str | None = None
    metrics_path: str | None = None
    # A hosted commercial API: the router never injects tools into its requests.
    commercial: bool = False
    # Whether the client's address (x-forwarded-for, x-envoy-external-address)
    # travels to this backend; None: to http:// backends only, never to https://.
    forward_client_address: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if v == RESERVED_BACKEND_NAME:
            raise ValueError(f"'{RESERVED_BACKEND_NAME}' is reserved for the sidecar's own cluster")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v == "demo://":
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL, or demo://")
        try:
            _ = parts.port  # urlsplit checks the port only when it is read
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        if parts.query or parts.fragment:
            raise ValueError("must not carry a query or fragment")
        return v

    @property
    def engine(self) -> EngineSpec | None:
        """The engine this backend's type names; None: a hosted API, or any engine its metrics page shows."""
        return ENGINES.get(self.type)

    @property
    def probe_path(self) -> str | None:
        """Active health probe path; hosted APIs are judged passively only."""
        if self.health_path is not None:
            return self.health_path or None
        if self.engine is not None:
            return self.engine.health.path
        return LIVENESS.path if self.is_demo else None

    @property
    def health_check(self) -> HealthCheck | None:
        """The active health check: the engine's rule on :attr:`probe_path`; None without a probe path."""
        path = self.probe_path
        if path is None:
            return None
        return replace(self.engine.health if self.engine is not None else LIVENESS, path=path)

    @property
    def scrape_path(self) -> str | None:
        """Prometheus engine metrics path (the demo engine serves one too)."""
        if self.metrics_path is not None:
            return self.metrics_path or None
        if self.engine is not None:
            return self.engine.metrics_path
        return "/metrics" if self.is_demo else None

    @property
    def is_demo(self) -> bool:
        return self.url == "demo://"

    @property
    def family(self) -> str:
        return "anthropic" if self.type == "anthropic" else "openai"




class ApiKey(_Model):
    key: str
    # Safe to log and to publish in metadata and usage records; the key never is.
    id: Name
    allowed_models: list[ModelName] | None = None
    allowed_backends: list[Name] | None = None

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be blank")
        if v != v.strip() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in v):
            raise ValueError("must not contain spaces or control characters (a client cannot send them in a header)")
        return v


class Variant(_Model):
    id: Name
    model: ModelName
    weight: Annotated[int, Field(ge=0, le=MAX_WEIGHT)]
    backends: list[Name] | None = None
    # Paused: out of the race (as weight 0) while ``weight`` keeps the share it resumes with.
    paused: bool = False

    @property
    def race_weight(self) -> int:
        """The weight assignment uses: 0 while paused."""
        return 0 if self.paused else self.weight


class Shadow(_Model):
    """How much of the experiment's traffic a shadow arm sees, and how much of
    it may be in flight at once (past it, Envoy drops the copy)."""

    share: Annotated[float, Field(gt=0, le=1)]
    max_in_flight: Annotated[int, Field(ge=1, le=100_000)] = 16


class ShadowArm(_Model):
    """A variant written with ``shadow:``: no weight, never serves a caller;
    a copy of a share of the experiment's requests goes to its model."""

    id: Name
    model: ModelName
    backends: list[Name] | None = None
    shadow: Shadow


def _split_shadows(data: Any) -> Any:
    """The variants written with ``shadow:`` become the experiment's shadow
    arms; the live arms stay in ``variants`` (what assignment races)."""
    if not isinstance(data, dict):
        return data
    if "shadows" in data:
        raise ValueError("unknown field 'shadows': a shadow arm is a variant with 'shadow: {share: ...}'")
    variants = data.get("variants")
    if not isinstance(variants, list):
        return data
    shadows = [v for v in variants if isinstance(v, dict) and "shadow" in v]
    if not shadows:
        return data
    for v in shadows:
        if "weight" in v:
            raise ValueError(f"variant '{v.get('id')}': a shadow arm has no weight (it never serves a caller)")
    live = [v for v in variants if not (isinstance(v, dict) and "shadow" in v)]
    return {**data, "variants": live, "shadows": shadows}


class Experiment(_Model):
    name: Name
    model: ModelName
    sticky_key: str = "api_key"
    sticky_ttl: int | None = None
    fallback: Literal["within_variant", "cross_variant"] = "within_variant"
    response_model: Literal["upstream", "client"] = "upstream"
    response_headers: bool = False
    hide_variant_models: bool = False
    variants: Annotated[list[Variant], Field(max_length=MAX_VARIANTS)]
    # Filled from the variants written with ``shadow:`` (never a key of its own).
    shadows: list[ShadowArm] = []

    @model_validator(mode="before")
    @classmethod
    def _shadow_arms(cls, data: Any) -> Any:
        return _split_shadows(data)

    def arms(self) -> list[Variant | ShadowArm]:
        """Every arm with a model: the live ones, then the shadows."""
        return [*self.variants, *self.shadows]

    @field_validator("sticky_key")
    @classmethod
    def _sticky_key(cls, v: str) -> str:
        if v in ("api_key", "user", "none"):
            return v
        if v.startswith("header:"):
            name = v[len("header:"):]
            if re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", name):
                if name.lower().startswith(("x-model-router-", "x-continuum-")):
                    raise ValueError(f"'{name}' is in the router's own header namespace, which clients cannot send")
                return "header:" + name.lower()
        raise ValueError("must be api_key, user, none or header:<name>")

    @field_validator("sticky_ttl", mode="before")
    @classmethod
    def _ttl(cls, v: Any) -> int | None:
        if v is None:
            return None
        seconds = parse_duration(v)
        if not TTL_MIN <= seconds <= TTL_MAX:
            raise ValueError("must be between 60s and 365d")
        return seconds

    @property
    def race(self) -> tuple[tuple[str, int], ...]:
        """The race assignment runs: each arm's id and weight, in order (a paused arm weighs 0)."""
        return tuple((v.id, v.race_weight) for v in self.variants)

    @property
    def sticky_header(self) -> str | None:
        return self.sticky_key[len("header:"):] if self.sticky_key.startswith("header:") else None


class Price(_Model):
    """USD per million tokens."""

    input: Annotated[float, Field(ge=0)]
    output: Annotated[float, Field(ge=0)]


class ModelMetadata(_Model):
    id: ModelName
    aliases: list[ModelName] = []
    pricing: Price | None = None
    backend_pricing: dict[str, Price] = {}
    reasoning_efforts: list[str] = []
    thinking_pattern: str | None = None

    @property
    def supports_thinking(self) -> bool:
        return bool(self.thinking_pattern) or bool(self.reasoning_efforts)

    def price_on(self, backend: str) -> Price | None:
        return self.backend_pricing.get(backend, self.pricing)


class Monitor(_Model):
    enabled: bool = True
    probe_interval_s: Annotated[float, Field(ge=0.1, le=3600)] = 5.0
    scrape_interval_s: Annotated[float, Field(ge=0.1, le=3600)] = 2.0
    models_interval_s: Annotated[float, Field(ge=0.1, le=86400)] = 30.0
    # A metrics snapshot older than this makes no statement (no :nitro ranking).
    freshness_s: Annotated[float, Field(ge=0.1, le=3600)] = 10.0
    timeout_s: Annotated[float, Field(ge=0.05, le=60)] = 2.0
    # A health check that generates a token (SGLang's /health) answers in a
    # second when idle and up to the engine's own limit (20 s) under load.
    generation_check_timeout_s: Annotated[float, Field(ge=0.05, le=600)] = 25.0
    # A backend that answered 5xx or reset is held out this long (0: never).
    # Read from Envoy's access log, so it costs the request path nothing.
    passive_holdout_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    # Engine-saturation gate: a backend with more waiting requests is not admitted.
    max_waiting: Annotated[int, Field(ge=0)] | None = None


class WebSearch(_Model):
    """The search provider behind the :online variant's tool loop."""

    enabled: bool = False
    # searxng: GET <url>?q=<query>&format=json -> {"results": [{url, title, content}]}.
    # http_json: a generic JSON API described by the fields below.
    provider: Literal["searxng", "http_json"] = "searxng"
    url: str
    api_key: str | None = None
    api_key_header: str = "authorization"  # sent as "Bearer <key>" when it is authorization
    method: Literal["GET", "POST"] = "GET"
    query_field: str = "q"  # query parameter (GET) or JSON field (POST)
    count_field: str | None = None  # where the wanted number of results goes, if the API takes one
    results_path: str = "results"  # dotted path to the result list in the response
    title_field: str = "title"
    url_field: str = "url"
    snippet_field: str = "content"
    results: Annotated[int, Field(ge=1, le=20)] = 5
    max_iterations: Annotated[int, Field(ge=1, le=10)] = 3
    timeout_s: Annotated[float, Field(gt=0, le=120)] = 10.0  # each provider or model call
    deadline_s: Annotated[float, Field(gt=0, le=600)] = 60.0  # the whole loop

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL")
        return v


class VariantSuffixes(_Model):
    enabled: bool = False
    # :floor prices a request without max_tokens as if it asked for this many.
    default_output_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 512


class Proxy(_Model):
    variant_suffixes: VariantSuffixes = VariantSuffixes()
    selection: Literal["round_robin", "weighted", "random"] = "round_robin"
    # Paths outside the ingress table and the listings go to this backend
    # untouched; unset, they are refused with 404 unknown_endpoint. A model
    # named in their body or query still meets the reservation rule.
    passthrough_backend: Name | None = None


class Metering(_Model):
    # Envoy batches access-log entries: each reaches the sidecar at most this
    # long after its request ended (sooner when 16 KiB of them are waiting).
    flush_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 1000
    # One JSON line per resolved request: a file path, or "-" for standard output.
    usage_records: str | None = None


class RedisSettings(_Model):
    """One Redis shared by the replicas' cache, limits and response affinity."""

    url: str  # redis://[:password@]host:port/db, rediss:// for TLS
    timeout_ms: Annotated[int, Field(ge=1, le=10_000)] = 50  # each call; past it the feature acts without Redis
    max_connections: Annotated[int, Field(ge=1, le=10_000)] = 64
    key_prefix: str = "model-router:"

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path):
            raise ValueError("must be redis://host:port[/db], rediss://... or unix:///path")
        return v


SamplerName = Literal["always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
                      "parentbased_traceidratio"]


class Tracing(_Model):
    """OTLP trace export, one ``router.request`` span per request, built from the
    access log (docs/observability.md). A field left out takes its ``OTEL_*``
    environment variable, then the default; ``OTEL_SDK_DISABLED=true`` wins over all."""

    enabled: bool | None = None  # default: on when an endpoint is known (here or OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)
    endpoint: str | None = None  # http(s)://host:port[/path]; http/protobuf adds /v1/traces to a bare host:port
    protocol: Literal["grpc", "http/protobuf"] | None = None  # default grpc
    headers: dict[str, str] | None = None  # sent with each export (a collector's credentials)
    timeout_ms: Annotated[int, Field(ge=1, le=60_000)] | None = None  # each export; default 10000
    service_name: str | None = None  # resource service.name; default model-router
    resource_attributes: dict[str, str] | None = None
    sampler: SamplerName | None = None  # default parentbased_always_on
    sampler_arg: Annotated[float, Field(ge=0, le=1)] | None = None  # the ratio of the *traceidratio samplers; default 1
    max_queue_size: Annotated[int, Field(ge=1, le=1_000_000)] | None = None  # spans waiting; past it dropped; 2048
    max_export_batch_size: Annotated[int, Field(ge=1, le=100_000)] | None = None  # spans per export; default 512
    schedule_delay_ms: Annotated[int, Field(ge=10, le=600_000)] | None = None  # between exports; default 5000

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be http://host:port or https://host:port")
        return v


class Cache(_Model):
    """The exact-match response cache (docs/cache.md); absent: nothing is cached."""

    enabled: bool = True
    store: Literal["memory", "redis"] = "memory"  # redis: the top-level redis section, shared by replicas
    scope: Literal["key", "shared"] = "key"  # key: one tenant never reads another's answers
    ttl_s: Annotated[int, Field(ge=1, le=30 * 86_400)] = 300
    max_bytes: Annotated[int, Field(ge=1024, le=1 << 40)] = 64 * 1024 * 1024  # the memory store's budget
    max_entry_bytes: Annotated[int, Field(ge=1, le=32 * 1024 * 1024)] = 1024 * 1024  # larger answers are not stored
    # Opt in by client model (after aliases, without a suffix) or by experiment
    # name; both unset: every cacheable request.
    models: list[ModelName] | None = None
    experiments: list[Name] | None = None


class Limit(_Model):
    """A request rate and/or a token budget for one client-facing model (the
    base id after a variant suffix), for every caller or for one key id."""

    model: ModelName
    key_id: Name | None = None  # None: every caller of the model together
    requests_per_second: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    requests_per_minute: Annotated[int, Field(ge=1, le=60_000_000)] | None = None
    burst: Annotated[int, Field(ge=1, le=60_000_000)] | None = None  # bucket size; default: the rate
    tokens: Annotated[int, Field(ge=1)] | None = None  # prompt + completion tokens per window
    token_window: Annotated[int, Field(ge=1, le=366 * 86400)] = 86400  # seconds; day: UTC midnight to midnight
    # Count the request rate in Redis through the sidecar's rate-limit service,
    # so every Envoy and replica shares it (fixed windows; needs redis:).
    shared: bool = False

    @field_validator("token_window", mode="before")
    @classmethod
    def _window(cls, v: Any) -> int:
        return 86400 if v == "day" else parse_duration(v)

    @model_validator(mode="after")
    def _complete(self) -> Limit:
        if self.requests_per_second is not None and self.requests_per_minute is not None:
            raise ValueError("give requests_per_second or requests_per_minute, not both")
        rate = self.requests_per_second or self.requests_per_minute
        if rate is None and self.burst is not None:
            raise ValueError("burst needs requests_per_second or requests_per_minute")
        if rate is None and self.tokens is None:
            raise ValueError("a limit needs a request rate, a token budget (tokens), or both")
        if self.shared and (rate is None or self.burst is not None):
            raise ValueError("shared counts a request rate in fixed windows: it needs a rate and takes no burst")
        return self

    @property
    def rate(self) -> tuple[int, int] | None:
        """(requests, per seconds), or None without a request rate."""
        if self.requests_per_second is not None:
            return self.requests_per_second, 1
        if self.requests_per_minute is not None:
            return self.requests_per_minute, 60
        return None


class FeedbackMetric(_Model):
    """An outcome callers report on a request (``POST /v1/feedback``), judged per arm by the readout."""

    name: Name
    type: Literal["boolean", "float"]
    optimize: Literal["max", "min"] = "max"


class FeedbackJoin(_Model):
    """How long, and for how many requests, feedback can still find the arm that served a request.
    Kept in memory per process, or in Redis (shared by replicas) when the ``redis`` section is set."""

    ttl_s: Annotated[int, Field(ge=60, le=30 * 86_400)] = 86_400
    max_requests: Annotated[int, Field(ge=1, le=10_000_000)] = 100_000  # the memory store's bound


def _unique_feedback(metrics: list[FeedbackMetric]) -> list[FeedbackMetric]:
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        raise ValueError("feedback metric names must be unique")
    return metrics


class Config(_Model):
    server: Server = Server()
    envoy: Envoy = Envoy()
    proxy: Proxy = Proxy()
    backends: Annotated[list[Backend], Field(min_length=1)]
    api_keys: list[ApiKey] | None = None
    model_aliases: dict[ModelName, ModelName] = {}
    model_metadata: list[ModelMetadata] = []
    monitor: Monitor = Monitor()
    web_search: WebSearch | None = None
    model_experiments: Annotated[list[Experiment], Field(max_length=MAX_EXPERIMENTS)] = []
    # A model's ordered fallback models, tried when it has no admissible backend.
    fallback_chains: dict[ModelName, list[ModelName]] = {}
    metering: Metering = Metering()
    redis: RedisSettings | None = None
    # Further hops of the chain a request may move to, in the same client
    # request, when its first attempt fails upstream (0: none).
    fallback_attempts: Annotated[int, Field(ge=0, le=3)] = 1
    tracing: Tracing = Tracing()
    cache: Cache | None = None
    limits: list[Limit] = []
    feedback_metrics: Annotated[list[FeedbackMetric], AfterValidator(_unique_feedback), Field(max_length=32)] = []
    feedback: FeedbackJoin = FeedbackJoin()


@dataclass
class Loaded:
    config: Config
    warnings: list[str] = field(default_factory=list)
    # (value, ${ENV} reference) of every expansion: answers show the reference.
    substituted: list[tuple[str, str]] = field(default_factory=list)


# --------------------------------------------------------------------------- loading


def _path(loc: tuple[int | str, ...], key_error: bool = False) -> str:
    """A pydantic location as the operator wrote it: ``backends[0].url``.

    Pydantic marks an error in a mapping's key by appending ``"[key]"``; a
    config key that is itself spelled ``[key]`` is a field name like any other.
    """
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif key_error and i == len(loc) - 1 and part == "[key]":
            out += " (the key)"
        elif part == "" or not NAME_RE.fullmatch(str(part)):
            out += f"[{str(part)!r}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _as_written(raw: Any, loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A location inside an experiment's shadow arms, as the variant the
    operator wrote (``variants[j]``, not ``shadows[k]``)."""
    if len(loc) < 4 or loc[0] != "model_experiments" or loc[2] != "shadows" or not isinstance(loc[3], int):
        return loc
    try:
        variants = raw["model_experiments"][loc[1]]["variants"]
        j = [i for i, v in enumerate(variants) if isinstance(v, dict) and "shadow" in v][loc[3]]
    except (KeyError, IndexError, TypeError):
        return loc
    return (*loc[:2], "variants", j, *loc[4:])


def _is_key_error(err: Mapping[str, Any]) -> bool:
    # A key error's input is the key itself, which stands just before the marker.
    loc = err["loc"]
    return len(loc) >= 2 and loc[-1] == "[key]" and err.get("input") == loc[-2]


def _message(err: Mapping[str, Any]) -> str:
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "less_than_equal":
        return f"must be <= {ctx.get('le')}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx.get('ge')}"
    if kind == "greater_than":
        return f"must be > {ctx.get('gt')}"
    if kind == "too_long":
        return f"at most {ctx.get('max_length')} entries"
    if kind == "too_short":
        return f"at least {ctx.get('min_length')} entries"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    simple = {
        "bool_parsing": "must be true or false", "bool_type": "must be true or false",
        "int_parsing": "must be a whole number", "int_type": "must be a whole number",
        "int_from_float": "must be a whole number", "string_type": "must be a string",
        "list_type": "must be a list", "dict_type": "must be a mapping", "model_type": "must be a mapping",
        "model_attributes_type": "must be a mapping",
    }
    if kind in simple:
        return simple[kind]
    if kind == "value_error":
        return str(ctx.get("error", err.get("msg")))
    return str(err.get("msg", "invalid value"))


def _substitute(node: Any, path: tuple[int | str, ...], errors: list[str], env: dict[str, str], seen: list[tuple[str, str]]) -> Any:
    """``${ENV}`` references expanded; ``seen`` collects (value, reference) so no
    error or answer shows the value."""
    if isinstance(node, dict):
        return {k: _substitute(v, path + (k,), errors, env, seen) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, path + (i,), errors, env, seen) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:

        def repl(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                seen.append((env[name], m.group(0)))
                return env[name]
            if default is not None:
                return default
            errors.append(f"{_path(path)}: environment variable {name} is not set")
            return ""

        return _ENV_RE.sub(repl, node)
    return node


def parse(text: str, env: dict[str, str] | None = None) -> Loaded:
    """Parse and validate config text; raise :class:`ConfigError` listing every
    problem (never an ``${ENV}`` value: :mod:`sidecar.config.guard`)."""
    from .guard import expansion_error, redact_error, too_large

    env = dict(os.environ) if env is None else env
    big = too_large(text)
    if big:
        raise ConfigError([big])
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # Only the position and the problem: the offending line may hold a secret.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError([f"(root): not valid YAML{where}: {problem}"]) from None
    except RecursionError:
        raise ConfigError(["(root): nested too deeply"]) from None
    if not isinstance(raw, dict):
        raise ConfigError(["(root): must be a mapping of sections"])
    expanded = expansion_error(raw)
    if expanded:
        raise ConfigError([expanded])
    errors: list[str] = []
    seen: list[tuple[str, str]] = []
    try:
        raw = _substitute(raw, (), errors, env, seen)
        if errors:
            raise ConfigError(errors)
        config = Config.model_validate(raw)
    except ValidationError as exc:
        errors = [f"{_path(_as_written(raw, e['loc']), _is_key_error(e))}: {_message(e)}" for e in exc.errors()]
        raise ConfigError([redact_error(e, seen) for e in errors]) from None
    except RecursionError:
        raise ConfigError(["(root): nested too deeply"]) from None
    from .rules import check

    errors, warnings = check(config)
    warnings = [redact_error(w, seen) for w in warnings]
    if errors:
        raise ConfigError([redact_error(e, seen) for e in errors], warnings)
    return Loaded(config, warnings, seen)


def load(path: str | Path, env: dict[str, str] | None = None) -> Loaded:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"(root): cannot read {path}: {exc}"]) from None
    return parse(text, env)

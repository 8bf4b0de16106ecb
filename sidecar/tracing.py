"""OTLP trace export: the ``tracing:`` section and ``OTEL_*`` variables, and
the exporter that sends ``router.request`` spans to a collector.

Spans come from access-log entries (:mod:`sidecar.spans`), so nothing here
runs on the request path. :class:`Tracer` is a metering observer: it queues
each entry's span (bounded; a full queue drops and counts) and one task on
the event loop exports them in batches, over gRPC
(``TraceService/Export``) or HTTP (``POST /v1/traces``, protobuf), each
export bounded by its timeout. A collector that is down or slow costs spans,
counted in ``model_router_trace_spans_dropped_total``, never a request.

Settings: a field of the config's ``tracing:`` section wins; a field left out
takes its ``OTEL_*`` variable; then the default. ``OTEL_SDK_DISABLED=true``
turns export off whatever the file says (docs/observability.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import get_args
from urllib.parse import unquote, urlsplit

import aiohttp
import grpc

from . import metrics
from ._proto import otlp_pb2 as otlp
from .config import Sampler as SamplerName
from .config import Tracing
from .metering import Entry
from .spans import Sampler, attributes, span_of

log = logging.getLogger("model_router.tracing")

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SCOPE = otlp.InstrumentationScope(name="model-router", version="0.1.0")
_SAMPLERS = get_args(SamplerName)


@dataclass(frozen=True)
class Settings:
    """Export settings after the config file and the environment are merged."""

    endpoint: str  # the full URL: host:port for gRPC, .../v1/traces for HTTP
    protocol: str  # grpc | http/protobuf
    headers: tuple[tuple[str, str], ...]
    timeout_s: float
    resource: tuple[tuple[str, str], ...]
    sampler: Sampler
    max_queue_size: int
    max_export_batch_size: int
    schedule_delay_s: float

    def __repr__(self) -> str:  # headers may carry a collector's credentials
        return f"Settings(endpoint={self.endpoint!r}, protocol={self.protocol!r}, sampler={self.sampler!r})"


def _pairs(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` (values percent-decoded), as OTEL_*_HEADERS and OTEL_RESOURCE_ATTRIBUTES spell them."""
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            out[k.strip()] = unquote(v.strip())
    return out


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        v = env.get(name, "").strip()
        if v:
            return v
    return None


def _number(env: Mapping[str, str], name: str, default: float, warnings: list[str], low: float = 0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1
    if not v >= low:
        warnings.append(f"{name}={raw!r} is not a number >= {low:g}; using {default:g}")
        return default
    return v


def resolve(cfg: Tracing, env: Mapping[str, str]) -> tuple[Settings | None, list[str]]:
    """The export settings (None: export is off) and warnings about ignored variables. Pure."""
    warnings: list[str] = []
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or cfg.enabled is False:
        return None, warnings
    exporter = (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower()
    if exporter not in ("otlp", "none"):
        warnings.append(f"OTEL_TRACES_EXPORTER={exporter!r} is not supported (only otlp); exporting OTLP")
    signal_endpoint = _env(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_endpoint = _env(env, "OTEL_EXPORTER_OTLP_ENDPOINT")
    if cfg.enabled is None and (exporter == "none" or not (cfg.endpoint or signal_endpoint or base_endpoint)):
        return None, warnings

    protocol = cfg.protocol or _env(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "http/json":
        warnings.append("OTLP http/json is not supported; exporting http/protobuf to the same endpoint")
        protocol = "http/protobuf"
    elif protocol not in ("grpc", "http/protobuf"):
        warnings.append(f"OTLP protocol {protocol!r} is not supported; exporting grpc")
        protocol = "grpc"
    http = protocol == "http/protobuf"

    if cfg.endpoint:
        endpoint = cfg.endpoint
        if http and urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    elif signal_endpoint:
        endpoint = signal_endpoint
    elif base_endpoint:
        endpoint = base_endpoint.rstrip("/") + "/v1/traces" if http else base_endpoint
    else:
        endpoint = "http://localhost:4318/v1/traces" if http else "http://localhost:4317"
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        warnings.append(f"OTLP endpoint {endpoint!r} is not http(s)://host:port; trace export is off")
        return None, warnings

    if cfg.headers is not None:
        headers = dict(cfg.headers)
    else:
        headers = _pairs(_env(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS") or "")
    if cfg.timeout_ms is not None:
        timeout_s = cfg.timeout_ms / 1000
    else:
        name = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT" if env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") else (
            "OTEL_EXPORTER_OTLP_TIMEOUT")
        timeout_s = _number(env, name, 10_000, warnings, low=1) / 1000

    resource = _pairs(env.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    resource.update(cfg.resource_attributes or {})
    resource["service.name"] = (cfg.service_name or _env(env, "OTEL_SERVICE_NAME")
                                or resource.get("service.name") or "model-router")

    sampler_name = cfg.sampler or (env.get("OTEL_TRACES_SAMPLER") or "").strip().lower() or "parentbased_always_on"
    if sampler_name not in _SAMPLERS:
        warnings.append(f"OTEL_TRACES_SAMPLER={sampler_name!r} is not a built-in sampler; using parentbased_always_on")
        sampler_name = "parentbased_always_on"
    ratio = cfg.sampler_arg
    if ratio is None:
        ratio = _number(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, warnings) if sampler_name.endswith("ratio") else 1.0
        if ratio > 1:
            warnings.append(f"OTEL_TRACES_SAMPLER_ARG={ratio:g} is above 1; using 1")
            ratio = 1.0

    def setting(value: int | None, name: str, default: int) -> int:
        return value if value is not None else int(_number(env, name, default, warnings, low=1))

    return Settings(
        endpoint=endpoint,
        protocol=protocol,
        headers=tuple((k.lower(), v) for k, v in headers.items()),
        timeout_s=timeout_s,
        resource=tuple(resource.items()),
        sampler=Sampler(sampler_name, ratio),
        max_queue_size=setting(cfg.max_queue_size, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        max_export_batch_size=setting(cfg.max_export_batch_size, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        schedule_delay_s=setting(cfg.schedule_delay_ms, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
    ), warnings


class ExportError(Exception):
    """The collector did not take a batch."""


class GrpcExporter:
    """``TraceService/Export`` over gRPC (TLS for ``https://``)."""

    def __init__(self, settings: Settings) -> None:
        parts = urlsplit(settings.endpoint)
        target = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 4317)}"
        if parts.scheme == "https":
            self._channel = grpc.aio.secure_channel(target, grpc.ssl_channel_credentials())
        else:
            self._channel = grpc.aio.insecure_channel(target)
        self._export = self._channel.unary_unary(
            EXPORT_METHOD,
            request_serializer=otlp.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=otlp.ExportTraceServiceResponse.FromString,
        )
        self._metadata = settings.headers
        self._timeout = settings.timeout_s

    async def export(self, request: otlp.ExportTraceServiceRequest) -> otlp.ExportTraceServiceResponse:
        try:
            return await self._export(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise ExportError(f"{exc.code().name}: {exc.details()}") from None

    async def close(self) -> None:
        await self._channel.close()


class HttpExporter:
    """``POST /v1/traces`` with a protobuf body."""

    def __init__(self, settings: Settings) -> None:
        self._url = settings.endpoint
        self._headers = {**dict(settings.headers), "content-type": "application/x-protobuf"}
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def export(self, request: otlp.ExportTraceServiceRequest) -> otlp.ExportTraceServiceResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(self._url, data=request.SerializeToString(), headers=self._headers) as r:
                body = await r.read()
                if r.status != 200:
                    raise ExportError(f"HTTP {r.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ExportError(f"{type(exc).__name__}: {exc}") from None
        try:
            return otlp.ExportTraceServiceResponse.FromString(body)
        except Exception:  # a 200 with an unreadable body still took the spans
            return otlp.ExportTraceServiceResponse()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


Exporter = GrpcExporter | HttpExporter


class Tracer:
    """A metering observer that exports each request's span (see the module docstring).

    ``config`` returns the current ``tracing:`` section; a reload that changes
    it takes effect at the next entry.
    """

    def __init__(self, config: Callable[[], Tracing], env: Mapping[str, str] | None = None,
                 new_id: Callable[[int], bytes] = os.urandom) -> None:
        self._config = config
        self._env = os.environ if env is None else env
        self._new_id = new_id
        self._cfg: Tracing | None = None
        self.settings: Settings | None = None
        self._exporter: Exporter | None = None
        self._retired: list[Exporter] = []
        self._queue: deque[otlp.Span] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failing = False

    def _current(self) -> Settings | None:
        cfg = self._config()
        if cfg is not self._cfg:
            if self._cfg is None or cfg != self._cfg:
                settings, warnings = resolve(cfg, self._env)
                for w in warnings:
                    log.warning("tracing: %s", w)
                if settings != self.settings:
                    if self._exporter is not None:
                        self._retired.append(self._exporter)
                        self._exporter = None
                    self.settings = settings
                    if settings is not None:
                        log.info("tracing: exporting router.request spans to %s (%s)",
                                 settings.endpoint, settings.protocol)
            self._cfg = cfg
        return self.settings

    def observe(self, entry: Entry) -> None:
        try:
            settings = self._current()
            if settings is None:
                return
            span = span_of(entry, settings.sampler, self._new_id)
        except Exception:  # a span is never worth the rest of the batch's accounting
            log.exception("tracing: no span for an access-log entry")
            return
        if span is None:
            return
        if len(self._queue) >= settings.max_queue_size:
            metrics.TRACE_SPANS_DROPPED.labels("queue_full").inc()
            return
        self._queue.append(span)
        if len(self._queue) >= settings.max_export_batch_size:
            self._wake.set()

    def start(self) -> None:
        self._current()
        self._task = asyncio.create_task(self._run())

    async def close(self, timeout: float = 5.0) -> None:
        """Export what is queued (within ``timeout``), then stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await asyncio.wait_for(self._flush(), timeout)
        except TimeoutError:
            pass
        for exporter in (*self._retired, *([self._exporter] if self._exporter else [])):
            await exporter.close()
        self._retired.clear()
        self._exporter = None

    async def _run(self) -> None:
        while True:
            settings = self._current()
            delay = settings.schedule_delay_s if settings is not None else 1.0
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._flush()
            except Exception:
                log.exception("tracing: export loop")

    async def _flush(self) -> None:
        while self._retired:
            await self._retired.pop().close()
        settings = self.settings
        if settings is None:
            self._queue.clear()
            return
        while self._queue:
            n = min(len(self._queue), settings.max_export_batch_size)
            await self._export(settings, [self._queue.popleft() for _ in range(n)])

    async def _export(self, settings: Settings, spans: list[otlp.Span]) -> None:
        if self._exporter is None:
            self._exporter = GrpcExporter(settings) if settings.protocol == "grpc" else HttpExporter(settings)
        request = otlp.ExportTraceServiceRequest(resource_spans=[otlp.ResourceSpans(
            resource=otlp.Resource(attributes=attributes(dict(settings.resource))),
            scope_spans=[otlp.ScopeSpans(scope=SCOPE, spans=spans)],
        )])
        started = time.monotonic()
        try:
            response = await asyncio.wait_for(self._exporter.export(request), settings.timeout_s + 1)
        except (ExportError, TimeoutError) as exc:
            metrics.TRACE_SPANS_DROPPED.labels("export_failed").inc(len(spans))
            if not self._failing:  # once per outage, not once per batch
                log.warning("tracing: export to %s failed (%s); dropping spans until it answers",
                            settings.endpoint, exc or f"no answer in {time.monotonic() - started:.1f}s")
            self._failing = True
            return
        if self._failing:
            log.info("tracing: export to %s works again", settings.endpoint)
            self._failing = False
        rejected = min(max(response.partial_success.rejected_spans, 0), len(spans))
        if rejected:
            metrics.TRACE_SPANS_DROPPED.labels("rejected").inc(rejected)
            log.warning("tracing: the collector rejected %d span(s): %s", rejected,
                        response.partial_success.error_message)
        metrics.TRACE_SPANS_EXPORTED.inc(len(spans) - rejected)

"""OTLP trace export: the ``tracing:`` section and ``OTEL_*`` variables, and
the exporter that sends ``router.request`` spans to a collector.

Spans come from access-log entries (:mod:`sidecar.accounting.spans`), so nothing here
runs on the request path. :class:`Tracer` is a metering observer: it queues
each entry's span (bounded; a full queue drops and counts) and one task on
the event loop exports them in batches, over gRPC
(``TraceService/Export``) or HTTP (``POST /v1/traces``, protobuf), each
export bounded by its timeout. A collector that is down or slow costs spans,
counted in ``model_router_trace_spans_dropped_total``, never a request.

Its settings come from :mod:`sidecar.accounting.trace_settings`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc

from .. import metrics
from .._proto import otlp_pb2 as otlp
from ..config.schema import Tracing
from .entries import EVERYTHING, NOTHING, Reads
from .metering import Entry
from .spans import SCHEMA_URL, add_attributes, build, sampled
from .trace_settings import Settings, resolve

log = logging.getLogger("model_router.tracing")

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
SCOPE = otlp.InstrumentationScope(name="model-router", version="0.1.0")


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
            response: otlp.ExportTraceServiceResponse = await self._export(
                request, timeout=self._timeout, metadata=self._metadata)
            return response
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
        response = otlp.ExportTraceServiceResponse()
        try:
            response.ParseFromString(body)
        except Exception:  # a 200 with an unreadable body still took the spans
            response.Clear()
        return response

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
                 new_id: Callable[[int], bytes] = os.urandom,
                 server_of: Callable[[str], tuple[str, int] | None] = lambda backend: None) -> None:
        self._config = config
        self._server_of = server_of
        self._env = os.environ if env is None else env
        self._new_id = new_id
        self._cfg: Tracing | None = None
        self.settings: Settings | None = None
        self._exporter: Exporter | None = None
        self._retired: list[Exporter] = []
        self._batches: deque[otlp.ExportTraceServiceRequest] = deque()  # spans are built in place here
        self._queued = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._closing = False

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

    def on(self) -> bool:
        """Whether spans are exported under the current config."""
        return self._current() is not None

    def reads(self) -> Reads:
        """Everything, the client's trace headers too, while tracing is on; else nothing."""
        return EVERYTHING if self.on() else NOTHING

    def observe(self, entry: Entry) -> None:
        try:
            settings = self._current()
            if settings is None:
                return
            ctx = sampled(entry, settings.sampler, self._new_id)
            if ctx is None:
                return
            if self._queued >= settings.max_queue_size:
                metrics.TRACE_SPANS_DROPPED.labels("queue_full").inc()
                return
            spans = self._filling(settings)
            build(entry, ctx, self._new_id, spans.add, self._server_of)
        except Exception:  # a span is never worth the rest of the batch's accounting
            log.exception("tracing: no span for an access-log entry")
            return
        self._queued += 1
        if len(spans) >= settings.max_export_batch_size:
            self._wake.set()

    def _filling(self, settings: Settings) -> Any:
        """The spans of the batch being filled (a new one when the last is full)."""
        if self._batches:
            spans = self._batches[-1].resource_spans[0].scope_spans[0].spans
            if len(spans) < settings.max_export_batch_size:
                return spans
        request = otlp.ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add()
        add_attributes(resource_spans.resource.attributes, dict(settings.resource))
        resource_spans.scope_spans.add(scope=SCOPE, schema_url=SCHEMA_URL)
        self._batches.append(request)
        return resource_spans.scope_spans[0].spans

    def start(self) -> None:
        self._current()
        self._task = asyncio.create_task(self._run())

    async def close(self, timeout: float = 5.0) -> None:
        """Export what is queued (within ``timeout``), then stop."""
        self._closing = True
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._flush())
        try:
            await asyncio.wait_for(self._task, timeout)
        except TimeoutError:
            metrics.TRACE_SPANS_DROPPED.labels("export_failed").inc(self._queued)
        except Exception:
            log.exception("tracing: the last export")
        self._task = None
        for exporter in (*self._retired, *([self._exporter] if self._exporter else [])):
            await exporter.close()
        self._retired.clear()
        self._exporter = None

    async def _run(self) -> None:
        while not self._closing:
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
        while self._batches and self.settings is not None:
            request = self._batches.popleft()
            n = len(request.resource_spans[0].scope_spans[0].spans)
            self._queued -= n
            if n:
                await self._export(self.settings, request, n)  # a reload between batches applies to the next
        if self.settings is None:
            self._batches.clear()  # export was turned off
            self._queued = 0

    async def _export(self, settings: Settings, request: otlp.ExportTraceServiceRequest, n: int) -> None:
        if self._exporter is None:
            self._exporter = GrpcExporter(settings) if settings.protocol == "grpc" else HttpExporter(settings)
        started = time.monotonic()
        try:
            response = await asyncio.wait_for(self._exporter.export(request), settings.timeout_s + 1)
        except (ExportError, TimeoutError) as exc:
            metrics.TRACE_SPANS_DROPPED.labels("export_failed").inc(n)
            if not self._failing:  # once per outage, not once per batch
                log.warning("tracing: export to %s failed (%s); dropping spans until it answers",
                            settings.endpoint, exc or f"no answer in {time.monotonic() - started:.1f}s")
            self._failing = True
            return
        if self._failing:
            log.info("tracing: export to %s works again", settings.endpoint)
            self._failing = False
        rejected = min(max(response.partial_success.rejected_spans, 0), n)
        if rejected:
            metrics.TRACE_SPANS_DROPPED.labels("rejected").inc(rejected)
            log.warning("tracing: the collector rejected %d span(s): %s", rejected,
                        response.partial_success.error_message)
        metrics.TRACE_SPANS_EXPORTED.inc(n - rejected)

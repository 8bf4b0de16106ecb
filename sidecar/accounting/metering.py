"""Accounting off the request path: one access-log entry per request.

Envoy sends every finished request to the sidecar's ``AccessLogService``
(the gRPC access logger, batched). An entry carries the decision the sidecar
published as dynamic metadata (``model_router``), the token usage Envoy's
``json_to_metadata`` / ``sse_to_metadata`` filters read from the response
(``model_router_usage``), the status and the timings. From it the sidecar
computes the per-arm metrics, passive backend health and usage records; the
request itself never waits for any of it.

Delivery is best effort: the entries of a flush that finds no sidecar
listening are lost (docs/metering.md says how to see the loss). Nothing here
can fail or slow a client request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import grpc
import orjson
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from .. import metrics
from ..contract import NAMESPACE as NAMESPACE
from ..contract import USAGE_NAMESPACE as USAGE_NAMESPACE
from ..decision import Decision
from .entries import COUNTED, EVERYTHING, NOTHING, RECORDED, Reads
from .entries import Entry as Entry
from .entries import entry_of as entry_of

log = logging.getLogger("model_router.metering")

# Kinds of decision that count as requests on an experiment arm (a cache hit
# too: the arm answered it, from its own entries).
_COUNTED_KINDS = ("routed", "refusal", "answered", "cache_hit")
# Kinds whose request the decision sent to a backend.
_SENT_KINDS = ("routed", "passthrough", "count_tokens", "follow_up")
# Kinds whose request was served under its decision's suffix and fallback.
_SERVED_KINDS = ("routed", "answered", "cache_hit")


@dataclass(frozen=True, slots=True)
class Billed:
    """The tokens a request is accounted with, in metrics, usage records and budgets."""

    prompt_tokens: int | None
    completion_tokens: int | None
    estimated: bool  # no usage arrived: the decision's estimate (routing.limits.estimate)

    @property
    def total(self) -> int:
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


_UNKNOWN = Billed(None, None, False)


def billed(entry: Entry) -> Billed:
    """The usage the response reported; or, for a request that ran but whose
    usage never arrived (a stream either side cut, a client that left before
    the end, a background create), the estimate its decision published (for
    the router's own cut, the events it streamed stand for the completion).
    Anything else without usage (an error, an engine that reports none) is
    unknown and charged nothing."""
    d = entry.decision
    kind = d.kind
    if kind == "follow_up":
        return _UNKNOWN  # a retrieved response repeats the usage of the create that was already counted
    if entry.prompt_tokens is not None or entry.completion_tokens is not None:
        return Billed(entry.prompt_tokens, entry.completion_tokens, False)
    if kind not in ("routed", "answered"):
        return _UNKNOWN  # no model ran, or it ran for a prompt's size only (count_tokens)
    served = entry.status == 0 or 200 <= entry.status < 300
    ran = entry.cut or (served and (entry.client_gone or d.background is True))
    estimate = d.estimate
    if not ran or estimate is None:
        return _UNKNOWN
    prompt, completion = estimate
    if entry.cut and entry.streamed is not None:
        # The router cut it and reset the engine: what it streamed, within the cap.
        return Billed(prompt, min(entry.streamed, completion), True)
    return Billed(prompt, completion, True)


def outcome(entry: Entry) -> int:
    """The status a request is recorded with: the router's cut of a stream is
    an upstream timeout, whatever status line the client got before it."""
    return 504 if entry.cut else entry.status


def status_class(entry: Entry) -> str:
    if entry.local_reply and entry.status >= 400 and entry.decision.kind in _SENT_KINDS:
        return "client_error"  # Envoy refused what the client sent, after the decision; no backend ran
    if entry.cut:
        return "server_error"
    # A response cut by its upstream (an engine crash mid-stream) went out as a 200 but failed.
    failed = entry.upstream_failed and not entry.client_gone
    if entry.status >= 500 or failed or (entry.status == 0 and not entry.client_gone):
        return "server_error"
    if entry.status >= 400 or entry.status == 0:
        return "client_error"  # a client that left is the client's outcome
    return "success"


def iso_time(t: float) -> str:
    """``datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")``,
    with the part up to the second made once per second (a batch's entries
    mostly share it): ``datetime`` costs about 2 µs a call."""
    second = int(t)
    us = round((t - second) * 1e6)  # as fromtimestamp rounds (half to even; ``t - second`` is exact)
    if t < 0 or us >= 1_000_000:
        return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
    global _last
    cached, prefix = _last  # (one tuple: a reader never pairs one second with another's text)
    if second != cached:
        prefix = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S.")
        _last = second, prefix
    return f"{prefix}{us // 1000:03d}+00:00"


_last = (-1, "")


def feedback_record(decision: Decision, start: float) -> dict[str, Any]:
    """The usage record of accepted feedback (docs/metering.md)."""
    return {
        "request_id": decision.feedback_for,
        "time": iso_time(start),
        "key_id": decision.key_id,
        "kind": "feedback",
        "experiment_id": decision.experiment,
        "experiment_variant_id": decision.variant,
        "name": decision.feedback_name,
        "value": decision.feedback_value,
        "replaces": bool(decision.feedback_replaces),
        "revision": int(decision.feedback_revision or 1),  # the latest revision is the one that counts
        "comment": decision.feedback_comment,
        "feedback_request_id": decision.request_id,
    }


def usage_record(entry: Entry, tokens: Billed | None = None) -> dict[str, Any] | None:
    """The usage record of a request the router resolved, or None. Never the key.
    ``tokens``: ``billed(entry)``, when the caller has it already."""
    d = entry.decision
    kind = d.kind
    if (kind is None and not d) or kind == "listing" or (
            kind == "refusal" and d.experiment is None and d.client_model is None):
        return None
    if kind == "feedback":
        return feedback_record(d, entry.start)
    if tokens is None:
        tokens = billed(entry)
    return {
        "request_id": d.request_id,
        "time": iso_time(entry.start),
        "key_id": d.key_id,
        "kind": kind,
        "client_model": d.client_model,
        "upstream_model": d.upstream_model,
        "backend": d.backend,
        "experiment_id": d.experiment,
        "experiment_variant_id": d.variant,
        "assignment": d.assignment,
        "caller": d.caller,  # the sticky caller's hash: distinct callers in the readout
        "suffix": d.suffix,
        "fallback_from": d.fallback_from,
        "status": outcome(entry),
        "duration_to_headers_ms": round(entry.headers_s * 1000, 3) if entry.headers_s is not None else None,
        "duration_ms": round(entry.total_s * 1000, 3) if entry.total_s is not None else None,
        "prompt_tokens": tokens.prompt_tokens,
        "completion_tokens": tokens.completion_tokens,
        "estimated": tokens.estimated,
    }


class Sink(Protocol):
    def write(self, records: list[dict[str, Any]]) -> None: ...


class JsonLinesSink:
    """Usage records as JSON lines appended to a file (``-``: standard output).

    Each batch is one ``write`` on an ``O_APPEND`` descriptor, so several
    sidecar processes can share the file without interleaving lines.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = sys.stdout.fileno() if path == "-" else os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def write(self, records: list[dict[str, Any]]) -> None:
        if records:
            os.write(self._fd, b"".join(orjson.dumps(r) + b"\n" for r in records))

    def close(self) -> None:
        if self.path != "-":
            os.close(self._fd)


class Observer(Protocol):
    """Something else made of each entry (a span, a log line); must not block.

    An observer may also have ``reads() -> Reads``: what of an entry it uses
    under the current configuration (called once per batch; return the same
    object while the configuration stands). One that reads ``NOTHING`` has
    nothing to do under it, and is not given the batch's entries. Without
    ``reads``, it is given everything."""

    def observe(self, entry: Entry) -> None: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """How one access-log message is accounted, settled when it arrives: what
    of each entry is read, where its usage records go, and who observes it."""

    reads: Reads
    sink: Sink | None
    observers: tuple[Observer, ...]


class Meter:
    """Turns entries into metrics, passive health reports and usage records,
    and hands each to the observers."""

    def __init__(self, report_failure: Callable[[str, int | None], None],
                 sink: Callable[[], Sink | None] = lambda: None, observers: Iterable[Observer] = ()) -> None:
        self.report_failure = report_failure
        self.sink = sink  # where a batch's usage records go, asked once per batch (None: no record is made)
        self.observers = tuple(observers)
        fixed = COUNTED
        self._declared: dict[int, Callable[[], Reads]] = {}  # an observer's place -> its reads
        for i, o in enumerate(self.observers):
            if (declared := getattr(o, "reads", None)) is not None:
                self._declared[i] = declared
            else:
                fixed |= EVERYTHING
        self._fixed: Reads = fixed
        self._seen: tuple[tuple[Reads, ...], Sink | None] | None = None
        self._batch = Batch(fixed, None, self.observers)
        self._arms: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def batch(self) -> Batch:
        """How the next batch is accounted (once per batch: the sink and each
        observer's part follow the configuration)."""
        sink = self.sink()
        parts = tuple(r() for r in self._declared.values())
        if (parts, sink) != self._seen:  # (the same objects while the configuration stands)
            reads = self._fixed | RECORDED if sink is not None else self._fixed
            for part in parts:
                reads |= part
            quiet = {i for i, part in zip(self._declared, parts) if part is NOTHING}
            observers = tuple(o for i, o in enumerate(self.observers) if i not in quiet)
            self._seen, self._batch = (parts, sink), Batch(reads, sink, observers)
        return self._batch

    def record(self, entries: Iterable[Entry], batch: Batch | None = None) -> None:
        """Account ``entries``, read as ``batch`` says (default: the next batch's)."""
        records = []
        if batch is None:
            batch = self.batch()
        sink, observers = batch.sink, batch.observers
        # A batch's counter increments, summed per child and added once at the
        # end (a batch is mostly one arm's requests; each ``inc`` takes a lock),
        # and its histogram observations, kept in order per child.
        tally: dict[Any, float] = {}
        observed: dict[Any, list[float]] = {}
        # The batch read first, then accounted: reading its entries one after
        # another, and accounting them one after another, is faster than
        # alternating (each step's code and data stay in the CPU's caches). An
        # entry that cannot be read ends the batch; those before it are accounted.
        read: list[Entry] = []
        unreadable: Exception | None = None
        try:
            read.extend(entries)
        except Exception as exc:
            unreadable = exc
        count = 0
        try:
            for e in read:
                count += 1
                # Each step on its own: one that fails loses neither this entry's
                # other accounts nor the rest of the batch.
                tokens = None
                try:
                    tokens = billed(e)  # (once: the metrics and the usage record both read it)
                    self._count(e, tally, observed, tokens)
                except Exception:
                    metrics.STREAM_ERRORS.inc()
                    log.exception("an access-log entry could not be accounted")
                for o in observers:
                    try:
                        o.observe(e)
                    except Exception:
                        metrics.STREAM_ERRORS.inc()
                        log.exception("an access-log entry could not be accounted")
                if sink is not None and (rec := usage_record(e, tokens)) is not None:
                    records.append(rec)
        finally:
            if count:
                metrics.ACCESS_LOG_ENTRIES.inc(count)
            for child, n in tally.items():
                child.inc(n)
            for child, values in observed.items():
                observe_all(child, values)
        if records and sink is not None:
            try:
                sink.write(records)
            except OSError as exc:
                metrics.USAGE_RECORDS_DROPPED.inc(len(records))
                log.error("usage records could not be written: %s", exc)
        if unreadable is not None:
            raise unreadable

    def _count(self, e: Entry, tally: dict[Any, float], observed: dict[Any, list[float]],
               tokens: Billed | None = None) -> None:
        d = e.decision
        kind = d.kind
        backend = d.backend
        # Passive health blames a backend for what it did: a failed exchange, or
        # a 5xx it sent. Envoy's own 5xx after the decision (a header it refused
        # to set, say) is not the backend's: a client could otherwise hold any
        # backend out at will.
        failed = e.upstream_failed or (e.status >= 500 and e.via_upstream)
        if kind in _SENT_KINDS and backend and not e.local_reply and failed:
            self.report_failure(backend, e.status or None)
        suffix = d.suffix
        if suffix and kind in _SERVED_KINDS:
            metrics.VARIANT_REQUESTS.labels(suffix, "false" if d.suffix_applied is False else "true").inc()
        experiment, variant = d.experiment, d.variant
        if kind in _SERVED_KINDS and d.fallback_to:
            metrics.FALLBACKS.labels(experiment or "", variant or "", d.fallback_from or "",
                                     d.fallback_to, d.fallback_reason or "").inc()
        if not experiment or not variant:
            return
        arm = self._arms.get((experiment, variant)) or self._arm(experiment, variant)
        if kind in _COUNTED_KINDS:
            child = metrics.EXPERIMENT_REQUESTS_OF(experiment, variant, status_class(e), d.assignment or "sticky")
            tally[child] = tally.get(child, 0) + 1
            duration = e.headers_s if e.headers_s is not None else e.total_s
            if duration is not None:
                child = arm[0] if arm is not None else metrics.EXPERIMENT_DURATION_OF(experiment, variant)
                if (values := observed.get(child)) is None:
                    observed[child] = [duration]
                else:
                    values.append(duration)
        if kind == "cache_hit":
            metrics.EXPERIMENT_CACHE_HITS.labels(experiment, variant).inc()
            return  # no model ran: no tokens
        if kind not in ("routed", "answered"):
            return  # count_tokens reports the size of a prompt nobody ran
        if tokens is None:
            tokens = billed(e)
        if n := tokens.prompt_tokens:
            child = arm[1] if arm is not None else metrics.EXPERIMENT_TOKENS_OF(experiment, variant, "prompt")
            tally[child] = tally.get(child, 0) + n
            if tokens.estimated:
                metrics.EXPERIMENT_ESTIMATED_TOKENS.labels(experiment, variant, "prompt").inc(n)
        if n := tokens.completion_tokens:
            child = arm[2] if arm is not None else metrics.EXPERIMENT_TOKENS_OF(experiment, variant, "completion")
            tally[child] = tally.get(child, 0) + n
            if tokens.estimated:
                metrics.EXPERIMENT_ESTIMATED_TOKENS.labels(experiment, variant, "completion").inc(n)

    def _arm(self, experiment: str, variant: str) -> tuple[Any, Any, Any] | None:
        """An arm's duration histogram and prompt and completion token counters,
        looked up together once all three exist (a configured arm's are made
        with its configuration); else None, and each is looked up when it
        moves, so that no series appears that never moved."""
        tokens = metrics.EXPERIMENT_TOKENS._metrics
        if ((experiment, variant) not in metrics.EXPERIMENT_DURATION._metrics
                or (experiment, variant, "prompt") not in tokens or (experiment, variant, "completion") not in tokens):
            return None
        if len(self._arms) >= metrics.Children.LIMIT:
            self._arms.clear()
        arm = self._arms[experiment, variant] = (
            metrics.EXPERIMENT_DURATION_OF(experiment, variant),
            metrics.EXPERIMENT_TOKENS_OF(experiment, variant, "prompt"),
            metrics.EXPERIMENT_TOKENS_OF(experiment, variant, "completion"),
        )
        return arm


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values`` in order (a labelled
    child of a ``prometheus_client`` Histogram), with one lock per bucket that
    moved instead of two per value. The sum adds the values one at a time from
    where it stood, as ``observe`` does, so it stays the same to the last bit
    (float addition is not associative). Nothing else observes these
    histograms between a batch's entries: the access log is their only writer,
    on the event loop's thread."""
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    total = histogram._sum.get()
    last = len(bounds)
    for v in values:
        total += v
        i = bisect_left(bounds, v)  # the first bound v is not above, as observe's scan finds it
        if i < last and v <= bounds[i]:  # (a NaN is in no bucket)
            counts[i] += 1
    histogram._sum.set(total)
    buckets = histogram._buckets
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)


# Entries accounted between two turns of the event loop. Envoy sends about 15
# per message; accounted at once they would hold the loop, and the ext_proc
# messages behind it, for about 0.4 ms in process and 1-1.5 ms live
# (docs/performance-passes.md, "What a request costs live").
STEP = 4


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Envoy's gRPC access-log stream, one per Envoy worker thread. A batch is
    accounted a few entries at a time, yielding the loop in between: the
    accounting can wait, a request's decision should not."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self._closing = asyncio.Event()
        self._linger = 0.0

    def close(self, linger: float) -> None:
        """End every stream right after its next batch, or once it has been
        quiet for ``linger`` seconds (Envoy then opens a new one, to another
        worker, for its next entries). Just after a batch is when Envoy is
        least likely to have another on the way; under steady load a stream
        is never quiet, and waiting for quiet alone would hold a drain for as
        long as the load lasts."""
        self._linger = linger
        self._closing.set()

    async def StreamAccessLogs(self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        while True:
            message = await self._next(context)
            if message is None:
                break
            entries = message.http_logs.log_entry
            batch = self.meter.batch()
            for start in range(0, len(entries), STEP):
                if start:
                    await asyncio.sleep(0)  # the request path's messages waiting on the loop go first
                try:
                    self.meter.record((entry_of(x, batch.reads) for x in entries[start:start + STEP]), batch)
                except Exception:  # accounting never takes the stream down
                    metrics.STREAM_ERRORS.inc()
                    log.exception("access-log batch could not be accounted")
            if self._closing.is_set():
                break
        return als_pb2.StreamAccessLogsResponse()

    async def _next(self, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """The next batch, or None at the end of the stream or once closing and quiet."""
        read = asyncio.ensure_future(context.read())
        if not self._closing.is_set():
            closing = asyncio.ensure_future(self._closing.wait())
            await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
            closing.cancel()
        if not read.done():
            # Closing: the read under way is kept, not cancelled and started
            # again (a batch arriving meanwhile would be lost).
            await asyncio.wait({read}, timeout=self._linger)
            if not read.done():
                read.cancel()
                return None
        message = read.result()
        return None if message is grpc.aio.EOF else message

"""An entry reads only the decision keys its readers declare: each declared
observer does with such an entry what it does with a whole one, over every
kind of entry of the golden batch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from envoy.service.accesslog.v3 import als_pb2

from sidecar.accounting import budgets, logs, tracing
from sidecar.accounting.entries import ACCOUNTING, COUNTED, EVERY_KEY, EVERYTHING, NOTHING, Reads, entry_of
from sidecar.accounting.metering import Meter
from sidecar.experiments import srm

from .test_access_log_golden import batch


def entries(reads: Reads) -> list[Any]:
    return [entry_of(x, reads) for x in als_pb2.StreamAccessLogsMessage.FromString(batch()).http_logs.log_entry]


def test_the_sample_ratio_check_sees_the_same_callers():
    def calls(reads: Reads) -> list[tuple[Any, ...]]:
        seen: list[tuple[Any, ...]] = []
        tracker = SimpleNamespace(add=lambda *a: seen.append(a))
        for e in entries(reads):
            srm.Tracker.observe(tracker, e)  # type: ignore[arg-type]
        return seen

    assert calls(srm.READS) == calls(EVERYTHING)
    assert calls(EVERYTHING)  # (the batch has some)


def test_budgets_charge_the_same():
    def calls(reads: Reads) -> list[tuple[Any, ...]]:
        seen: list[tuple[Any, ...]] = []
        fake = SimpleNamespace(
            charge=lambda *a: seen.append(("charge", *a)),
            _background=lambda *a: seen.append(("background", *a)),
            snapshot=lambda: SimpleNamespace(config=SimpleNamespace(redis=object())),
            _claimed=[],
        )
        fake._retrieved = lambda e: budgets.Budgets._retrieved(fake, e)  # type: ignore[arg-type]
        for e in entries(reads):
            budgets.Budgets.observe(fake, e)  # type: ignore[arg-type]
        return seen + [("claimed", *c) for c in fake._claimed]

    reads = budgets.Budgets.reads(None)  # type: ignore[arg-type]
    assert calls(reads) == calls(EVERYTHING)
    assert calls(EVERYTHING)


def test_the_decision_log_writes_the_same_lines():
    import logging

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: list[Any] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append((record.levelno, record.getMessage(), record.fields))  # type: ignore[attr-defined]

    def lines(reads: Reads) -> list[Any]:
        handler = Lines()
        logs.decisions.addHandler(handler)
        level = logs.decisions.level
        logs.decisions.setLevel(logging.DEBUG)
        try:
            for e in entries(reads):
                logs.DecisionLog().observe(e)
        finally:
            logs.decisions.removeHandler(handler)
            logs.decisions.setLevel(level)
        return handler.lines

    log = logs.DecisionLog()
    level = logs.decisions.level
    try:
        logs.decisions.setLevel(logging.INFO)
        reads = log.reads()
        assert reads.keys < EVERY_KEY.keys and not reads.trace_headers
        assert lines(reads) == lines(EVERYTHING)
        assert len(lines(EVERYTHING)) > 20
        logs.decisions.setLevel(logging.WARNING)
        assert log.reads() is NOTHING
    finally:
        logs.decisions.setLevel(level)


def test_spans_read_everything_while_on():
    tracer = tracing.Tracer(lambda: SimpleNamespace(enabled=False))  # type: ignore[arg-type,return-value]
    tracer._current = lambda: None  # type: ignore[method-assign]
    assert tracer.reads() is NOTHING
    tracer._current = lambda: object()  # type: ignore[assignment,method-assign,return-value]
    assert tracer.reads() is EVERYTHING


def test_a_meter_reads_the_union_and_keeps_it_while_the_parts_stand():
    class On:
        part = NOTHING

        def reads(self) -> Reads:
            return self.part

        def observe(self, entry: Any) -> None:
            pass

    class Caller:
        part = Reads(("caller",))

        def reads(self) -> Reads:
            return self.part

        def observe(self, entry: Any) -> None:
            pass

    on, caller = On(), Caller()
    meter = Meter(lambda b, s: None, observers=(on, caller))
    first = meter.batch()
    assert first.reads.keys == COUNTED.keys | {"caller"} and not first.reads.trace_headers
    assert first.observers == (caller,)  # one that reads nothing has nothing to do
    assert meter.batch() is first
    on.part = EVERYTHING
    assert meter.batch().reads.keys == EVERYTHING.keys and meter.batch().reads.trace_headers
    assert meter.batch().observers == (on, caller)
    assert Meter(lambda b, s: None).batch().reads is COUNTED
    assert Meter(lambda b, s: None, observers=(object(),)).batch().reads.keys == EVERYTHING.keys  # type: ignore[arg-type]


def test_a_usage_records_keys_are_read_while_records_are_written():
    sink: list[Any] = []
    writing: list[Any] = []
    meter = Meter(lambda b, s: None, lambda: writing[0] if writing else None)
    assert meter.batch().reads is COUNTED and "request_id" not in COUNTED.keys
    writing.append(sink)
    batch = meter.batch()
    assert batch.sink is sink and batch.reads.keys == ACCOUNTING.keys
    assert batch.reads.keys >= {"request_id", "key_id", "client_model", "upstream_model", "caller", "feedback_for"}


def test_a_batch_is_accounted_with_the_sink_it_was_read_for():
    """Records turned on between a message's read and its accounting: its
    entries were read without the records' keys, so none is written for them."""
    from envoy.data.accesslog.v3 import accesslog_pb2

    class Lines:
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []

        def write(self, records: list[dict[str, Any]]) -> None:
            self.records.extend(records)

    lines: Lines | None = None
    meter = Meter(lambda b, s: None, lambda: lines)
    x = accesslog_pb2.HTTPAccessLogEntry()
    x.common_properties.metadata.filter_metadata["model_router"].update({"kind": "routed", "request_id": "r-1"})
    batch = meter.batch()
    lines = Lines()
    meter.record([entry_of(x, batch.reads)], batch)
    assert lines.records == []
    meter.record([entry_of(x, meter.batch().reads)])
    assert [r["request_id"] for r in lines.records] == ["r-1"]


def test_an_entry_without_a_kind_is_read_whole():
    from envoy.data.accesslog.v3 import accesslog_pb2

    x = accesslog_pb2.HTTPAccessLogEntry()
    x.common_properties.metadata.filter_metadata["model_router"].update({"family": "openai"})
    assert entry_of(x).decision.family == "openai"
    x.common_properties.metadata.filter_metadata["model_router"].update({"kind": "routed"})
    assert entry_of(x).decision.family is None  # (not a key the accounting reads)


def test_an_entry_that_cannot_be_read_ends_the_batch_after_the_ones_before_it():
    written: list[Any] = []
    seen: list[Any] = []

    class Sink:
        def write(self, records: list[Any]) -> None:
            written.extend(records)

    class Seen:
        def observe(self, entry: Any) -> None:
            seen.append(entry)

    good = entries(EVERYTHING)[:2]

    def batch_with_a_bad_entry() -> Any:
        yield from good
        raise OverflowError("unreadable")

    sink = Sink()
    meter = Meter(lambda b, s: None, lambda: sink, observers=(Seen(),))
    try:
        meter.record(batch_with_a_bad_entry())
    except OverflowError:
        pass
    else:
        raise AssertionError("the failure reaches the stream, which counts it")
    assert seen == good
    assert [r["request_id"] for r in written] == [e.decision.request_id for e in good]


def _usage_as_before(usage: dict[str, Any]) -> tuple[Any, ...]:
    def tokens(*keys: str) -> int | None:
        for k in keys:
            v = usage.get(k)
            if isinstance(v, (int, float)) and v >= 0:
                return int(v)
        return None

    answer = {k: v for k in ("response_id", "response_model", "finish_reason")
              if isinstance(v := usage.get(k), str) and v}
    return (tokens("prompt_tokens", "input_tokens"), tokens("completion_tokens", "output_tokens"),
            usage.get("cut") is not None, v if isinstance(v := usage.get("engine_response_id"), str) else None,
            tokens("streamed"), answer)


def test_the_usage_counts_read_as_the_general_reading():
    from sidecar.accounting.entries import Entry, _read_usage

    values = [0.0, 1.0, 24.0, 5.5, -1.0, float("nan"), True, False, "7", None]
    for p in values:
        for c in values:
            for extra in ({}, {"input_tokens": 3.0}, {"cut": "idle"}):
                for usage in ({"prompt_tokens": p, "completion_tokens": c, **extra},
                              {"input_tokens": p, "output_tokens": c, **extra}):
                    e = Entry(EVERYTHING.decode(_struct({})), 200, 0.0, None, None, None, None, False, False)
                    _read_usage(e, usage)
                    assert (e.prompt_tokens, e.completion_tokens, e.cut, e.response_id, e.streamed,
                            e.answer) == _usage_as_before(usage), usage


def _struct(values: dict[str, Any]) -> Any:
    from google.protobuf import struct_pb2

    s = struct_pb2.Struct()
    s.update(values)
    return s


def test_the_usage_struct_reads_as_the_general_reading():
    from envoy.data.accesslog.v3 import accesslog_pb2

    values = [0.0, 1.0, 24.0, 5.5, 1e15, -1.0, float("nan"), True, False, "7", None]
    for p in values:
        for c in values:
            for extra in ({}, {"input_tokens": 3.0}, {"finish_reason": "stop"}):
                for usage in ({"prompt_tokens": p, "completion_tokens": c, **extra},
                              {"input_tokens": p, "output_tokens": c, **extra}):
                    x = accesslog_pb2.HTTPAccessLogEntry()
                    x.common_properties.metadata.filter_metadata["model_router_usage"].update(usage)
                    e = entry_of(x)
                    plain = {k: (None if v is None else float(v) if isinstance(v, float) else v)
                             for k, v in usage.items()}
                    assert (e.prompt_tokens, e.completion_tokens, e.cut, e.response_id, e.streamed,
                            e.answer) == _usage_as_before(plain), usage

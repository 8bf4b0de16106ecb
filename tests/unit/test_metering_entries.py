"""Reading access-log entries: who is charged for an answer Envoy gave itself."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import struct_pb2

from sidecar import metrics
from sidecar.accounting.metering import Meter, entry_of, status_class
from sidecar.handlers.response_stream import NAMESPACE

DECISION = {"kind": "routed", "backend": "pool-b", "experiment": "local-reply", "variant": "candidate",
            "assignment": "sticky"}


def log_entry(status: int, upstream: bool, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.response.response_code.value = status
    md = struct_pb2.Struct()
    md.update(DECISION)
    e.common_properties.metadata.filter_metadata[NAMESPACE].CopyFrom(md)
    if upstream:
        e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
        e.common_properties.upstream_remote_address.socket_address.port_value = 9000
        e.response.response_code_details = "via_upstream"  # what Envoy logs for the backend's own answer
    for name, value in flags.items():
        setattr(e.common_properties.response_flags, name, value)
    return e


def arm_count(status: str) -> float:
    return metrics.EXPERIMENT_REQUESTS.labels("local-reply", "candidate", status, "sticky")._value.get()


def charged(entry) -> tuple[list[str], str]:
    failures: list[str] = []
    before = {s: arm_count(s) for s in ("client_error", "server_error")}
    Meter(lambda backend, status: failures.append(backend)).record([entry])
    (moved,) = [s for s in before if arm_count(s) == before[s] + 1]
    return failures, moved


def test_envoys_own_reply_after_the_decision_charges_no_backend_and_no_arm_error():
    """A 503 Envoy answers itself after the decision (an invalid header
    mutation: no upstream address, no response flag) is the request's fault."""
    entry = entry_of(log_entry(503, upstream=False))
    assert entry.local_reply and status_class(entry) == "client_error"
    assert charged(entry) == ([], "client_error")


def test_a_backend_that_failed_is_still_charged():
    for entry in (entry_of(log_entry(503, upstream=True)),
                  entry_of(log_entry(503, upstream=False, upstream_connection_failure=True)),
                  entry_of(log_entry(503, upstream=False, no_healthy_upstream=True))):
        assert not entry.local_reply
        assert status_class(entry) == "server_error"
        assert charged(entry) == (["pool-b"], "server_error")


def test_no_usage_record_is_made_while_no_sink_takes_one(monkeypatch):
    """Usage records are off by default (no ``metering.usage_records``): the
    meter asks for its sink once per batch and, without one, makes no record;
    with one, each entry's record reaches it."""
    import sidecar.accounting.metering as metering

    made: list[object] = []
    real = metering.usage_record
    monkeypatch.setattr(metering, "usage_record", lambda *a: made.append(a) or real(*a))
    entries = [entry_of(log_entry(200, upstream=True)) for _ in range(3)]
    asked: list[object] = []
    sink: list[dict] = []

    class Sink:
        def write(self, records: list[dict]) -> None:
            sink.extend(records)

    def none():
        asked.append(None)
        return None

    Meter(lambda b, s: None, none).record(entries)
    assert (len(asked), made) == (1, [])
    taking = Sink()
    Meter(lambda b, s: None, lambda: taking).record(entries)
    assert len(made) == len(sink) == 3 and {r["experiment_id"] for r in sink} == {"local-reply"}

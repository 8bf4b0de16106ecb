"""Passive health blames a backend only for what the backend did."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2

from sidecar.accounting.metering import Meter, entry_of


def _log_entry(status: int, details: str, connect_failed: bool = False) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.response.response_code.value = status
    e.response.response_code_details = details
    e.common_properties.response_flags.upstream_connection_failure = connect_failed
    e.common_properties.metadata.filter_metadata["model_router"].update({"kind": "routed", "backend": "pool-b"})
    return e


def _blamed(log_entry) -> list[tuple[str, int | None]]:
    reports: list[tuple[str, int | None]] = []
    Meter(lambda backend, status: reports.append((backend, status)))._count(entry_of(log_entry), tally={}, observed={})
    return reports


def test_envoys_own_5xx_after_the_decision_is_not_the_backends():
    """A 503 Envoy makes itself (it refused a header the request carried)
    never holds the chosen backend out: a client could otherwise do that at will."""
    assert _blamed(_log_entry(503, "header_mutation_set_contains_invalid_character")) == []
    assert _blamed(_log_entry(500, "ext_proc_error_gRPC_error_13")) == []


def test_a_backends_5xx_and_a_failed_exchange_are():
    assert _blamed(_log_entry(503, "via_upstream")) == [("pool-b", 503)]
    assert _blamed(_log_entry(503, "upstream_reset_before_response_started{connection_failure}", True)) == [
        ("pool-b", 503)]
    assert _blamed(_log_entry(404, "via_upstream")) == []

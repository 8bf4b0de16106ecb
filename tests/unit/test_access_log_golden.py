"""One access-log batch of every kind of entry, through what the
AccessLogService runs, against recorded outputs: the usage-record bytes, the
metric samples that moved, the passive-health reports and every field an
observer receives.

``tests/unit/golden/access_log.json`` holds the outputs. A change meant to
alter them rewrites it with ``MODEL_ROUTER_GOLDEN=write`` (and the diff is
reviewed); otherwise the file is the contract.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2

from sidecar import metrics
from sidecar.accounting import metering
from sidecar.accounting.metering import Entry, Meter, billed, entry_of, outcome, status_class

GOLDEN = Path(__file__).parent / "golden" / "access_log.json"
EXPERIMENT = "golden-ab"  # label values no other unit test uses

# The metrics an entry can move (deltas are compared, so other tests' counts do not matter).
WATCHED = (
    metrics.EXPERIMENT_REQUESTS, metrics.EXPERIMENT_DURATION, metrics.EXPERIMENT_TOKENS,
    metrics.EXPERIMENT_ESTIMATED_TOKENS, metrics.EXPERIMENT_CACHE_HITS, metrics.VARIANT_REQUESTS,
    metrics.FALLBACKS, metrics.ACCESS_LOG_ENTRIES, metrics.STREAM_ERRORS, metrics.USAGE_RECORDS_DROPPED,
)
ENTRY_FIELDS = (
    "status", "start", "headers_s", "total_s", "prompt_tokens", "completion_tokens", "upstream_failed",
    "client_gone", "rate_limited", "cut", "response_id", "streamed", "local_reply", "traceparent",
    "tracestate", "answer", "via_upstream",
)
START = 1_796_284_800  # 2026-12-03T08:00:00Z

ARM = {"experiment": EXPERIMENT, "variant": "control", "assignment": "sticky", "x_experiment": EXPERIMENT,
       "x_experiment_variant": "control", "caller": "9f86d081884c7d65"}
ROUTED = {"kind": "routed", "key_id": "team-1", "client_model": "chat", "upstream_model": "llama-3.1-8b",
          "backend": "pool-a", "family": "openai", "ingress": "/v1/chat/completions", "span_id": "00f067aa0ba902b7",
          **ARM}

# (decision, usage, status, details, upstream address, response flags, timings in ns, start offset ns, headers)
CASES: list[dict[str, Any]] = [
    # routed, usage in the JSON answer, trace headers
    {"decision": {**ROUTED, "estimate": "24,64"}, "usage": {"prompt_tokens": 24, "completion_tokens": 5,
     "response_id": "chatcmpl-1", "response_model": "llama-3.1-8b", "finish_reason": "stop"},
     "status": 200, "headers": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                "tracestate": "vendor=1"}},
    # routed over the random assignment, ms rounding at the edge (999.9995 ms after the second)
    {"decision": {**ROUTED, "assignment": "random", "variant": "candidate", "x_experiment_variant": "candidate",
                  "upstream_model": "qwen3-8b", "backend": "pool-b"},
     "usage": {"prompt_tokens": 7, "completion_tokens": 0}, "status": 200, "offset": 999_999_500,
     "timings": {"time_to_first_downstream_tx_byte": 2_000_123_456, "time_to_last_downstream_tx_byte": 3_000_000_001}},
    # a refusal on the arm
    {"decision": {"kind": "refusal", "refusal": "model_not_allowed", "key_id": "team-2", "client_model": "chat",
                  "request_id": "r-refusal", **ARM},
     "status": 403, "details": "ext_proc_error_gRPC_error_0", "upstream": False},
    # a refusal before any model (no usage record)
    {"decision": {"kind": "refusal", "refusal": "invalid_api_key", "request_id": "r-bad-key"},
     "status": 401, "details": "ext_proc", "upstream": False},
    # a follow-up (usage never billed again)
    {"decision": {"kind": "follow_up", "key_id": "team-1", "backend": "pool-a", "response_id": "resp_1",
                  "request_id": "r-follow"},
     "usage": {"input_tokens": 30, "output_tokens": 12, "engine_response_id": "resp_1"}, "status": 200},
    # a fallback hop with a suffix, Anthropic usage names
    {"decision": {**ROUTED, "request_id": "r-fallback", "fallback_from": "llama-3.1-8b", "fallback_to": "qwen3-8b",
                  "fallback_reason": "unavailable", "x_fallback_model": "qwen3-8b", "suffix": "nitro",
                  "suffix_applied": True, "x_model_variant": "nitro", "x_model_variant_applied": "true"},
     "usage": {"input_tokens": 11, "output_tokens": 4}, "status": 200},
    # a suffix that did not apply, no experiment
    {"decision": {"kind": "routed", "request_id": "r-suffix", "key_id": "team-3", "client_model": "llama-3.1-8b:floor",
                  "upstream_model": "llama-3.1-8b", "backend": "pool-a", "suffix": "floor", "suffix_applied": False},
     "usage": {"prompt_tokens": 3, "completion_tokens": 2}, "status": 200},
    # a cache hit on the arm (Envoy answered from the sidecar's reply)
    {"decision": {**ROUTED, "kind": "cache_hit", "request_id": "r-hit", "x_cache": "hit", "reply": "sidecar"},
     "status": 200, "details": "ext_proc", "upstream": False},
    # a stream with usage in its last event, cut by the router after 17 events
    {"decision": {**ROUTED, "request_id": "r-cut", "estimate": "40,100"},
     "usage": {"cut": "idle", "streamed": 17}, "status": 200,
     "timings": {"time_to_first_downstream_tx_byte": 50_000_000, "time_to_last_downstream_tx_byte": 0,
                 "duration": 9_000_000_000}},
    # a stream that reported usage
    {"decision": {**ROUTED, "request_id": "r-stream"}, "usage": {"prompt_tokens": 50, "completion_tokens": 200},
     "status": 200, "timings": {"time_to_first_downstream_tx_byte": 120_000_000,
                                "time_to_last_downstream_tx_byte": 4_500_000_000}},
    # a client that went away: status 0, the estimate is billed
    {"decision": {**ROUTED, "request_id": "r-abort", "estimate": "20,64", "background": False},
     "status": 0, "details": "downstream_remote_disconnect", "flags": {"downstream_remote_reset": True},
     "timings": {"time_to_first_downstream_tx_byte": 0, "time_to_last_downstream_tx_byte": 0,
                 "duration": 700_000_000}},
    # a background create, estimate billed, engine id
    {"decision": {**ROUTED, "request_id": "r-bg", "estimate": "15,30", "background": True},
     "usage": {"engine_response_id": "resp_bg"}, "status": 200},
    # a backend that failed: passive health, server_error
    {"decision": {**ROUTED, "request_id": "r-503"}, "status": 503,
     "flags": {"upstream_connection_failure": True}, "details": "upstream_reset_before_response_started"},
    # the backend's own 5xx
    {"decision": {**ROUTED, "request_id": "r-500"}, "status": 500},
    # Envoy's own reply after the decision (no upstream, no flag)
    {"decision": {**ROUTED, "request_id": "r-local"}, "status": 503, "details": "ext_proc", "upstream": False},
    # Envoy's request-rate filter
    {"decision": {"kind": "routed", "request_id": "r-rl", "key_id": "team-4", "client_model": "chat",
                  "limit_model": "chat", "budgets": "rule-1\nrule-2", "reserved": "64@1796284800.5"},
     "status": 429, "flags": {"rate_limited": True}, "details": "request_rate_limited", "upstream": False},
    # passthrough and count_tokens
    {"decision": {"kind": "passthrough", "request_id": "r-pass", "backend": "pool-a", "key_id": "team-1"},
     "status": 200},
    {"decision": {"kind": "count_tokens", "request_id": "r-count", "backend": "pool-a", "key_id": "team-1",
                  "client_model": "chat", **ARM}, "usage": {"input_tokens": 9}, "status": 200},
    # an answered request (the sidecar's own answer on the arm)
    {"decision": {**ROUTED, "kind": "answered", "request_id": "r-answered", "reply": "sidecar",
                  "estimate": "5,6"}, "status": 200, "details": "ext_proc", "upstream": False},
    # a listing (no record)
    {"decision": {"kind": "listing", "request_id": "r-list", "key_id": "team-1"}, "status": 200,
     "details": "ext_proc", "upstream": False},
    # accepted feedback
    {"decision": {"kind": "feedback", "request_id": "r-fb", "key_id": "team-1", "experiment": EXPERIMENT,
                  "variant": "control", "feedback_for": "r-stream", "feedback_name": "thumbs",
                  "feedback_value": 1.0, "feedback_replaces": True, "feedback_revision": 2.0,
                  "feedback_comment": "good"}, "status": 204, "details": "ext_proc", "upstream": False},
    # no decision: Envoy answered without the sidecar
    {"status": 404, "details": "route_not_found", "upstream": False},
    # a decision value of another type (ignored), an unknown key
    {"decision": {**ROUTED, "request_id": "r-odd", "status_hint": "x", "background": "yes"},
     "usage": {"prompt_tokens": -1, "completion_tokens": 2.0}, "status": 200},
]
DEFAULT_TIMINGS = {"time_to_first_downstream_tx_byte": 1_300_000, "time_to_last_downstream_tx_byte": 1_310_000,
                   "duration": 1_310_000}


def batch() -> bytes:
    """A ``StreamAccessLogsMessage`` of every case, as Envoy sends it."""
    msg = als_pb2.StreamAccessLogsMessage()
    for i, case in enumerate(CASES):
        e = msg.http_logs.log_entry.add()
        c = e.common_properties
        c.downstream_remote_address.socket_address.address = "127.0.0.1"
        c.downstream_remote_address.socket_address.port_value = 40000 + i
        if case.get("upstream", True):
            c.upstream_remote_address.socket_address.address = "127.0.0.1"
            c.upstream_remote_address.socket_address.port_value = 8001
        offset = case.get("offset", i * 123_456_789)
        c.start_time.seconds, c.start_time.nanos = START + i + offset // 1_000_000_000, offset % 1_000_000_000
        for name, ns in case.get("timings", DEFAULT_TIMINGS).items():
            d = getattr(c, name)
            d.seconds, d.nanos = ns // 1_000_000_000, ns % 1_000_000_000
        for name, value in case.get("flags", {}).items():
            setattr(c.response_flags, name, value)
        decision = dict(case.get("decision", {}))
        if decision:
            decision.setdefault("request_id", f"r-{i}")
            c.metadata.filter_metadata[metering.NAMESPACE].update(decision)
        if "usage" in case:
            c.metadata.filter_metadata[metering.USAGE_NAMESPACE].update(case["usage"])
        r = e.request
        r.request_method = base_pb2.POST
        r.scheme, r.authority, r.path = "http", "127.0.0.1:10000", "/v1/chat/completions"
        for k, v in case.get("headers", {}).items():
            r.request_headers[k] = v
        if case["status"]:
            e.response.response_code.value = case["status"]
        e.response.response_code_details = case.get("details", "via_upstream")
    return msg.SerializeToString()


class Sink:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, records: list[dict[str, Any]]) -> None:
        self.lines.append(b"".join(metering.orjson.dumps(r) + b"\n" for r in records).decode())


class Seen:
    """An observer that writes down everything an entry says."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def observe(self, entry: Entry) -> None:
        fields = {name: getattr(entry, name) for name in ENTRY_FIELDS}
        fields["answer"] = dict(fields["answer"])
        fields["decision"] = {k: list(v) if isinstance(v, tuple) else v
                              for k, v in sorted(vars(entry.decision).items())}
        b = billed(entry)
        fields["billed"] = [b.prompt_tokens, b.completion_tokens, b.estimated]
        fields["status_class"], fields["outcome"] = status_class(entry), outcome(entry)
        self.entries.append(fields)


def samples() -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in WATCHED:
        for family in metric.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def run(observed: bool = True) -> dict[str, Any]:
    """``observed``: with an observer that reads everything (else only what the accounting reads)."""
    raw = batch()
    failures: list[list[Any]] = []
    sink, seen = Sink(), Seen()
    meter = Meter(lambda backend, status: failures.append([backend, status]), lambda: sink,
                  observers=(seen,) if observed else ())
    before = samples()
    # As the AccessLogService does: one generator of entries per message, twice (two batches).
    for _ in range(2):
        message = als_pb2.StreamAccessLogsMessage.FromString(raw)
        plan = meter.batch()
        meter.record((entry_of(x, plan.reads) for x in message.http_logs.log_entry), plan)
    after = samples()
    # (Rounded: a float sum's difference depends on what earlier tests added to it.)
    moved = {k: round(v - before.get(k, 0.0), 9) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}
    return {"usage_records": sink.lines, "metrics": moved, "failures": failures, "observed": seen.entries}


def test_an_access_log_batch_gives_the_recorded_outputs():
    got = json.loads(json.dumps(run()))  # (tuples as lists, as the file holds them)
    if os.environ.get("MODEL_ROUTER_GOLDEN") == "write":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert got["usage_records"] == want["usage_records"]
    assert got["metrics"] == want["metrics"]
    assert got["failures"] == want["failures"]
    assert len(got["observed"]) == len(want["observed"])
    for i, (g, w) in enumerate(zip(got["observed"], want["observed"], strict=True)):
        assert g == w, f"entry {i}"
    assert got == want


def test_the_accounting_alone_reads_what_its_outputs_need():
    """Without observers an entry reads only the decision's keys the accounting
    uses, and no trace headers: the outputs stay the recorded ones."""
    got = json.loads(json.dumps(run(observed=False)))
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert got["usage_records"] == want["usage_records"]
    # A histogram's sum moves by a float difference, which depends on where the
    # sum stood (another run may have added to it first): the last bits are
    # the other test's to pin.
    sums = {k for k in want["metrics"] if "_sum{" in k}
    assert {k: v for k, v in got["metrics"].items() if k not in sums} == {
        k: v for k, v in want["metrics"].items() if k not in sums}
    assert {k: got["metrics"].get(k) for k in sums} == pytest.approx({k: want["metrics"][k] for k in sums})
    assert got["failures"] == want["failures"]


def test_iso_time_is_datetimes_reading():
    from datetime import UTC, datetime

    from sidecar.accounting.metering import iso_time

    rng = __import__("random").Random(7)
    times = [0.0, 0.0005, 0.9995, 0.9999995, 0.99999949, 1.5, float(START), START + 0.0015, START + 59.9999996,
             START + 86_399.9999999, 1e9 + 0.123456789, -1.25, -0.0000004]
    times += [START + rng.random() * 1e6 for _ in range(20_000)]
    times += [START + rng.randrange(10**6) + rng.randrange(10**6) / 1e6 + d for d in (-5e-7, 5e-7, 0) for _ in range(3_000)]
    for t in times:
        assert iso_time(t) == datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds"), t

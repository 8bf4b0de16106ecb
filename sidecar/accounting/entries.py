"""One access-log entry read into an :class:`Entry`: what the accounting and
its observers know of one request.

Each attribute read of a protobuf message builds a wrapper object, so an
entry reads only what is used: the decision's keys that a :class:`Reads`
names (the accounting's own, plus those of the observers that are on) and
the client's trace headers only when something asks for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..contract import NAMESPACE, USAGE_NAMESPACE
from ..decision import EMPTY, KEYS, Decision, Reader


class Reads:
    """What of an access-log entry its readers use: the decision's ``keys``
    (the others read as unset) and whether the client's ``trace_headers``.
    Built once per set of readers (a configuration), never per entry."""

    __slots__ = ("decode", "keys", "trace_headers")

    def __init__(self, keys: Iterable[str], trace_headers: bool = False) -> None:
        self.keys = frozenset(keys)
        self.trace_headers = trace_headers
        self.decode = Reader(self.keys)

    def __or__(self, other: Reads) -> Reads:
        if other.keys <= self.keys and other.trace_headers <= self.trace_headers:
            return self
        return Reads(self.keys | other.keys, self.trace_headers or other.trace_headers)


EVERYTHING = Reads(KEYS, trace_headers=True)
EVERY_KEY = Reads(KEYS)  # the whole decision, without the trace headers
NOTHING = Reads(())
# What the accounting itself reads for every entry (``billed``, ``status_class``,
# the metrics, passive health) ...
COUNTED = Reads((
    "kind", "backend", "experiment", "variant", "assignment", "suffix", "suffix_applied", "fallback_from",
    "fallback_to", "fallback_reason", "estimate", "background",
))
# ... and the rest of a usage record, read only while records are written
# (accepted feedback's record included).
RECORDED = Reads((
    "request_id", "key_id", "client_model", "upstream_model", "caller", "feedback_for", "feedback_name",
    "feedback_value", "feedback_replaces", "feedback_revision", "feedback_comment",
))
ACCOUNTING = COUNTED | RECORDED


@dataclass(slots=True)
class Entry:
    """What one access-log entry says about one request. Read-only by
    convention: every observer gets the same one. (Not a frozen dataclass:
    a frozen ``__init__`` sets each of the 18 fields through
    ``object.__setattr__``, about 2.5 µs per entry.)"""

    decision: Decision  # the sidecar's metadata (a mapping given is decoded); empty: the sidecar never decided
    status: int  # 0: no response was sent
    start: float  # unix time the request arrived
    headers_s: float | None  # to the first byte sent to the client (the response headers)
    total_s: float | None  # to the last byte sent to the client
    prompt_tokens: int | None  # None: the response reported no usage
    completion_tokens: int | None
    upstream_failed: bool  # Envoy could not get a complete answer from the backend
    client_gone: bool  # the client went away before the answer
    rate_limited: bool = False  # Envoy's request-rate filter refused it
    cut: bool = False  # the router ended the response itself (an event stream whose upstream fell silent)
    response_id: str | None = None  # a background create's engine id, as its answer gave it
    streamed: int | None = None  # a cut stream: the events it passed on before the cut
    # Envoy answered itself after the decision, before any upstream was tried
    # (an invalid header mutation): not the backend's failure nor the arm's.
    local_reply: bool = False
    traceparent: str | None = None  # the client's W3C trace context headers, as sent
    tracestate: str | None = None
    answer: Mapping[str, str] = field(default_factory=dict)  # response_id, response_model, finish_reason of a JSON answer
    via_upstream: bool = False  # the status came from the backend, not from Envoy itself

    def __post_init__(self) -> None:
        if not isinstance(self.decision, Decision):  # a plain mapping of wire values (a test's, a replay's)
            self.decision = Decision.decode(self.decision)


def _seconds(d: Any) -> float | None:  # a protobuf Duration; None when zero (unset)
    seconds, nanos = d.seconds, d.nanos  # (two reads cost less than ``ByteSize()``)
    return seconds + nanos / 1e9 if seconds or nanos else None


def _tokens(usage: Mapping[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = usage.get(k)
        if isinstance(v, (int, float)) and v >= 0:
            return int(v)
    return None


def entry_of(log_entry: Any, reads: Reads = ACCOUNTING) -> Entry:
    """Read an ``HTTPAccessLogEntry``, as much of it as ``reads`` says; pure.
    (Each attribute read of a protobuf message builds a new wrapper: each is
    read once.)"""
    common = log_entry.common_properties
    meta = common.metadata.filter_metadata
    if NAMESPACE in meta:
        struct = meta[NAMESPACE]
        decision = reads.decode(struct)
        if decision.kind is None and reads is not EVERYTHING:
            # Without a kind, whether any key is set decides what is made of it
            # (a usage record, a span): such a decision is read whole.
            decision = EVERYTHING.decode(struct)
    else:
        decision = EMPTY
    # Most entries carry no flag (Envoy sets the message only for a flag): one check instead of ten.
    upstream_failed = client_gone = rate_limited = flagged = False
    if common.HasField("response_flags"):
        flags = common.response_flags
        if flags.ByteSize() > 0:
            flagged = True
            upstream_failed = bool(
                flags.upstream_connection_failure or flags.upstream_remote_reset
                or flags.upstream_connection_termination or flags.upstream_request_timeout
                or flags.upstream_protocol_error or flags.no_healthy_upstream
            )
            client_gone = bool(flags.downstream_connection_termination or flags.downstream_remote_reset)
            rate_limited = flags.rate_limited
    response = log_entry.response
    via_upstream = response.response_code_details == "via_upstream"
    start = common.start_time
    e = Entry(
        decision,
        response.response_code.value,
        start.seconds + start.nanos / 1e9,
        _seconds(common.time_to_first_downstream_tx_byte),
        _seconds(common.time_to_last_downstream_tx_byte) or _seconds(common.duration),
        None,
        None,
        upstream_failed,
        client_gone,
        rate_limited,
        False,
        None,
        None,
        # local_reply: no upstream address and no response flag: Envoy answered itself for
        # a reason none of its flags name (the request, not a backend or Envoy's state).
        not flagged and not via_upstream and not common.HasField("upstream_remote_address"),
        None,
        None,
        {},
        via_upstream,
    )  # (every field positionally: keywords cost 0.3 µs)
    if USAGE_NAMESPACE in meta:
        _read_usage_struct(e, meta[USAGE_NAMESPACE])
    if reads.trace_headers and (headers := log_entry.request.request_headers):
        e.traceparent = headers.get("traceparent")
        e.tracestate = headers.get("tracestate")
    return e


def _read_usage_struct(e: Entry, usage: Any) -> None:  # the usage namespace's Struct
    fields_ = usage.fields
    # Mostly just the two counts, both positive: read straight from the
    # Struct (a value of another kind reads number_value as 0.0, and goes
    # the general way with zeros and anything else).
    if len(fields_) == 2 and "prompt_tokens" in fields_ and "completion_tokens" in fields_ and (
            (prompt := fields_["prompt_tokens"].number_value) > 0
            and (completion := fields_["completion_tokens"].number_value) > 0):
        e.prompt_tokens, e.completion_tokens = int(prompt), int(completion)
    else:
        _read_usage(e, _plain(usage))


def _read_usage(e: Entry, usage: dict[str, Any]) -> None:
    """The usage namespace's keys onto a new entry (left at their defaults without it)."""
    if len(usage) == 2:  # mostly just the two counts, as numbers (a Struct's are floats)
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if prompt.__class__ is float and completion.__class__ is float and prompt >= 0 and completion >= 0:
            e.prompt_tokens, e.completion_tokens = int(prompt), int(completion)
            return
    e.prompt_tokens = _tokens(usage, "prompt_tokens", "input_tokens")
    e.completion_tokens = _tokens(usage, "completion_tokens", "output_tokens")
    e.cut = usage.get("cut") is not None
    e.response_id = v if isinstance(v := usage.get("engine_response_id"), str) else None
    e.streamed = _tokens(usage, "streamed")
    e.answer = {k: v for k in _ANSWER_KEYS if isinstance(v := usage.get(k), str) and v}


_ANSWER_KEYS = ("response_id", "response_model", "finish_reason")


def _plain(struct: Any) -> dict[str, Any]:  # a protobuf Struct
    out: dict[str, Any] = {}
    fields = struct.fields
    for k in fields:  # (items() goes through the Mapping mixin, in Python)
        v = fields[k]
        # Usage is mostly token counts: a nonzero number needs no WhichOneof
        # (a value of another kind reads number_value as 0.0).
        if n := v.number_value:
            out[k] = n
            continue
        which = v.WhichOneof("kind")
        out[k] = getattr(v, which) if which in _SCALARS else None
    return out


_SCALARS = frozenset(("string_value", "bool_value", "number_value"))

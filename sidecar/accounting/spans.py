"""One ``router.request`` span per request, built from its access-log entry.

Pure: W3C trace context parsing, the standard samplers and the span itself.
The request path does none of this; Envoy's access log carries the client's
``traceparent`` / ``tracestate`` request headers with the sidecar's decision,
status, timings and token usage, and :mod:`sidecar.accounting.tracing` exports what this
module builds.

Attribute names follow OpenTelemetry's GenAI and HTTP semantic conventions
where those name the thing (``gen_ai.request.model``, ``gen_ai.usage.*``,
``http.response.status_code``); the router's own facts are ``router.*``
(docs/observability.md has the table).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._proto import otlp_pb2 as otlp
from ..decision import Decision
from .metering import Entry, status_class

SPAN_NAME = "router.request"
# The semantic-conventions version the attribute names follow (gen_ai.provider.name: 1.37).
SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = 0x01
# Span.flags: bits 0-7 are the W3C trace flags; these say whether the parent is remote.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200

# gen_ai.operation.name per ingress path (the conventions' well-known values).
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/responses/compact": "chat",
    "/anthropic/v1/messages": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}

def _from_decision(d: Decision) -> tuple[tuple[str, str | bool | None], ...]:
    """Span attributes copied from the decision (those it has)."""
    return (
        ("router.experiment", d.experiment),
        ("router.experiment_variant", d.variant),
        ("router.assignment", d.assignment),
        ("gen_ai.request.model", d.client_model),
        ("gen_ai.response.model", d.upstream_model),
        ("router.upstream_model", d.upstream_model),
        ("router.backend", d.backend),
        ("router.suffix", d.suffix),
        ("router.suffix_applied", d.suffix_applied),
        ("router.fallback_from", d.fallback_from),
        ("router.fallback_to", d.fallback_to),
        ("router.fallback_reason", d.fallback_reason),
        ("router.kind", d.kind),
        ("router.refusal", d.refusal),
        ("router.ingress", d.ingress),
        ("router.request_id", d.request_id),
        ("router.key_id", d.key_id),
        ("gen_ai.provider.name", d.family),
        ("gen_ai.system", d.family),  # the older name of gen_ai.provider.name, which many backends still read
    )


@dataclass(frozen=True, slots=True)
class Parent:
    """A remote span context read from ``traceparent``."""

    trace_id: bytes
    span_id: bytes
    flags: int
    state: str

    @property
    def sampled(self) -> bool:
        return bool(self.flags & _SAMPLED)


def parse_traceparent(value: str | None, state: str | None = None) -> Parent | None:
    """The parent a W3C ``traceparent`` names, or None when it is absent or
    invalid (the request then starts a new trace, as the spec says)."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return Parent(bytes.fromhex(trace_id), bytes.fromhex(span_id), int(flags, 16), (state or "").strip())


@dataclass(frozen=True, slots=True)
class Sampler:
    """The OpenTelemetry SDK's built-in samplers, by their ``OTEL_TRACES_SAMPLER`` names."""

    name: str = "parentbased_always_on"
    ratio: float = 1.0

    def sample(self, parent: Parent | None, trace_id: bytes) -> bool:
        if self.name.startswith("parentbased_"):
            if parent is not None:
                return parent.sampled
            root = self.name.removeprefix("parentbased_")
        else:
            root = self.name
        if root == "always_on":
            return True
        if root == "always_off":
            return False
        # traceidratio: the lower 8 bytes of the trace id against the ratio, so
        # every service sampling a trace at the same ratio agrees.
        return int.from_bytes(trace_id[8:], "big") < round(self.ratio * (1 << 64))


def add_attributes(into: Any, items: Mapping[str, Any]) -> None:
    """Append a key-value to the repeated field ``into`` per non-empty value, in order."""
    for k, v in items.items():
        if v is None or v == "":
            continue
        value = into.add(key=k).value
        if isinstance(v, list):
            for item in v:
                value.array_value.values.add(string_value=str(item))
        elif isinstance(v, bool):
            value.bool_value = v
        elif isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
            value.int_value = int(v)
        elif isinstance(v, float):
            value.double_value = v
        else:
            value.string_value = str(v)


def _answer_attributes(decision: Decision, answer: Mapping[str, str]) -> dict[str, Any]:
    """What the answer says about itself. The model is the one that answered,
    unless the body was renamed to the client's name on its way out."""
    attrs: dict[str, Any] = {}
    if "response_id" in answer:
        attrs["gen_ai.response.id"] = answer["response_id"]
    model = answer.get("response_model")
    if model and model != decision.client_model:
        attrs["gen_ai.response.model"] = model
    if "finish_reason" in answer:
        attrs["gen_ai.response.finish_reasons"] = [answer["finish_reason"]]
    return attrs


def error_type(decision: Decision | Mapping[str, Any], status: int, failed: bool) -> str | None:
    """``error.type`` for a request that ended in an error (None otherwise):
    the router's refusal code, else the status code, else ``_OTHER``."""
    if not (status >= 500 or failed or (status == 0)):
        return None
    if not isinstance(decision, Decision):
        decision = Decision.decode(decision)
    return str(decision.refusal or (status if status else "_OTHER"))


def span_attributes(decision: Decision, status: int, prompt_tokens: int | None,
                    completion_tokens: int | None, answer: Mapping[str, str] | None = None,
                    server: tuple[str, int] | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    operation = _OPERATIONS.get(decision.ingress or "")
    if operation is not None:
        attrs["gen_ai.operation.name"] = operation
    for name, value in _from_decision(decision):
        if value is not None:
            attrs[name] = value
    if status:
        attrs["http.response.status_code"] = status
    if prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = prompt_tokens
    if completion_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = completion_tokens
    attrs.update(_answer_attributes(decision, answer or {}))
    if server is not None:
        attrs["server.address"], attrs["server.port"] = server
    return attrs


def upstream_traceparent(client: str | None, new_id: Callable[[int], bytes] = os.urandom) -> tuple[str, str] | None:
    """When the client sent no valid ``traceparent``: one naming the router's
    own span (a new trace id, the span's id), for the request to carry
    upstream so the engine's spans join the router's trace; and that span id
    (hex), which the decision publishes so the span is built with it."""
    if parse_traceparent(client) is not None:
        return None
    raw = new_id(24)  # one draw: the span's id, then the trace's
    span_id = raw[:8].hex()
    return f"00-{raw[8:].hex()}-{span_id}-01", span_id


@dataclass(frozen=True, slots=True)
class Context:
    """Where a sampled span goes: its trace, and the client's span when it sent
    one; ``span_id`` when the router already named its span upstream."""

    trace_id: bytes
    parent: Parent | None
    span_id: bytes | None = None


def sampled(entry: Entry, sampler: Sampler, new_id: Callable[[int], bytes] = os.urandom) -> Context | None:
    """The trace of an entry's span, or None when the sidecar never decided
    the request or the sampler drops it."""
    if not entry.decision:
        return None
    parent = parse_traceparent(entry.traceparent, entry.tracestate)
    if parent is not None and entry.decision.span_id == parent.span_id.hex():
        # The router made this context and sent it upstream: its span is the root.
        return Context(parent.trace_id, None, parent.span_id) if sampler.sample(None, parent.trace_id) else None
    trace_id = parent.trace_id if parent is not None else new_id(16)
    return Context(trace_id, parent) if sampler.sample(parent, trace_id) else None


def build(entry: Entry, ctx: Context, new_id: Callable[[int], bytes] = os.urandom,
          make: Callable[..., otlp.Span] = otlp.Span,
          server_of: Callable[[str], tuple[str, int] | None] = lambda backend: None) -> otlp.Span:
    """The span of one access-log entry. ``make`` creates it (a batch's
    ``spans.add`` builds it in place, without a copy); ``server_of`` gives a
    backend's host and port (``server.address`` / ``server.port``)."""
    parent = ctx.parent
    # Microseconds: what a float of unix seconds holds exactly.
    start = round(entry.start * 1_000_000) * 1000
    end = start + round((entry.total_s or 0.0) * 1_000_000) * 1000
    span = make(
        trace_id=ctx.trace_id,
        span_id=ctx.span_id or new_id(8),
        name=SPAN_NAME,
        kind=otlp.Span.SPAN_KIND_SERVER,
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        flags=_SAMPLED | _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None else 0),
    )
    decision = entry.decision
    backend = decision.backend
    server = server_of(backend) if backend is not None else None
    failed = status_class(entry) == "server_error" or entry.upstream_failed
    attrs = span_attributes(decision, entry.status, entry.prompt_tokens, entry.completion_tokens, entry.answer, server)
    if failed:
        attrs["error.type"] = error_type(decision, entry.status, True)
    add_attributes(span.attributes, attrs)
    if parent is not None:
        span.parent_span_id = parent.span_id
        span.trace_state = parent.state
    if failed:
        span.status.code = otlp.Status.STATUS_CODE_ERROR
        span.status.message = decision.refusal or f"status {entry.status}"
    return span


def span_of(entry: Entry, sampler: Sampler, new_id: Callable[[int], bytes] = os.urandom) -> otlp.Span | None:
    """The span of one access-log entry, or None when it has none (see :func:`sampled`)."""
    ctx = sampled(entry, sampler, new_id)
    return build(entry, ctx, new_id) if ctx is not None else None

"""A client's request stream: Envoy's request headers and body in, the
decision out as header and body mutations plus dynamic metadata, or the
sidecar's own answer. The decision itself is :mod:`sidecar.routing`'s; this
module translates."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, cast

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import duration_pb2

from .. import errors, metrics, routing
from ..accounting.spans import upstream_traceparent
from ..backends import websearch
from ..contract import MAX_WAIT_METADATA, SHADOW_HEADER
from ..decision import Decision, Fields, encode
from ..errors import Reply
from ..experiments.feedback import Feedback, is_feedback, owner_of
from ..payload.json_budget import HOLD_PATIENCE_S, Budget
from ..payload.rewrite import rewrite_json_body
from ..routing import dispatch, explain
from ..routing.context import Caller
from ..routing.ingress import Ingress, canonical, family_for
from ..routing.limits import LimitPlan
from ..routing.limits import refusal as budget_refusal
from ..routing.snapshot import BACKEND_HEADER, CLIENT_ROUTER_HEADERS, EXPLAIN_HEADER, Snapshot
from ..routing.trace import Trace
from ..stores.cache import ResponseCache
from .answer_parts import NOTHING_MORE, AnswerParts, immediate
from .response_stream import (
    NAMESPACE,
    RESPONSE_HEADER,
    header_map,
    usage_metadata,
)
from .runtime import HandlerRuntime

log = logging.getLogger("model_router.extproc")

_P = pm.ProcessingMode
# The static mode asks for the response headers too, and every answer that lets
# a request on turns them off: Envoy then needs only the request from this
# stream. (With responses skipped statically, Envoy 1.40 answers its own 413
# for a large body still arriving when the sidecar refuses at the headers.)
_MODE_BODY_NEXT = _P(
    request_header_mode=_P.SEND, request_body_mode=_P.BUFFERED, response_header_mode=_P.SKIP,
    response_body_mode=_P.NONE, request_trailer_mode=_P.SKIP, response_trailer_mode=_P.SKIP,
)
# The answer that asks for the body, the same for every request: built once,
# never changed (grpc.aio only serializes what it is given).
_BODY_NEXT = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_MODE_BODY_NEXT)


class RequestState:
    """Per-request state kept for the life of one ext_proc stream."""

    __slots__ = (
        "snap", "head", "ingress", "family", "passthrough", "headers", "header_count", "header_bytes",
        "raw_path", "path", "caller", "route", "trace", "span_id",
    )

    def __init__(self) -> None:
        self.snap: Snapshot = None  # type: ignore[assignment]  # set at the request headers, before anything reads it
        self.head: dispatch.Head | None = None
        self.ingress: Ingress | None = None
        self.family = "openai"
        self.passthrough = False
        self.headers: dict[str, str] = {}
        self.header_count = 0
        self.header_bytes = 0
        self.path = "/"
        self.raw_path = "/"
        self.caller: Caller | None = None
        self.route: routing.Route | None = None
        self.trace: Trace | None = None  # an operator asked for this request's decision trace
        self.span_id: str | None = None  # the router's span, named upstream when the client sent no traceparent

    def read(self, msg: pb.HttpHeaders) -> dict[str, str]:
        """Read the request headers once, into :attr:`headers` (as ``header_map``
        reads them), counting them and their bytes for the header limits."""
        out: dict[str, str] = {}
        entries = msg.headers.headers
        for x in entries:
            raw = x.raw_value
            out[x.key] = raw.decode("latin-1") if raw else x.value
        self.headers = out
        self.header_count = len(entries)
        if len(out) == len(entries):  # no name repeated: the dict holds every byte, summed natively
            self.header_bytes = sum(map(len, out)) + sum(map(len, out.values()))
        else:
            self.header_bytes = sum(len(x.key) + (len(x.raw_value) or len(x.value)) for x in entries)
        return out

    def meta(self) -> Decision:
        """What every answer on this stream publishes besides the decision."""
        return Decision.of(self.fields())

    def fields(self) -> Fields:
        """:meth:`meta`'s keyword arguments."""
        out: Fields = {}
        rid = self.headers.get("x-request-id")
        if rid:
            out["request_id"] = rid
            if self.family == "anthropic":
                out["x_request_id"] = rid  # returned as ``request-id``, the header the Anthropic SDK reads
        if self.ingress is not None:
            out["ingress"] = self.ingress.path
        if self.caller is not None and self.caller.key is not None:
            out["key_id"] = self.caller.key.id
        if self.span_id is not None:
            out["span_id"] = self.span_id
        return out


def longest_wait(context: Any) -> float | None:
    """How long Envoy waits for one answer on this stream when the sidecar
    asks for more time: the ``max_message_timeout`` the decision filter names
    in the stream's metadata (:data:`~sidecar.contract.MAX_WAIT_METADATA`).
    None: it does not say (Envoy Gateway cannot set one), so only its
    ``message_timeout`` applies."""
    for key, value in (context.invocation_metadata() or ()) if context is not None else ():
        if key == MAX_WAIT_METADATA:
            try:
                return int(value) / 1000
            except (TypeError, ValueError):
                return None
    return None


def _more_time(seconds: float) -> pb.ProcessingResponse:
    """Asks Envoy to wait ``seconds`` (and a margin) for the stream's next
    answer, up to its ``max_message_timeout``."""
    return pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=int(seconds) + 5))


@dataclass(frozen=True, slots=True)
class Interim:
    """An answer to send at once (Envoy is asked to wait longer) and the
    call that makes the final one: the stream sends ``now``, then awaits ``then()``."""

    now: pb.ProcessingResponse
    then: Callable[[], Awaitable[pb.ProcessingResponse]]


# A route's header mutation: (set on every request of the route, removed, this request's own).
_Headers = tuple[tuple[tuple[str, str], ...], tuple[str, ...], list[tuple[str, str]]]


class RequestHandler:
    """Answers a client's request stream: the decision at its headers or its
    body, and the sidecar's own answers (refusals, listings, feedback, cache
    hits, ``:online``). One per process; a stream's own state is a
    :class:`RequestState`."""

    def __init__(self, runtime: HandlerRuntime, cache: ResponseCache) -> None:
        self.runtime = runtime
        self.cache = cache
        self._counter = 0
        self._rand = random.Random(os.urandom(16))
        self.feedback = Feedback()
        self.json_budget = Budget()
        self.parts = AnswerParts()
        self._traces_of: Snapshot | None = None  # the snapshot _traces was read for
        self._traces = False  # this process exports spans

    async def headers(self, st: RequestState, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """The answer to the request headers (already read into ``st`` by
        :meth:`RequestState.read`): a decision, or a request for the body."""
        resp = self._request_headers(st, msg)
        return resp if st.route is None else await self._sent_on(st, resp)

    async def body(self, st: RequestState, body: bytes,
                   waits: Callable[[], float | None] = lambda: None) -> pb.ProcessingResponse | Interim:
        """The answer to the body: the decision; an ``:online`` request, or one
        held before its refusal, first gets a longer message timeout (an
        :class:`Interim`). ``waits``: how long Envoy waits for one answer when
        asked (:func:`longest_wait`), read only when needed."""
        arrived = time.monotonic()
        excess = await self.json_budget.excess(body)
        if excess is not None:
            # Held before it is answered (payload/json_budget.py): as long as
            # Envoy can be asked to wait, else within its message timeout.
            if (waits() or 0) > HOLD_PATIENCE_S:
                return Interim(_more_time(HOLD_PATIENCE_S), partial(self._held, st, body, excess, HOLD_PATIENCE_S))
            patience = st.snap.config.server.message_timeout_ms / 2000 - (time.monotonic() - arrived)
            return await self._held(st, body, excess, patience)
        if st.ingress is None and not st.passthrough and is_feedback(st.path):
            return await self._feedback(st, body)
        resp = self._pass(st, body, phase="body") if st.passthrough else self._decide(st, body, phase="body")
        if st.route is None:
            return resp  # refused
        plan = st.route.plan
        if plan is not None and plan.suffix == "online":
            # The sidecar answers this one itself; keep Envoy waiting for it.
            search = st.snap.config.web_search
            assert search is not None  # :online is served only with a search provider
            return Interim(_more_time(search.deadline_s), partial(self._searched, st, body))
        if plan is not None and plan.cache is not None and plan.cache.read:
            resp = await self._from_cache(st) or resp
        return await self._sent_on(st, resp)

    async def _held(self, st: RequestState, body: bytes, excess: str, patience: float) -> pb.ProcessingResponse:
        if patience > 0:
            await self.json_budget.hold(len(body), patience)
        return self._refuse(self._too_complex(st, excess), st)

    async def _searched(self, st: RequestState, body: bytes) -> pb.ProcessingResponse:
        return await self._sent_on(st, await self._online(st, body))

    async def _sent_on(self, st: RequestState, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """The last answer of a request the decision routed (``resp``, or a
        refusal after all): with Redis, the token budgets' reservation made
        in Redis too; a shadow copy counted when the answer lets the request
        on (an answer of the sidecar's own sends nothing upstream, so Envoy
        mirrors nothing)."""
        route = st.route
        assert route is not None
        limits = route.limits
        if limits is not None and limits.budgets and st.snap.config.redis is not None:
            resp = await self._shared_budgets(st, limits, resp)
        if route.shadow is not None and not resp.HasField("immediate_response"):
            assert route.plan is not None and route.plan.experiment is not None  # a shadow is an experiment's
            metrics.SHADOW_COPIES.labels(route.plan.experiment, route.shadow[1]).inc()
        return resp

    def shed(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Too many streams open here: refuse now, cheaply, rather than queue."""
        metrics.SHED.inc()
        path = header_map(msg).get(":path", "/")
        reply = errors.error("overloaded", "The router is at capacity; retry shortly.", family_for(canonical(path)))
        return immediate(reply, Decision(kind="shed"))


    def _request_headers(self, st: RequestState, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        # One config decides the whole request, even if a reload lands mid-upload.
        st.snap = snap = self.runtime.snapshot
        h = st.headers
        st.raw_path = h.get(":path", "/")
        if EXPLAIN_HEADER in h and explain.wanted(h, snap.config.server.admin_token):
            st.trace = Trace()
        st.head = head = dispatch.at_headers(snap, st.raw_path, h, h.get(":method", "GET"),
                                             body_follows=not msg.end_of_stream, trace=st.trace)
        st.path, st.family, st.ingress = head.path, head.family, head.ingress
        if head.kind == "refused":
            assert isinstance(head.outcome, Reply)
            return self._refuse(head.outcome, st)
        st.caller = head.caller
        if head.kind == "follow_up":
            return self._routed_now(st, head.outcome, "follow_up")
        if head.kind == "passthrough" and snap.config.feedback_metrics and is_feedback(st.path):
            return self._feedback_headers(st, msg)  # without feedback metrics the path is the backends' own
        if head.kind == "listing":
            assert isinstance(head.outcome, Reply)
            metrics.DECISIONS.inc("listing")
            return immediate(head.outcome, st.meta() | Decision(kind="listing"))
        if head.kind == "passthrough":
            st.passthrough = True
            if isinstance(head.outcome, Reply):
                return self._refuse(head.outcome, st)
            if msg.end_of_stream:
                return self._pass(st, b"", phase="headers")
            return _BODY_NEXT
        assert st.ingress is not None
        if st.ingress.body == "query" or msg.end_of_stream:
            # No body will follow: decide now.
            return self._decide(st, b"", phase="headers")
        return _BODY_NEXT

    def _pass(self, st: RequestState, body: bytes, phase: str) -> pb.ProcessingResponse:
        """A path outside the ingress table, judged on the models it names."""
        assert st.head is not None
        route = dispatch.at_body(st.snap, st.head, body, st.headers, dispatch.Live(), st.trace)
        return self._routed_now(st, route, "passthrough", phase)

    def _routed_now(self, st: RequestState, route: routing.Route | Reply | None, kind: str,
                    phase: str = "headers") -> pb.ProcessingResponse:
        assert route is not None
        if isinstance(route, Reply):
            return self._refuse(route, st)
        return self._routed(st, route, phase, kind)

    def _too_complex(self, st: RequestState, excess: str) -> Reply:
        return errors.error("invalid_json", f"The request body has {excess}; the router does not read it.",
                            st.family, param=None)

    def _decide(self, st: RequestState, body: bytes, phase: str) -> pb.ProcessingResponse:
        self._counter += 1
        # now, mono, pick, rand, shadow_rand, states, spent (positional: keywords cost on the request path)
        live = dispatch.Live(time.time(), time.monotonic(), self._counter, self._rand.random(), self._rand.random(),
                             self.runtime.backend_states(), self.runtime.budgets.spent)
        assert st.head is not None
        try:
            route: routing.Route | Reply = dispatch.at_body(st.snap, st.head, body, st.headers, live, st.trace)
        except Exception:
            log.exception("decision failed for %s", st.path.partition("?")[0])
            route = errors.error("internal", "The router could not process this request.", st.family)
        if isinstance(route, Reply):
            return self._refuse(route, st)
        return self._routed(st, route, phase, "routed")

    def _routed(self, st: RequestState, route: routing.Route, phase: str, kind: str) -> pb.ProcessingResponse:
        """The answer that sends a request on: header and body mutations, and
        the decision as dynamic metadata (counted as ``kind`` once it is sure
        to go: a 431 counts as a refusal only). Each feature that is off
        costs its check here, no call."""
        if route.path is None and st.raw_path != st.path:
            route.path = st.path  # upstream goes the spelling the decision was made on
        headers = self._route_headers(st, route)
        if isinstance(headers, Reply):
            return self._refuse(headers, st)
        metrics.DECISIONS.inc(kind)
        st.route = route
        if st.snap.config.feedback_metrics:
            self._remember(st, route)
        if route.limits is not None and route.limits.budgets:
            self.runtime.budgets.reserve(route.limits)  # in the step whose decision admitted it
        m = route.fields()  # (one dict to the wire, no Decision built: this runs for every routed request)
        m.update(st.fields())
        if st.trace is not None:
            m["x_explain"] = self._explained(st.trace, route)
        md = encode(m)
        return self.parts.routed(phase, NOTHING_MORE, NAMESPACE, md, *headers, route.body)

    async def _shared_budgets(self, st: RequestState, limits: LimitPlan, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """The reservation the decision made locally, made in Redis too and
        checked against every replica's count: a budget another replica
        spent refuses the request after all."""
        spent = await self.runtime.budgets.reserve_shared(limits)
        if spent is None:
            return resp
        return self._refuse(budget_refusal(spent, limits.model, st.family, limits.now), st)

    async def _online(self, st: RequestState, body: bytes) -> pb.ProcessingResponse:
        route = st.route
        assert route is not None and route.plan is not None
        search = st.snap.config.web_search
        assert search is not None
        request = orjson.loads(route.body if route.body is not None else body)
        headers = {"content-type": "application/json", **dict(route.set_headers)}
        reply = await websearch.run(
            self.runtime.http_session(), search, route.backend,
            route.path or st.path, headers, request, cast(str, route.plan.rewrite_model),  # set with the suffix
        )
        if reply.status >= 500:
            self.runtime.report_response(route.backend.name, reply.status)
        _, usage = rewrite_json_body(reply.body, None, "openai")
        meta = route.decision() | st.meta() | Decision(kind=route.plan.kind)
        if st.trace is not None:
            reply = replace(reply, headers=reply.headers + ((EXPLAIN_HEADER, st.trace.summary()),))
        return immediate(reply, meta, usage_metadata(usage) if usage.seen else None)

    async def _from_cache(self, st: RequestState) -> pb.ProcessingResponse | None:
        """A cache hit's answer (no upstream call), or None to send the request on.
        The entry holds the backend's answer; this request's rename applies."""
        route = st.route
        assert route is not None and route.plan is not None
        plan = route.plan
        assert plan.cache is not None
        entry = await self.cache.get(st.snap.config, plan.cache.key, plan.experiment or "", plan.variant or "")
        if entry is None:
            return None
        body = entry.body if plan.rewrite_model is None else rewrite_json_body(entry.body, plan.rewrite_model, plan.family)[0]
        reply = Reply(entry.status, body, headers=(("content-type", entry.content_type),))
        meta = route.decision() | st.meta() | Decision(kind="cache_hit", x_cache="hit")
        if st.trace is not None:
            meta |= Decision(x_explain=st.trace.summary())
        return immediate(reply, meta)

    # ------------------------------------------------------------------ feedback

    @staticmethod
    def _owner(st: RequestState) -> str:
        caller = st.caller
        return owner_of(caller.key.id if caller.key is not None else None, caller.api_key) if caller else ""

    def _remember(self, st: RequestState, route: routing.Route) -> None:
        """The arm that serves this request, for feedback on it when the config
        declares feedback metrics (in memory: no I/O here)."""
        plan = route.plan
        if plan is not None and plan.kind == "routed" and plan.experiment is not None:
            self.feedback.record(st.snap.config, st.headers.get("x-request-id"), partial(self._owner, st),
                                 plan.experiment, plan.variant)

    def _feedback_headers(self, st: RequestState, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        if not msg.end_of_stream:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_MODE_BODY_NEXT)
        method = st.headers.get(":method", "GET").upper()
        kind: errors.Kind = "method_not_allowed" if method != "POST" else "invalid_feedback"
        message = "Feedback is sent with POST." if method != "POST" else "The body must be a JSON object."
        return immediate(errors.error(kind, message, "openai"), st.meta())

    async def _feedback(self, st: RequestState, body: bytes) -> pb.ProcessingResponse:
        reply, meta = await self.feedback.handle(st.snap.config, st.headers.get(":method", "POST"), self._owner(st), body)
        return immediate(reply, st.meta() | meta)

    def _route_headers(self, st: RequestState, route: routing.Route) -> _Headers | Reply:
        """The request-header mutation that carries a route (the headers every
        request of this route gets, the ones removed, the request's own), or a
        431 when it would take the request past Envoy's header limits (Envoy
        would answer that mutation with a 503 that blames the server)."""
        shared = ((BACKEND_HEADER, route.cluster), *route.set_headers)
        if route.limits is not None:
            shared += route.limits.headers  # the descriptor Envoy's rate-limit filter reads
        plan = route.plan
        if plan is not None and (plan.read_usage or plan.needs_response):
            # The response body must be readable to rewrite it or count its tokens.
            shared += (("accept-encoding", "identity"),)
        if plan is not None and plan.needs_response:
            shared += ((RESPONSE_HEADER, "rewrite"),)  # selects the route whose upstream filter rewrites
        if route.shadow is not None:
            shared += ((SHADOW_HEADER, route.shadow[0]),)  # the routes' mirror policy copies the request there
        own: list[tuple[str, str]] = []
        if route.path is not None:
            own.append((":path", route.path))
        if route.body is not None:
            own.append(("content-length", str(len(route.body))))
        # The engine's spans join the router's trace (docs/observability.md);
        # with no span exported, none is named upstream: it would be no one's.
        current = self.runtime.snapshot  # (what the tracer follows; its settings change with it only)
        if current is not self._traces_of:
            self._traces_of, self._traces = current, self.runtime.exports_traces()
        traced = upstream_traceparent(st.headers.get("traceparent")) if self._traces else None
        if traced is not None:
            own.append(("traceparent", traced[0]))
            st.span_id = traced[1]
        limits = st.snap.config.envoy
        count, size = st.header_count, st.header_bytes
        for k, v in (*shared, *own):
            old = st.headers.get(k)
            count += old is None
            size += len(k) + len(v) if old is None else len(v) - len(old)
        if count > limits.max_request_headers or size > limits.max_request_headers_kb * 1024:
            return errors.error(
                "headers_too_large",
                f"The request carries too many or too large headers (the limit is {limits.max_request_headers} "
                f"headers and {limits.max_request_headers_kb} KiB).",
                st.family,
            )
        remove = route.remove_headers
        if not st.headers.keys().isdisjoint(CLIENT_ROUTER_HEADERS):
            remove += tuple(name for name in CLIENT_ROUTER_HEADERS if name in st.headers)  # never upstream
        return shared, remove, own

    @staticmethod
    def _explained(trace: Trace, result: routing.Route | Reply) -> str:
        """The trace's summary (the decision's ``x_explain``: Envoy sends it
        back as a response header), for a request an operator asked about."""
        trace.conclude(result)
        return trace.summary()

    def _refuse(self, reply: Reply, st: RequestState) -> pb.ProcessingResponse:
        metrics.DECISIONS.inc(str(reply.status))
        if reply.reserved_by is not None:
            metrics.RESERVED_REFUSALS.labels(reply.reserved_by).inc()
        if st.trace is not None:
            reply = replace(reply, headers=reply.headers + ((EXPLAIN_HEADER, self._explained(st.trace, reply)),))
        return immediate(reply, st.meta())

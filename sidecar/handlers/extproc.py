"""The ext_proc gRPC adapter: Envoy's messages in, decisions out.

One gRPC stream per HTTP request. The adapter translates Envoy's protobuf
messages into :mod:`sidecar.routing` inputs and the decisions back into header
and body mutations or immediate responses; it holds no routing logic itself.

Messages per request: request headers, then (for model-routed paths) the
buffered request body. The decision goes back as header and body mutations
plus dynamic metadata; Envoy's own filters read token usage from the
response and send one access-log entry per request, from which
:mod:`sidecar.accounting.metering` computes every metric. A response whose body must
change opens a second stream, at the response headers, handled by
:mod:`sidecar.handlers.response_stream`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace
from typing import Any, cast

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from .. import errors, metrics, routing
from ..accounting.spans import upstream_traceparent
from ..backends import websearch
from ..decision import EMPTY, X_RL_LIMIT, X_RL_UNIT, Decision, Fields, encode
from ..errors import Reply
from ..experiments.feedback import Feedback, is_feedback, owner_of
from ..payload import response_ids
from ..payload.json_budget import Budget
from ..payload.rewrite import rewrite_json_body
from ..routing import dispatch, explain
from ..routing.context import Caller
from ..routing.ingress import Ingress, canonical, family_for
from ..routing.limits import refusal as budget_refusal
from ..routing.shadow import SHADOW_HEADER
from ..routing.snapshot import BACKEND_HEADER, CLIENT_ROUTER_HEADERS, EXPLAIN_HEADER, Snapshot
from ..routing.trace import Trace
from ..stores.cache import ResponseCache
from .answer_parts import AnswerParts, header_mutation
from .hop_stream import HopStream, is_hop
from .response_stream import (
    NAMESPACE,
    RESPONSE_HEADER,
    ResponseStream,
    Rewrite,
    header_map,
    rewrite_of,
    silence_limit,
    usage_metadata,
)
from .runtime import HandlerRuntime
from .shadow_stream import ShadowStream, is_shadow

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
# Decided at request headers: nothing more to see.
_MODE_NOTHING_MORE = _P(
    request_header_mode=_P.SEND, request_body_mode=_P.NONE, response_header_mode=_P.SKIP,
    response_body_mode=_P.NONE, request_trailer_mode=_P.SKIP, response_trailer_mode=_P.SKIP,
)


def _struct(namespaces: dict[str, Any]) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update(namespaces)
    return md


def immediate(reply: Reply, meta: Decision = EMPTY, usage: struct_pb2.Struct | None = None) -> pb.ProcessingResponse:
    """The sidecar's own answer. Its metadata marks it as ours (Envoy's
    local-reply mapping leaves it alone) and carries the decision so far."""
    md = Decision(reply="sidecar", kind="refusal" if reply.status >= 400 else "answered") | reply.meta | meta
    # No request-rate filter ran on this answer: it carries no rate headers.
    md = md.without(X_RL_UNIT, X_RL_LIMIT)
    typed = any(k == "content-type" for k, _ in reply.headers)
    resp = pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=header_mutation((() if typed else (("content-type", reply.content_type),)) + reply.headers),
            body=reply.body,
            details=f"model_router_{reply.status}",
        ),
        dynamic_metadata=_struct({NAMESPACE: md.encode()}),
    )
    if usage is not None:
        resp.dynamic_metadata.MergeFrom(usage)
    return resp


class _Stream:
    """Per-request state kept for the life of one ext_proc stream."""

    __slots__ = (
        "snap", "head", "ingress", "family", "passthrough", "headers", "header_count", "header_bytes",
        "raw_path", "path", "caller", "route", "trace", "span_id",
    )

    def __init__(self) -> None:
        self.snap = cast("Snapshot", None)  # set at the request headers, before anything reads it
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


# A route's header mutation: (set on every request of the route, removed, this request's own).
_Headers = tuple[tuple[tuple[str, str], ...], tuple[str, ...], list[tuple[str, str]]]

def _read_headers(st: _Stream, msg: pb.HttpHeaders) -> dict[str, str]:
    """The request headers as a dict (as ``header_map`` reads them), counting
    them and their bytes for the header limits."""
    out: dict[str, str] = {}
    entries = msg.headers.headers
    for x in entries:
        raw = x.raw_value
        out[x.key] = raw.decode("latin-1") if raw else x.value
    st.header_count = len(entries)
    if len(out) == len(entries):  # no name repeated: the dict holds every byte, summed natively
        st.header_bytes = sum(map(len, out)) + sum(map(len, out.values()))
    else:
        st.header_bytes = sum(len(x.key) + (len(x.raw_value) or len(x.value)) for x in entries)
    return out


_SILENT = object()  # no message within the silence limit


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a read's outcome as seen, so an abandoned one is not logged as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _next(messages: AsyncIterator[pb.ProcessingRequest], timeout: float | None) -> Any:
    """The next message from Envoy, None at the stream's end, or ``_SILENT``
    when ``timeout`` seconds pass without one."""
    if timeout is None:
        try:
            return await messages.__anext__()
        except StopAsyncIteration:
            return None
    pending = asyncio.ensure_future(messages.__anext__())
    # When Envoy drops the stream (an upstream reset mid-response) gRPC cancels
    # Process here; the read then ends with StopAsyncIteration, which nobody awaits.
    pending.add_done_callback(_retrieved)
    try:
        done, _ = await asyncio.wait({pending}, timeout=timeout)
    finally:
        if not pending.done():
            pending.cancel()
    if not done:
        return _SILENT
    try:
        return pending.result()
    except StopAsyncIteration:
        return None


def _unasked(req: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """The empty answer to a message a stream's kind does not expect: Envoy goes on."""
    kind = req.WhichOneof("request")
    if kind == "response_body":
        return pb.ProcessingResponse(response_body=pb.BodyResponse())
    if kind == "response_trailers":
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    if kind == "request_trailers":
        return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
    if kind == "response_headers":
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    if kind == "request_headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    return pb.ProcessingResponse(request_body=pb.BodyResponse())


class Processor(pbg.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, runtime: HandlerRuntime) -> None:
        self.runtime = runtime
        self._counter = 0
        self._rand = random.Random(os.urandom(16))
        self.in_flight = 0
        self.cache = ResponseCache()
        self.feedback = Feedback()
        self.json_budget = Budget()
        self.parts = AnswerParts()
        self._stores: set[asyncio.Task[None]] = set()  # writes under way (held so none is collected mid-write)
        metrics.IN_FLIGHT.set_function(lambda: self.in_flight)  # read at scrape time, not per stream

    async def Process(self, request_iterator: AsyncIterable[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """One ext_proc stream. Its first message says which of four kinds it is,
        and one handler serves it to the end: a client's request (the decision),
        a fallback hop's attempt, a shadow copy, or an upstream response to
        rewrite."""
        messages = request_iterator.__aiter__()
        self.in_flight += 1
        try:
            first = await _next(messages, None)
            if first is None:
                return
            if first.WhichOneof("request") != "request_headers":
                stream = self._response(first, messages)
            elif is_hop(first):  # a fallback attempt on a hop's cluster
                stream = self._hop(first, messages)
            elif is_shadow(first):  # a shadow copy on its arm's cluster
                stream = self._copy(first, messages, context)
            else:
                stream = self._request(first, messages)
            async for answer in stream:
                yield answer
        except Exception:
            metrics.STREAM_ERRORS.inc()
            log.exception("ext_proc stream failed")
            raise
        finally:
            self.in_flight -= 1

    async def _request(self, first: pb.ProcessingRequest,
                       messages: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """A client's request: the decision at its headers, or at its body."""
        st = _Stream()
        if self.in_flight > self.runtime.snapshot.config.server.max_in_flight:
            yield self._shed(st, first.request_headers)
            return
        self.runtime.count_request()
        resp = await self._shared_budgets(st, self._request_headers(st, first.request_headers))
        yield resp
        if resp.mode_override.request_body_mode != _P.BUFFERED:
            return  # the last answer Envoy needs: end the stream from our side
        while (req := await _next(messages, None)) is not None:
            kind = req.WhichOneof("request")
            if kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "request_body":
                async for answer in self._body(st, req.request_body.body):  # one read: each copies the body
                    yield answer
                return
            else:
                yield _unasked(req)

    async def _body(self, st: _Stream, body: bytes) -> AsyncIterator[pb.ProcessingResponse]:
        if not await self.json_budget.within(body):
            yield self._refuse(self._too_complex(st), st)
            return
        if st.ingress is None and not st.passthrough and is_feedback(st.path):
            yield await self._feedback(st, body)
            return
        resp = self._request_body(st, body)
        plan = st.route.plan if st.route is not None else None
        if plan is not None and plan.suffix == "online":
            # The sidecar answers this one itself; keep Envoy waiting for it.
            search = st.snap.config.web_search
            assert search is not None  # :online is served only with a search provider
            deadline = search.deadline_s + 5
            yield pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=int(deadline)))
            resp = await self._online(st, body)
        elif plan is not None and plan.cache is not None and plan.cache.read:
            resp = await self._from_cache(st) or resp
        yield await self._shared_budgets(st, resp)

    async def _hop(self, first: pb.ProcessingRequest,
                   messages: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """A fallback attempt: the hop's model and credentials on its body."""
        hop = HopStream(self.runtime.snapshot, first, self.runtime.report_response)
        yield hop.headers()
        while (req := await _next(messages, None)) is not None:
            if req.WhichOneof("request") == "request_body":
                yield hop.body(req.request_body)
                return
            yield _unasked(req)

    async def _copy(self, first: pb.ProcessingRequest, messages: AsyncIterator[pb.ProcessingRequest],
                    context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """A shadow copy: the arm's model on its body, its answer metered apart."""
        shadow = self._shadow(first)
        # Counted when the call ends, however it ends: a copy whose backend
        # never answers ends with Envoy's reset, not a message.
        context.add_done_callback(lambda _call: shadow.finish())
        yield shadow.headers()
        while not shadow.done and (req := await _next(messages, None)) is not None:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                yield shadow.body(req.request_body)
            elif kind == "response_headers":
                yield shadow.response_headers(req.response_headers)
            elif kind == "response_body":
                yield shadow.response_body(req.response_body)
            else:
                yield _unasked(req)

    async def _response(self, first: pb.ProcessingRequest,
                        messages: AsyncIterator[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingResponse]:
        """An upstream response (the upstream filter opens the stream only for a
        decision that asked for it): the model name rewritten, usage read, the
        answer stored for the cache, a silent stream cut."""
        if first.WhichOneof("request") != "response_headers":
            yield _unasked(first)
            return
        rewrite = rewrite_of(first.metadata_context)
        if rewrite is None:
            yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            return
        if rewrite.not_found is not None:
            if header_map(first.response_headers).get(":status") == "404":
                # The engine lost it: the router's own answer, the one an id never issued gets.
                yield immediate(errors.response_not_found(rewrite.not_found))
                return
            if replace(rewrite, not_found=None) == Rewrite(None, rewrite.family, False):
                # Only the status mattered: the body goes on unseen.
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=_MODE_NOTHING_MORE)
                return
        tagger = response_ids.tagger(rewrite.id_tag, self.runtime.snapshot.id_key)
        response = ResponseStream(replace(rewrite, tagger=tagger))
        yield response.headers(first.response_headers)
        silence = silence_limit(self.runtime.snapshot.config.envoy.idle_timeout_s)
        while not response.finished:
            req = await _next(messages, silence if response.watching else None)
            if req is None:
                return
            if req is _SILENT:
                metrics.STREAMS_CUT.labels("idle").inc()
                for answer in response.cut(silence):
                    yield answer
                return
            kind = req.WhichOneof("request")
            if kind == "response_body":
                answer = response.body(req.response_body)
                if response.kept is not None:
                    self._store(response)
                yield answer
            elif kind == "response_trailers":
                for answer in response.trailers():
                    yield answer
                return
            else:
                yield _unasked(req)

    def _shadow(self, req: pb.ProcessingRequest) -> ShadowStream:
        sink = self.runtime.usage_sink()
        return ShadowStream(self.runtime.snapshot, req, sink.write if sink is not None else None)

    # ------------------------------------------------------------------ request

    def _shed(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """Too many streams open here: refuse now, cheaply, rather than queue."""
        metrics.SHED.inc()
        path = header_map(msg).get(":path", "/")
        reply = errors.error("overloaded", "The router is at capacity; retry shortly.", family_for(canonical(path)))
        return immediate(reply, Decision(kind="shed"))

    def _request_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        # One config decides the whole request, even if a reload lands mid-upload.
        st.snap = snap = self.runtime.snapshot
        st.headers = h = _read_headers(st, msg)
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
            metrics.DECISIONS.labels("listing").inc()
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

    def _request_body(self, st: _Stream, body: bytes) -> pb.ProcessingResponse:
        if st.passthrough:
            return self._pass(st, body, phase="body")
        return self._decide(st, body, phase="body")

    def _pass(self, st: _Stream, body: bytes, phase: str) -> pb.ProcessingResponse:
        """A path outside the ingress table, judged on the models it names."""
        assert st.head is not None
        route = dispatch.at_body(st.snap, st.head, body, st.headers, dispatch.Live(), st.trace)
        return self._routed_now(st, route, "passthrough", phase)

    def _routed_now(self, st: _Stream, route: routing.Route | Reply | None, kind: str,
                    phase: str = "headers") -> pb.ProcessingResponse:
        assert route is not None
        if isinstance(route, Reply):
            return self._refuse(route, st)
        metrics.DECISIONS.labels(kind).inc()
        return self._routed(st, route, phase)

    def _too_complex(self, st: _Stream) -> Reply:
        return errors.error("invalid_json", f"The request body has more than {self.json_budget.max_members} JSON "
                            "object members; the router does not read it.", st.family, param=None)

    def _decide(self, st: _Stream, body: bytes, phase: str) -> pb.ProcessingResponse:
        self._counter += 1
        live = dispatch.Live(
            now=time.time(), pick=self._counter, rand=self._rand.random(), shadow_rand=self._rand.random(),
            states=self.runtime.backend_states(), mono=time.monotonic(), spent=self.runtime.budgets.spent,
        )
        assert st.head is not None
        try:
            route: routing.Route | Reply = dispatch.at_body(st.snap, st.head, body, st.headers, live, st.trace)
        except Exception:
            log.exception("decision failed for %s", st.path.partition("?")[0])
            route = errors.error("internal", "The router could not process this request.", st.family)
        if isinstance(route, Reply):
            return self._refuse(route, st)
        metrics.DECISIONS_OF("routed").inc()
        return self._routed(st, route, phase)

    def _routed(self, st: _Stream, route: routing.Route, phase: str) -> pb.ProcessingResponse:
        """The answer that sends a request on: header and body mutations, and
        the decision as dynamic metadata."""
        self._canonical_path(st, route)
        headers = self._route_headers(st, route)
        if isinstance(headers, Reply):
            return self._refuse(headers, st)
        st.route = route
        self._remember(st, route)
        if route.limits is not None and route.limits.budgets:
            self.runtime.budgets.reserve(route.limits)  # in the step whose decision admitted it
        m = route.fields()  # (one dict to the wire, no Decision built: this runs for every routed request)
        m.update(st.fields())
        explained = self._explained(st, route)
        if explained is not None:
            m["x_explain"] = explained
        md = encode(m)
        return self.parts.routed(phase, _MODE_NOTHING_MORE, NAMESPACE, md, *headers, route.body)

    async def _shared_budgets(self, st: _Stream, resp: pb.ProcessingResponse) -> pb.ProcessingResponse:
        """With Redis, the reservation the decision made locally is made in
        Redis too, checked against every replica's count; a budget another
        replica spent refuses the request after all."""
        route = st.route
        if route is None or route.limits is None or not route.limits.budgets or st.snap.config.redis is None:
            return resp
        spent = await self.runtime.budgets.reserve_shared(route.limits)
        if spent is None:
            return resp
        return self._refuse(budget_refusal(spent, route.limits.model, st.family, route.limits.now), st)

    async def _online(self, st: _Stream, body: bytes) -> pb.ProcessingResponse:
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

    async def _from_cache(self, st: _Stream) -> pb.ProcessingResponse | None:
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

    def _store(self, response: ResponseStream) -> None:
        """Keep the answer the response stream saw, beside the stream: Envoy
        may end the stream as soon as it has the last answer, and the client
        never waits for the store."""
        order = response.plan.store
        entry = response.kept
        if order is None or entry is None:
            return
        task = asyncio.create_task(
            self.cache.put(self.runtime.snapshot.config, order.key, entry, order.ttl_s, order.experiment, order.variant)
        )
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    # ------------------------------------------------------------------ feedback

    @staticmethod
    def _owner(st: _Stream) -> str:
        caller = st.caller
        return owner_of(caller.key.id if caller.key is not None else None, caller.api_key) if caller else ""

    def _remember(self, st: _Stream, route: routing.Route) -> None:
        """The arm that serves this request, for feedback on it (in memory: no I/O here)."""
        plan = route.plan
        if plan is not None and plan.kind == "routed" and plan.experiment is not None and (
                st.ingress is not None and st.ingress.body == "json"):  # a copy's model is a JSON member
            self.feedback.record(st.snap.config, st.headers.get("x-request-id"), self._owner(st),
                                 plan.experiment, plan.variant)

    def _feedback_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        if not msg.end_of_stream:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_MODE_BODY_NEXT)
        method = st.headers.get(":method", "GET").upper()
        kind: errors.Kind = "method_not_allowed" if method != "POST" else "invalid_feedback"
        message = "Feedback is sent with POST." if method != "POST" else "The body must be a JSON object."
        return immediate(errors.error(kind, message, "openai"), st.meta())

    async def _feedback(self, st: _Stream, body: bytes) -> pb.ProcessingResponse:
        reply, meta = await self.feedback.handle(st.snap.config, st.headers.get(":method", "POST"), self._owner(st), body)
        return immediate(reply, st.meta() | meta)

    @staticmethod
    def _canonical_path(st: _Stream, route: routing.Route) -> None:
        """Send upstream the spelling the decision was made on."""
        if route.path is None and st.raw_path != st.path:
            route.path = st.path

    def _route_headers(self, st: _Stream, route: routing.Route) -> _Headers | Reply:
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
        if route.shadow is not None and plan is not None and plan.experiment is not None:
            cluster, arm = route.shadow
            shared += ((SHADOW_HEADER, cluster),)  # the routes' mirror policy copies the request there
            metrics.SHADOW_COPIES.labels(plan.experiment, arm).inc()
        own: list[tuple[str, str]] = []
        if route.path is not None:
            own.append((":path", route.path))
        if route.body is not None:
            own.append(("content-length", str(len(route.body))))
        traced = upstream_traceparent(st.headers.get("traceparent"))
        if traced is not None:  # the engine's spans join the router's trace (docs/observability.md)
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
        if any(name in st.headers for name in CLIENT_ROUTER_HEADERS):
            remove += tuple(name for name in CLIENT_ROUTER_HEADERS if name in st.headers)  # never upstream
        return shared, remove, own

    @staticmethod
    def _explained(st: _Stream, result: routing.Route | Reply) -> str | None:
        """The trace summary (the decision's ``x_explain``: Envoy sends it back
        as a response header), when an operator asked for it."""
        if st.trace is None:
            return None
        st.trace.conclude(result)
        return st.trace.summary()

    def _refuse(self, reply: Reply, st: _Stream) -> pb.ProcessingResponse:
        metrics.DECISIONS.labels(str(reply.status)).inc()
        if reply.reserved_by is not None:
            metrics.RESERVED_REFUSALS.labels(reply.reserved_by).inc()
        explained = self._explained(st, reply)
        if explained is not None:
            reply = replace(reply, headers=reply.headers + ((EXPLAIN_HEADER, explained),))
        return immediate(reply, st.meta())

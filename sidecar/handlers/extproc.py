"""The ext_proc gRPC server: one stream per HTTP request or response, one
handler per stream kind, chosen at the stream's first message.

- a client's request (:mod:`sidecar.handlers.request_stream`): the decision;
- a fallback hop's attempt (:mod:`sidecar.handlers.hop_stream`);
- a shadow copy (:mod:`sidecar.handlers.shadow_stream`);
- an upstream response the decision asked to see
  (:mod:`sidecar.handlers.response_stream`): the model renamed, usage read,
  the answer stored for the cache.

Envoy's own filters read token usage from the response and send one
access-log entry per request, from which :mod:`sidecar.accounting.metering`
computes every metric.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg

from .. import errors, metrics
from ..payload import response_ids
from ..stores.cache import ResponseCache
from .answer_parts import NOTHING_MORE, immediate
from .hop_stream import HopStream, is_hop
from .request_stream import Interim, RequestHandler, RequestState, longest_wait
from .response_stream import (
    ResponseStream,
    Rewrite,
    header_map,
    rewrite_of,
    silence_limit,
)
from .runtime import HandlerRuntime
from .shadow_stream import ShadowStream, is_shadow

log = logging.getLogger("model_router.extproc")


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
        self.in_flight = 0
        self.cache = ResponseCache()
        self.requests = RequestHandler(runtime, self.cache)
        self._stores: set[asyncio.Task[None]] = set()  # writes under way (held so none is collected mid-write)
        metrics.IN_FLIGHT.set_function(lambda: self.in_flight)  # read at scrape time, not per stream

    def close(self) -> None:
        """Stop the helper process that counts big bodies' JSON members."""
        self.requests.json_budget.close()

    async def Process(self, request_iterator: AsyncIterable[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """One ext_proc stream. Its first message says which of four kinds it is,
        and one handler serves it to the end: a client's request (the decision,
        answered here rather than through a generator of its own: each one an
        answer passes through costs about 2.5 µs, see docs/performance-passes.md), a
        fallback hop's attempt, a shadow copy, or an upstream response to rewrite."""
        messages = request_iterator.__aiter__()
        self.in_flight += 1
        try:
            try:
                first = await messages.__anext__()  # (no _next: a coroutine fewer on every request)
            except StopAsyncIteration:
                return
            stream = None
            if first.WhichOneof("request") != "request_headers":
                stream = self._response(first, messages)
            elif is_hop(first):  # a fallback attempt on a hop's cluster
                stream = self._hop(first, messages)
            else:
                st = RequestState()  # the request headers, read once for both questions
                if is_shadow(st.read(first.request_headers)):  # a shadow copy on its arm's cluster
                    stream = self._copy(first, messages, context)
            if stream is not None:
                async for answer in stream:
                    yield answer
                return
            # A client's request: the decision at its headers, or at its body.
            if self.in_flight > self.runtime.snapshot.config.server.max_in_flight:
                yield self.requests.shed(first.request_headers)
                return
            self.runtime.count_request()
            resp = await self.requests.headers(st, first.request_headers)
            yield resp
            if resp.mode_override.request_body_mode != pm.ProcessingMode.BUFFERED:
                return  # the last answer Envoy needs: end the stream from our side
            async for req in messages:
                if req.WhichOneof("request") != "request_body":
                    yield _unasked(req)  # (trailers: Envoy goes on)
                    continue
                waits = partial(longest_wait, context)  # (read only for a held refusal)
                answer = await self.requests.body(st, req.request_body.body, waits)  # one read: each copies the body
                if isinstance(answer, Interim):
                    yield answer.now
                    answer = await answer.then()
                yield answer
                return
        except Exception:
            metrics.STREAM_ERRORS.inc()
            log.exception("ext_proc stream failed")
            raise
        finally:
            self.in_flight -= 1

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
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=NOTHING_MORE)
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

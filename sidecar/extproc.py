"""The ext_proc gRPC adapter: Envoy's messages in, decisions out.

One gRPC stream per HTTP request. The adapter translates Envoy's protobuf
messages into :mod:`sidecar.decide` inputs and the decisions back into header
and body mutations or immediate responses; it holds no routing logic itself.

Messages per request: request headers, then (for model-routed paths) the
buffered request body. Response headers are asked for only when the config
has something to do with responses, and response bodies only when the
decision needs them (model rewrite or token usage).
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import replace
from typing import Iterable

import orjson
from google.protobuf import duration_pb2, struct_pb2

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from envoy.type.v3 import http_status_pb2

from . import decide, errors, listing, metrics, websearch
from .errors import Reply
from .body import named_models
from .ingress import canonical, family_for, lookup
from .ingress import listing_path as listing_of
from .rewrite import MAX_JSON_REWRITE, SSERewriter, rewrite_json_body
from .snapshot import BACKEND_HEADER

log = logging.getLogger("model_router.extproc")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _mode(request_body: int, response_headers: int, response_body: int) -> pm.ProcessingMode:
    """A full processing mode (an override replaces all six fields)."""
    P = pm.ProcessingMode
    return P(
        request_header_mode=P.SEND, request_body_mode=request_body,
        response_header_mode=response_headers, response_body_mode=response_body,
        request_trailer_mode=P.SKIP, response_trailer_mode=P.SKIP,
    )


_P = pm.ProcessingMode
_MODE_BODY_ONLY = _mode(_P.BUFFERED, _P.SKIP, _P.NONE)  # nothing in the response needs the sidecar
_MODE_NOTHING_MORE = _mode(_P.NONE, _P.SKIP, _P.NONE)  # decided at request headers
_MODE_RESPONSE_BUFFERED = _mode(_P.NONE, _P.SEND, _P.BUFFERED)  # rewrite a body of declared length
_MODE_RESPONSE_STREAMED = _mode(_P.NONE, _P.SEND, _P.STREAMED)  # rewrite or read a stream


_OWN_REPLY = struct_pb2.Struct()
_OWN_REPLY.update({"model_router": {"reply": "sidecar"}})


def header_mutation(set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()) -> pb.HeaderMutation:
    m = pb.HeaderMutation()
    for k, v in set_headers:
        opt = m.set_headers.add()
        opt.header.key = k
        opt.header.raw_value = v.encode("utf-8")
        opt.append_action = _OVERWRITE
    m.remove_headers.extend(remove)
    return m


def immediate(reply: Reply) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=header_mutation(
                (("content-type", reply.content_type),) + reply.headers
            ),
            body=reply.body,
            details=f"model_router_{reply.status}",
        ),
        dynamic_metadata=_OWN_REPLY,
    )


def _headers(msg: pb.HttpHeaders) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


class _Stream:
    """Per-request state kept for the life of one ext_proc stream."""

    __slots__ = (
        "start", "snap", "ingress", "family", "passthrough", "headers", "header_count", "header_bytes",
        "raw_path", "path", "caller", "route", "rewriter", "buffer", "buffered", "status", "counted",
    )

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.snap = None
        self.ingress = None
        self.family = "openai"
        self.passthrough = False
        self.headers: dict[str, str] = {}
        self.header_count = 0
        self.header_bytes = 0
        self.path = "/"
        self.raw_path = "/"
        self.caller = None
        self.route: decide.Route | None = None
        self.rewriter: SSERewriter | None = None
        self.buffer: bytearray | None = None
        self.buffered = False
        self.status = 0
        self.counted = False


class Processor(pbg.ExternalProcessorServicer):
    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self._counter = 0
        self._rand = random.Random(os.urandom(16))

    async def Process(self, request_iterator, context):
        st = _Stream()
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                if kind == "request_headers":
                    yield self._request_headers(st, req.request_headers)
                elif kind == "request_body":
                    resp = self._request_body(st, req.request_body)
                    if st.route is not None and st.route.plan is not None and st.route.plan.suffix == "online":
                        # The sidecar answers this one itself; keep Envoy waiting for it.
                        deadline = st.snap.config.web_search.deadline_s + 5
                        yield pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=int(deadline)))
                        resp = await self._online(st, req.request_body.body)
                    yield resp
                elif kind == "response_headers":
                    yield self._response_headers(st, req.response_headers)
                elif kind == "response_body":
                    yield self._response_body(st, req.response_body)
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        except Exception:
            metrics.STREAM_ERRORS.inc()
            log.exception("ext_proc stream failed")
            raise

    # ------------------------------------------------------------------ request

    def _request_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        # One config decides the whole request, even if a reload lands mid-upload.
        st.snap = snap = self.runtime.snapshot
        st.headers = h = _headers(msg)
        st.header_count = len(msg.headers.headers)
        st.header_bytes = sum(len(x.key) + len(x.raw_value or x.value) for x in msg.headers.headers)
        st.raw_path = h.get(":path", "/")
        st.path = canonical(st.raw_path)
        st.ingress = ingress = lookup(st.path)
        st.family = family = family_for(st.path)
        caller = decide.authenticate(snap, h, family)
        if isinstance(caller, Reply):
            return self._refuse(caller)
        st.caller = caller
        encoding = h.get("content-encoding", "identity").strip().lower()
        if not msg.end_of_stream and encoding not in ("", "identity"):
            # A body the router cannot read is a body it cannot judge.
            return self._refuse(errors.error(
                "unsupported_encoding", f"Request bodies with content-encoding '{encoding}' are not accepted.", family
            ))
        length = h.get("content-length")
        if length is not None and length.isdigit() and int(length) > snap.max_body_bytes:
            return self._refuse(errors.error(
                "too_large", f"The request body is larger than the limit of {snap.max_body_bytes} bytes.", family
            ))
        if ingress is None:
            listing_path = listing_of(st.path)
            if listing_path is not None:
                metrics.DECISIONS.labels("listing").inc()
                return immediate(listing.answer(snap, listing_path, h.get(":method", "GET"), caller.key))
            st.passthrough = True
            if msg.end_of_stream:
                return self._pass(st, b"", phase="headers")
            # Refuse early what no body can change (passthrough off, a restricted key).
            early = decide.passthrough(snap, st.path, caller, family, [])
            if isinstance(early, Reply):
                return self._refuse(early)
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_MODE_BODY_ONLY)
        if ingress.body == "query" or msg.end_of_stream:
            # No body will follow: decide now.
            return self._decide(st, b"", phase="headers")
        resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        if not snap.response_phase:
            resp.mode_override.CopyFrom(_MODE_BODY_ONLY)
        return resp

    def _request_body(self, st: _Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if st.passthrough:
            return self._pass(st, msg.body, phase="body")
        return self._decide(st, msg.body, phase="body")

    def _pass(self, st: _Stream, body: bytes, phase: str) -> pb.ProcessingResponse:
        """A path outside the ingress table, judged on the models it names."""
        if len(body) > st.snap.max_body_bytes:
            return self._refuse(self._too_large(st))
        models = named_models(st.path, body, st.headers.get("content-type", ""))
        route = decide.passthrough(st.snap, st.path, st.caller, st.family, models)
        if isinstance(route, Reply):
            return self._refuse(route)
        self._canonical_path(st, route)
        common = self._route_common(st, route)
        if isinstance(common, Reply):
            return self._refuse(common)
        metrics.DECISIONS.labels("passthrough").inc()
        if phase == "headers":
            return pb.ProcessingResponse(
                request_headers=pb.HeadersResponse(response=common), mode_override=_MODE_NOTHING_MORE
            )
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))

    @staticmethod
    def _too_large(st: _Stream) -> Reply:
        limit = st.snap.max_body_bytes
        return errors.error("too_large", f"The request body is larger than the limit of {limit} bytes.", st.family)

    def _decide(self, st: _Stream, body: bytes, phase: str) -> pb.ProcessingResponse:
        snap = st.snap
        if len(body) > snap.max_body_bytes:
            return self._refuse(self._too_large(st))
        self._counter += 1
        req = decide.Request(
            ingress=st.ingress, path=st.path, headers=st.headers, body=body, caller=st.caller,
            now=time.time(), pick=self._counter, rand=self._rand.random(),
            states=self.runtime.backend_states(), mono=time.monotonic(),
        )
        try:
            route = decide.decide(snap, req)
        except Exception:
            log.exception("decision failed for %s", st.path.partition("?")[0])
            route = errors.error("internal", "The router could not process this request.", st.family)
        if isinstance(route, Reply):
            return self._refuse(route)
        self._canonical_path(st, route)
        common = self._route_common(st, route)
        if isinstance(common, Reply):
            return self._refuse(common)
        metrics.DECISIONS.labels("routed").inc()
        st.route = route
        if route.plan is not None and route.plan.suffix is not None:
            metrics.VARIANT_REQUESTS.labels(route.plan.suffix, "true" if route.plan.suffix_applied else "false").inc()
        if route.body is not None:
            common.body_mutation.body = route.body
        if phase == "headers":
            resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
            if route.plan is None:
                resp.mode_override.CopyFrom(_MODE_NOTHING_MORE)
            return resp
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))

    async def _online(self, st: _Stream, body: bytes) -> pb.ProcessingResponse:
        route = st.route
        snap = st.snap
        request = orjson.loads(route.body if route.body is not None else body)
        headers = {"content-type": "application/json", **dict(route.set_headers)}
        reply = await websearch.run(
            self.runtime.http_session(), snap.config.web_search, route.backend,
            route.path or st.path, headers, request, route.plan.rewrite_model,
        )
        if reply.status >= 500:
            self.runtime.report_response(route.backend.name, reply.status)
        return immediate(replace(reply, headers=reply.headers + route.plan.headers))

    @staticmethod
    def _canonical_path(st: _Stream, route: decide.Route) -> None:
        """Send upstream the spelling the decision was made on."""
        if route.path is None and st.raw_path != st.path:
            route.path = st.path

    def _route_common(self, st: _Stream, route: decide.Route) -> pb.CommonResponse | Reply:
        """The request-header mutation that carries a route, or a 431 when it
        would take the request past Envoy's header limits (Envoy would answer
        that mutation with a 503 that blames the server)."""
        sets = [(BACKEND_HEADER, route.backend.name), *route.set_headers]
        if route.path is not None:
            sets.append((":path", route.path))
        if route.body is not None:
            sets.append(("content-length", str(len(route.body))))
        if route.plan is not None and route.plan.needs_body:
            # The response body must be readable to rewrite it or count its tokens.
            sets.append(("accept-encoding", "identity"))
        limits = st.snap.config.envoy
        count, size = st.header_count, st.header_bytes
        for k, v in sets:
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
        return pb.CommonResponse(header_mutation=header_mutation(sets, route.remove_headers), clear_route_cache=True)

    def _refuse(self, reply: Reply) -> pb.ProcessingResponse:
        metrics.DECISIONS.labels(str(reply.status)).inc()
        if reply.reserved_by is not None:
            metrics.RESERVED_REFUSALS.labels(reply.reserved_by).inc()
        return immediate(reply)

    # ----------------------------------------------------------------- response

    def _response_headers(self, st: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        h = _headers(msg)
        try:
            st.status = int(h.get(":status", "0"))
        except ValueError:
            st.status = 0
        if st.route is not None and (st.status >= 500 or st.status == 0):
            self.runtime.report_response(st.route.backend.name, st.status or None)
        plan = st.route.plan if st.route is not None else None
        if plan is None:
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        if plan.experiment is not None and plan.counted:
            st.counted = True
            metrics.EXPERIMENT_REQUESTS.labels(
                plan.experiment, plan.variant, metrics.status_class(st.status), plan.assignment
            ).inc()
            metrics.EXPERIMENT_DURATION.labels(plan.experiment, plan.variant).observe(time.monotonic() - st.start)
        common = pb.CommonResponse(header_mutation=header_mutation(plan.headers))
        resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))
        encoding = h.get("content-encoding", "identity").lower()
        if not (plan.needs_body and 200 <= st.status < 300 and encoding == "identity" and not msg.end_of_stream):
            return resp
        ctype = h.get("content-type", "").lower()
        if ctype.startswith("text/event-stream"):
            st.rewriter = SSERewriter(plan.rewrite_model, plan.family, strip_injected_usage=plan.strip_injected_usage)
        elif "json" not in ctype:
            return resp
        length = h.get("content-length")
        if length is None:
            # Chunked: stream it; JSON is held in the sidecar until its end.
            if st.rewriter is None:
                st.buffer = bytearray()
            resp.mode_override.CopyFrom(_MODE_RESPONSE_STREAMED)
        elif length.isdigit() and int(length) <= MAX_JSON_REWRITE:
            # A declared length must stay true: Envoy holds the headers until the
            # whole body is processed, and the new length is set with it.
            st.buffered = True
            resp.mode_override.CopyFrom(_MODE_RESPONSE_BUFFERED)
        else:
            st.rewriter = None
        return resp

    def _response_body(self, st: _Stream, msg: pb.HttpBody) -> pb.ProcessingResponse:
        plan = st.route.plan
        out: bytes | None = None
        if st.buffered:
            # The whole body, headers still held (BUFFERED).
            if st.rewriter is not None:
                out = st.rewriter.feed(msg.body) + st.rewriter.finish()
                usage = st.rewriter.usage
            else:
                out, usage = rewrite_json_body(msg.body, plan.rewrite_model, plan.family)
            self._count_usage(plan, usage)
        elif st.rewriter is not None:
            out = st.rewriter.feed(msg.body)
            if msg.end_of_stream:
                out += st.rewriter.finish()
                self._count_usage(plan, st.rewriter.usage)
        elif st.buffer is not None:
            st.buffer += msg.body
            if len(st.buffer) > MAX_JSON_REWRITE:
                # Too large to rewrite: release what was held and pass the rest through.
                out = bytes(st.buffer)
                st.buffer = None
            elif msg.end_of_stream:
                out, usage = rewrite_json_body(bytes(st.buffer), plan.rewrite_model, plan.family)
                st.buffer = None
                self._count_usage(plan, usage)
            else:
                out = b""
        if out is None or out == msg.body:
            return pb.ProcessingResponse(response_body=pb.BodyResponse())
        common = pb.CommonResponse()
        if out:
            common.body_mutation.body = out
        else:
            common.body_mutation.clear_body = True
        if st.buffered:
            common.header_mutation.CopyFrom(header_mutation((("content-length", str(len(out))),)))
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))

    @staticmethod
    def _count_usage(plan, usage) -> None:
        if plan is None or plan.experiment is None or not plan.read_usage or not usage.seen:
            return
        if usage.prompt_tokens:
            metrics.EXPERIMENT_TOKENS.labels(plan.experiment, plan.variant, "prompt").inc(usage.prompt_tokens)
        if usage.completion_tokens:
            metrics.EXPERIMENT_TOKENS.labels(plan.experiment, plan.variant, "completion").inc(usage.completion_tokens)

"""The response side: rewriting an answer whose body must change.

Only requests whose decision says so reach this code: the decision sets
``x-model-router-response: rewrite``, the route that header selects enables a
second ext_proc filter that runs among the router's upstream filters, and
that filter opens its own gRPC stream starting at the response headers. The
stream carries the decision in its metadata context, so nothing is kept
between the request stream and this one.

Token usage is read by Envoy's ``json_to_metadata`` / ``sse_to_metadata``
filters downstream of this one. This stream publishes the usage it saw in
the same metadata namespace too, for what those filters cannot read: the
usage chunk it removed, and payloads strict JSON refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .. import errors
from ..contract import NAMESPACE as NAMESPACE
from ..contract import RESPONSE_HEADER as RESPONSE_HEADER
from ..contract import USAGE_NAMESPACE as USAGE_NAMESPACE
from ..decision import Decision
from ..payload.rewrite import MAX_JSON_REWRITE, Usage, rewrite_json_body
from ..payload.sse import SSERewriter
from ..stores.cache import Entry, storable


def _mode(response_body: int, trailers: int = pm.ProcessingMode.SKIP) -> pm.ProcessingMode:
    P = pm.ProcessingMode
    return P(
        request_header_mode=P.SKIP, request_body_mode=P.NONE, response_header_mode=P.SEND,
        response_body_mode=response_body, request_trailer_mode=P.SKIP, response_trailer_mode=trailers,
    )


_BUFFERED = _mode(pm.ProcessingMode.BUFFERED)  # a body of declared length: its new length goes with it
_STREAMED = _mode(pm.ProcessingMode.STREAMED)
# An event stream: the sidecar may also send body of its own, unasked, and end
# the stream with it (a well-formed error event before Envoy's idle timer
# would reset it). Envoy requires the trailers with this body mode.
_DUPLEX = _mode(pm.ProcessingMode.FULL_DUPLEX_STREAMED, pm.ProcessingMode.SEND)


def silence_limit(idle_timeout_s: float) -> float:
    """How long an event stream may stay silent before the sidecar ends it: a
    little less than Envoy's idle timeout, which would reset it instead."""
    return idle_timeout_s - min(1.0, idle_timeout_s / 4)


@dataclass(frozen=True, slots=True)
class Store:
    """Where the decision asked the answer to be kept (the response cache)."""

    key: str
    ttl_s: int
    max_bytes: int
    experiment: str  # empty outside experiments
    variant: str


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What the decision asked the response processor to do."""

    model: str | None  # the top-level model to write, None: leave it
    family: str
    strip_usage: bool  # remove the usage the router injected into a stream
    store: Store | None = None  # keep the backend's answer in the response cache
    id_tag: str | None = None  # the owner to seal into Responses API ids (sidecar.payload.response_ids)
    tagger: Callable[[str], str] | None = None  # the engine's id -> the client's, from id_tag and the router's key
    not_found: str | None = None  # a follow-up's id: the engine's 404 is answered as the router's
    background: bool = False  # a background create: publish its engine's id (budgets settle it on retrieve)


def rewrite_of(metadata_context: Any) -> Rewrite | None:
    """The rewrite the request's decision published, or None when it asked for none."""
    ns = metadata_context.filter_metadata.get(NAMESPACE)
    if ns is None:
        return None
    d = Decision.decode(ns)
    model = d.rewrite_model or ""
    strip = d.strip_usage or False
    family = d.family if d.family is not None else "openai"
    tag = d.id_tag or ""
    not_found = d.not_found or ""
    store = _store_of(d)
    if not model and not strip and store is None and not tag and not not_found:
        return None
    return Rewrite(model or None, family if family in ("openai", "anthropic") else "openai", strip, store=store,
                   id_tag=tag or None, not_found=not_found or None, background=d.background or False)


def _store_of(d: Decision) -> Store | None:
    if d.cache_key is None or d.cache_ttl_s is None or d.cache_max_bytes is None:
        return None
    return Store(d.cache_key, d.cache_ttl_s, d.cache_max_bytes, d.experiment or "", d.variant or "")


def response_id_of(body: bytes) -> str | None:
    """The top-level ``id`` of a Responses API object as the engine sent it, or None."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = data.get("id") if isinstance(data, dict) and data.get("object") == "response" else None
    return found if isinstance(found, str) and 0 < len(found) <= 256 else None


def usage_metadata(usage: Usage) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({USAGE_NAMESPACE: {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}})
    return md


def header_map(msg: pb.HttpHeaders) -> dict[str, str]:
    """An ext_proc headers message as a dict (Envoy sends values in ``raw_value``)."""
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in msg.headers.headers}


class ResponseStream:
    """One response being rewritten: JSON bodies whole, SSE event by event."""

    __slots__ = ("plan", "rewriter", "buffer", "buffered", "duplex", "published", "finished", "keeping", "kept",
                 "events")

    def __init__(self, plan: Rewrite) -> None:
        self.plan = plan
        self.duplex = False  # an event stream, whose body the sidecar sends back as its own
        self.keeping: tuple[int, str, bytearray] | None = None  # status, content type, the backend's bytes so far
        self.kept: Entry | None = None  # the whole answer, for the cache, once the stream is done
        self.rewriter: SSERewriter | None = None
        self.buffer: bytearray | None = None  # chunked JSON, held to its end
        self.buffered = False  # Envoy holds the headers and sends the whole body once
        self.published: tuple[int, int] | None = None  # the usage last put in metadata
        self.finished = False  # nothing more to change: the stream can end
        self.events = 0  # data lines of an event stream passed on so far (about one token each)

    def headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        h = header_map(msg)
        status = h.get(":status", "0")
        encoding = h.get("content-encoding", "identity").lower()
        self.finished = True
        if not status.startswith("2") or encoding != "identity" or msg.end_of_stream:
            return resp
        length = h.get("content-length")
        store = self.plan.store
        if store is not None and storable(h) and not (length is not None and (not length.isdigit() or int(length) > store.max_bytes)):
            self.keeping = (int(status), h.get("content-type", "application/json"), bytearray())
        elif self.plan.model is None and not self.plan.strip_usage and self.plan.id_tag is None:
            return resp  # nothing to change and nothing to keep
        ctype = h.get("content-type", "").lower()
        if ctype.startswith("text/event-stream"):
            self.rewriter = SSERewriter(self.plan.model, self.plan.family, strip_injected_usage=self.plan.strip_usage,
                                        id_tag=self.plan.tagger)
        elif "json" not in ctype:
            return resp
        if length is None and self.rewriter is not None:
            self.duplex = True
            resp.mode_override.CopyFrom(_DUPLEX)
        elif length is None:
            self.buffer = bytearray()
            resp.mode_override.CopyFrom(_STREAMED)
        elif length.isdigit() and int(length) <= MAX_JSON_REWRITE:
            # Envoy ignores a removed content-length in STREAMED mode and answers a
            # changed body with a 503; BUFFERED takes the new length with the body.
            self.buffered = True
            resp.mode_override.CopyFrom(_BUFFERED)
        else:
            self.rewriter = None
            return resp
        self.finished = False
        return resp

    def body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        self.finished = msg.end_of_stream or self.buffered
        if self.keeping is not None:
            self._keep(msg.body)
        out, usage = self._rewrite(msg)
        resp = pb.ProcessingResponse(response_body=pb.BodyResponse())
        if usage is not None and usage.seen:
            # Envoy's usage filters miss what this stream strips and what strict
            # JSON refuses (NaN logprobs); they overwrite it with the same figures
            # where they do read it. Published with the chunk that carried it, not
            # at the end: a client that has read [DONE] may close before the
            # stream's last message.
            now = (usage.prompt_tokens, usage.completion_tokens)
            if now != self.published:
                self.published = now
                resp.dynamic_metadata.CopyFrom(usage_metadata(usage))
        if self.plan.background and self.buffered:
            engine_id = response_id_of(msg.body)
            if engine_id is not None:
                # Beside the usage this answer may also publish, in the same namespace;
                # not `response_id`, which Envoy's JSON filter fills with the id the client got.
                resp.dynamic_metadata.fields[USAGE_NAMESPACE].struct_value.update({"engine_response_id": engine_id})
        if self.duplex:
            self.events += msg.body.count(b"data:")
            # Envoy sends on only what comes back, changed or not.
            streamed = resp.response_body.response.body_mutation.streamed_response
            streamed.body = msg.body if out is None else out
            streamed.end_of_stream = msg.end_of_stream
            return resp
        if out is None or out == msg.body:
            return resp
        common = resp.response_body.response
        if out:
            common.body_mutation.body = out
        else:
            common.body_mutation.clear_body = True
        if self.buffered:
            opt = common.header_mutation.set_headers.add()
            opt.header.key = "content-length"
            opt.header.raw_value = str(len(out)).encode()
        return resp

    def trailers(self) -> list[pb.ProcessingResponse]:
        """The response's trailers (asked for with an event stream): its end,
        after what the rewriter still held."""
        self.finished = True
        out = []
        rest = self.rewriter.finish() if self.rewriter is not None else b""
        if rest and self.duplex:
            resp = pb.ProcessingResponse(response_body=pb.BodyResponse())
            resp.response_body.response.body_mutation.streamed_response.body = rest
            out.append(resp)
        out.append(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))
        return out

    @property
    def watching(self) -> bool:
        """Whether the sidecar may still end this stream itself."""
        return self.duplex and not self.finished

    def cut(self, idle_s: float) -> list[pb.ProcessingResponse]:
        """End a silent event stream: an error event in its family's shape,
        then a reset of the upstream request (and of the client's stream),
        before Envoy's idle timer resets it (the client would get no error,
        only a broken connection). An event held back incomplete is dropped:
        it would not parse."""
        self.finished = True
        # Held bytes never left; an oversized event forwarded in part needs its end.
        partial = self.rewriter is not None and self.rewriter.mid_event
        held = self.rewriter.take_held() if self.rewriter is not None else b""  # a complete chunk: it goes first
        event = errors.stream_error_event(
            "gateway_timeout", f"The upstream sent nothing for {idle_s:g} seconds; the router ended the stream.",
            self.plan.family,
        )
        resp = pb.ProcessingResponse(response_body=pb.BodyResponse())
        streamed = resp.response_body.response.body_mutation.streamed_response
        streamed.body = held + (b"\n\n" if partial else b"") + event
        # Not the end of the stream: an end sent from this (upstream) filter
        # leaves Envoy's upstream request running. The immediate response
        # that follows resets the upstream request, and the client's stream
        # after the event it already has.
        # What was streamed measures the completion better than the request's cap.
        resp.dynamic_metadata.update({USAGE_NAMESPACE: {"cut": "idle", "streamed": self.events}})
        reset = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.GatewayTimeout), details="model_router_stream_cut",
        ))
        return [resp, reset]

    def _keep(self, chunk: bytes) -> None:
        """Hold the backend's bytes (before any rename) up to the entry limit."""
        assert self.keeping is not None and self.plan.store is not None
        status, ctype, held = self.keeping
        held += chunk
        if len(held) > self.plan.store.max_bytes:
            self.keeping = None
        elif self.finished:
            self.kept = Entry(status, ctype, bytes(held))
            self.keeping = None

    def _rewrite(self, msg: pb.HttpBody) -> tuple[bytes | None, Usage | None]:
        """The bytes to send for this chunk (None: unchanged) and, at the end, the usage seen."""
        model, family, tag = self.plan.model, self.plan.family, self.plan.tagger
        if self.buffered:
            if self.rewriter is not None:
                out = self.rewriter.feed(msg.body) + self.rewriter.finish()
                return out, self.rewriter.usage
            return rewrite_json_body(msg.body, model, family, tag)
        if self.rewriter is not None:
            out = self.rewriter.feed(msg.body)
            if msg.end_of_stream:
                out += self.rewriter.finish()
            return out, self.rewriter.usage
        if self.buffer is not None:
            self.buffer += msg.body
            if len(self.buffer) > MAX_JSON_REWRITE:
                # Too large to rewrite: release what was held and pass the rest through.
                out = bytes(self.buffer)
                self.buffer = None
                return out, None
            if msg.end_of_stream:
                out, usage = rewrite_json_body(bytes(self.buffer), model, family, tag)
                self.buffer = None
                return out, usage
            return b"", None
        return None, None

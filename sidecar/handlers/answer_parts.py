"""The parts of an ext_proc answer that repeat across requests, encoded once.

A routed request's answer carries the decision as a protobuf ``Struct`` and a
header mutation. Most of both is the same for every request that takes the
same arm to the same backend: only a few values (the request id, the key id,
the sticky caller's hash, the body's new length) belong to one request.
Building a ``Struct`` field by field runs in Python and is the costliest part
of an answer, so each shape of answer is built once and copied (in C); the
per-request values are set on the copy.

The table is keyed by the values themselves, not by the config: a skeleton is
a pure function of them. It is bounded (values a client can influence, such
as a passthrough model name, could otherwise grow it without end).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .. import decision
from ..contract import NAMESPACE
from ..decision import EMPTY, X_RL_LIMIT, X_RL_UNIT, Decision
from ..errors import Reply

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
LIMIT = 4096  # shapes kept per table before starting over

# Decision fields whose values are (nearly) unique to one request
# (``decision.PER_REQUEST``): set on a copy of the shape's skeleton.
PER_REQUEST = decision.PER_REQUEST


def header_mutation(set_headers: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()) -> pb.HeaderMutation:
    m = pb.HeaderMutation()
    add_headers(m, set_headers)
    m.remove_headers.extend(remove)
    return m


def add_headers(m: pb.HeaderMutation, set_headers: Iterable[tuple[str, str]]) -> None:
    """Append headers that overwrite (or add) the request's."""
    for k, v in set_headers:
        opt = m.set_headers.add()
        opt.header.key = k
        opt.header.raw_value = v.encode("utf-8")
        opt.append_action = _OVERWRITE


class AnswerParts:
    """The encoded shapes one processor has answered with: a routed answer is
    copied from its shape's skeleton (one protobuf copy, in C) and only the
    request's own values are set on it."""

    def __init__(self) -> None:
        self._known: dict[Any, pb.ProcessingResponse] = {}

    def routed(self, phase: str, mode: Any, namespace: str, md: dict[str, Any], shared: tuple[tuple[str, str], ...],
               remove: tuple[str, ...], own: Sequence[tuple[str, str]], body: bytes | None) -> pb.ProcessingResponse:
        """The answer that sends a request on at ``phase`` ("headers" with
        ``mode`` as its mode override, or "body"): the header mutation (``shared``
        and ``remove``, then the request's ``own`` headers), the new ``body`` and
        ``{namespace: md}`` as dynamic metadata. Takes the per-request fields out of ``md``."""
        mine = [(k, md.pop(k)) for k in PER_REQUEST.intersection(md)]
        # The request's own headers' names are part of the shape: the skeleton
        # holds them, and only their values are set on the copy.
        key = (phase, tuple(md.items()), shared, remove, tuple([k for k, _ in own]))
        skeleton = self._known.get(key)
        if skeleton is None:
            if len(self._known) >= LIMIT:
                self._known.clear()
            skeleton = self._known[key] = _skeleton(phase, mode, namespace, md, (*shared, *own), remove)
        resp = pb.ProcessingResponse()
        resp.CopyFrom(skeleton)
        common = resp.request_headers.response if phase == "headers" else resp.request_body.response
        if own:
            sets = common.header_mutation.set_headers
            at = len(shared)
            for _, v in own:
                sets[at].header.raw_value = v.encode("utf-8")
                at += 1
        if body is not None:
            common.body_mutation.body = body
        if mine:
            inner = resp.dynamic_metadata.fields[namespace].struct_value
            fields = inner.fields
            for k, v in mine:
                # As Struct.update sets them, without its Python-level dispatch for the usual kinds.
                if isinstance(v, str):
                    fields[k].string_value = v
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    fields[k].number_value = v
                else:
                    inner.update({k: v})
        return resp


def _skeleton(phase: str, mode: Any, namespace: str, md: Mapping[str, Any], shared: tuple[tuple[str, str], ...],
              remove: tuple[str, ...]) -> pb.ProcessingResponse:
    common = pb.CommonResponse(header_mutation=header_mutation(shared, remove), clear_route_cache=True)
    if phase == "headers":
        resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), mode_override=mode)
    else:
        resp = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    # The shape names these keys, so a reader of many such answers reads them once.
    resp.dynamic_metadata.update({namespace: {**md, decision.SHAPE: decision.shape_of(md)}})
    return resp


NOTHING_MORE = pm.ProcessingMode(
    request_header_mode=pm.ProcessingMode.SEND, request_body_mode=pm.ProcessingMode.NONE,
    response_header_mode=pm.ProcessingMode.SKIP, response_body_mode=pm.ProcessingMode.NONE,
    request_trailer_mode=pm.ProcessingMode.SKIP, response_trailer_mode=pm.ProcessingMode.SKIP,
)
"""The mode of an answer after which the stream needs nothing more from Envoy."""


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
        dynamic_metadata=_struct({NAMESPACE: decision.unshaped(md)}),
    )
    if usage is not None:
        resp.dynamic_metadata.MergeFrom(usage)
    return resp

"""The ext_proc stream of a shadow copy (see :mod:`sidecar.routing.shadow`).

The shadow cluster's upstream filter opens it for every copy Envoy's mirror
policy sends there. At the request headers the copy loses the router's
headers and gets the shadow backend's credentials; at the buffered body its
``model`` becomes the shadow arm's. The response then streams through here
(nobody waits on it): its status, the time to its headers and first body
bytes and its token usage become the shadow arm's metrics and a usage record
marked ``shadow: true``. A copy that never gets a response (the backend is
down or the circuit breaker is full) is counted as a server error when the
stream ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from .. import metrics
from ..config.schema import Config
from ..contract import SHADOW_HEADER
from ..payload.rewrite import Usage, rewrite_json_body
from ..payload.sse import SSERewriter
from ..routing.ingress import family_for
from ..routing.route import upstream_auth
from ..routing.shadow import Target, target_of
from ..routing.snapshot import BACKEND_HEADER, Snapshot
from .response_stream import header_map

log = logging.getLogger("model_router.shadow_stream")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_MAX_JSON = 4 * 1024 * 1024  # a JSON answer past this is not read for usage
_P = pm.ProcessingMode
# Nothing more from a copy whose arm is gone: it goes on as it is.
_NOTHING_MORE = _P(
    request_header_mode=_P.SEND, request_body_mode=_P.NONE, response_header_mode=_P.SKIP,
    response_body_mode=_P.NONE, request_trailer_mode=_P.SKIP, response_trailer_mode=_P.SKIP,
)


def is_shadow(headers: Mapping[str, str]) -> bool:
    """Whether a stream's request headers (read as ``header_map`` reads them)
    are a shadow copy's: only copies reach the sidecar with the shadow header
    still on (Envoy strips it from clients)."""
    return SHADOW_HEADER in headers


def status_class(status: int | None) -> str:
    if status is not None and 200 <= status < 400:
        return "success"
    if status is not None and 400 <= status < 500:
        return "client_error"
    return "server_error"


class ShadowStream:
    __slots__ = ("snap", "target", "write", "start", "wall", "request_id", "family", "status", "headers_s",
                 "first_s", "sse", "json", "done")

    def __init__(self, snap: Snapshot, first: pb.ProcessingRequest,
                 write: Callable[[list[dict[str, Any]]], None] | None) -> None:
        self.snap = snap
        self.write = write
        self.start = time.monotonic()
        self.wall = time.time()
        h = header_map(first.request_headers)
        self.target: Target | None = target_of(snap.config, h.get(SHADOW_HEADER, ""))
        self.request_id = h.get("x-request-id")
        self.family = family_for(h.get(":path", "/"))
        self.status: int | None = None
        self.headers_s: float | None = None
        self.first_s: float | None = None
        self.sse: SSERewriter | None = None
        self.json: bytearray | None = None
        self.done = False

    def headers(self) -> pb.ProcessingResponse:
        target = self.target
        if target is None:
            # The arm left the config since the decision: nothing to copy to.
            self.done = True
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=_NOTHING_MORE)
        sets, removes = upstream_auth(self.snap, self.snap.backends[target.backend])
        m = pb.HeaderMutation(remove_headers=[SHADOW_HEADER, BACKEND_HEADER, *removes])
        sets = (("accept-encoding", "identity"), *sets)  # the answer is read for its usage
        for k, v in sets:
            m.set_headers.add(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE)
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=m)))

    def body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        """The copy's body with the shadow arm's model."""
        assert self.target is not None
        try:
            data = orjson.loads(msg.body)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            # Never send the live model to the candidate: the copy ends here, uncounted
            # (it shows as a copy that never reached the arm).
            self.done = True
            return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=400), details="model_router_shadow_not_json"))
        data["model"] = self.target.arm.model
        body = orjson.dumps(data)
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode()),
            append_action=_OVERWRITE)]))
        common.body_mutation.body = body
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))

    def response_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        h = header_map(msg)
        status = h.get(":status", "")
        self.status = int(status) if status.isdigit() else None
        self.headers_s = time.monotonic() - self.start
        if h.get("content-type", "").startswith("text/event-stream"):
            self.sse = SSERewriter(None, self.family)
        else:
            self.json = bytearray()
        if msg.end_of_stream:
            self.finish()
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    def response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        if self.first_s is None and msg.body:
            self.first_s = time.monotonic() - self.start
        if self.sse is not None:
            self.sse.feed(msg.body)
        elif self.json is not None and len(self.json) + len(msg.body) <= _MAX_JSON:
            self.json += msg.body
        if msg.end_of_stream:
            self.finish()
        return pb.ProcessingResponse(response_body=pb.BodyResponse())

    def finish(self) -> None:
        """Count the copy once: at its response's end, or when the stream ends without one."""
        if self.done or self.target is None:
            return
        self.done = True
        usage = Usage()
        if self.sse is not None:
            self.sse.finish()
            usage = self.sse.usage
        elif self.json:
            usage = rewrite_json_body(bytes(self.json), None, self.family)[1]
        t = self.target
        exp, arm = t.experiment, t.arm.id
        metrics.SHADOW_REQUESTS.labels(exp, arm, status_class(self.status)).inc()
        if self.headers_s is not None:
            metrics.SHADOW_DURATION.labels(exp, arm).observe(self.headers_s)
        if self.sse is not None and self.first_s is not None:
            metrics.SHADOW_TTFT.labels(exp, arm).observe(self.first_s)
        if usage.seen:
            metrics.SHADOW_TOKENS.labels(exp, arm, "prompt").inc(usage.prompt_tokens)
            metrics.SHADOW_TOKENS.labels(exp, arm, "completion").inc(usage.completion_tokens)
        if self.write is not None:
            try:
                self.write([self.record(self.snap.config, usage)])
            except OSError as exc:
                metrics.USAGE_RECORDS_DROPPED.inc()
                log.error("a shadow usage record could not be written: %s", exc)

    def record(self, config: Config, usage: Usage) -> dict[str, Any]:
        t = self.target
        assert t is not None
        total = time.monotonic() - self.start
        return {
            "request_id": self.request_id,
            "time": datetime.fromtimestamp(self.wall, UTC).isoformat(timespec="milliseconds"),
            "kind": "shadow",
            "shadow": True,
            "upstream_model": t.arm.model,
            "backend": t.backend,
            "experiment_id": t.experiment,
            "experiment_variant_id": t.arm.id,
            "status": self.status or 0,
            "duration_to_headers_ms": round(self.headers_s * 1000, 3) if self.headers_s is not None else None,
            "duration_ms": round(total * 1000, 3),
            "time_to_first_token_ms": round(self.first_s * 1000, 3) if self.sse and self.first_s else None,
            "prompt_tokens": usage.prompt_tokens if usage.seen else None,
            "completion_tokens": usage.completion_tokens if usage.seen else None,
        }

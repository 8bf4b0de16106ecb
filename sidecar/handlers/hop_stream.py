"""The ext_proc stream of a fallback attempt.

A composite cluster's upstream filter chain (``sidecar/deploy/envoy_fallback.py``)
starts with an ext_proc filter that Envoy skips on a request's first attempt
(a matcher on ``x-envoy-attempt-count``) and that forwards the decision's
metadata; only an attempt after a failed one opens this stream. Two messages:
the request headers (the attempt count is read there), then the buffered
body, answered with the hop's body, path and credentials and the fallback's
metadata (:mod:`sidecar.routing.retarget`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from .. import metrics
from ..contract import ATTEMPT_HEADER as ATTEMPT_HEADER
from ..decision import Decision, unshaped
from ..routing.retarget import retarget
from ..routing.snapshot import Snapshot
from .response_stream import NAMESPACE, header_map

log = logging.getLogger("model_router.hop_stream")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def is_hop(msg: pb.ProcessingRequest) -> bool:
    """Whether a stream's first message comes from the fallback filter: only
    that filter forwards the decision's metadata at the request headers."""
    return NAMESPACE in msg.metadata_context.filter_metadata


class HopStream:
    __slots__ = ("snap", "attempt", "decision", "report_failure")

    def __init__(
        self, snap: Snapshot, first: pb.ProcessingRequest, report_failure: Callable[[str, int | None], None],
    ) -> None:
        self.snap = snap
        self.report_failure = report_failure
        value = header_map(first.request_headers).get(ATTEMPT_HEADER, "")
        self.attempt = int(value) if value.isdigit() else 0
        self.decision = Decision.decode(first.metadata_context.filter_metadata[NAMESPACE])

    def headers(self) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())

    def body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        try:
            hop = retarget(self.snap, self.decision, self.attempt, msg.body)
        except Exception:
            log.exception("fallback attempt %d could not be retargeted", self.attempt)
            hop = None
        if hop is None:
            metrics.STREAM_ERRORS.inc()
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        # The access log sees the last attempt only: the failed one's backend
        # is held out here, as a reset would hold it out (its status is unknown).
        previous = self.decision.backend
        if previous:
            self.report_failure(previous, None)
        common = pb.CommonResponse(
            header_mutation=_mutation(((":path", hop.path), *hop.set_headers), hop.remove_headers),
        )
        common.body_mutation.body = hop.body
        md = struct_pb2.Struct()
        md.update({NAMESPACE: unshaped(hop.decision)})
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=md)


def _mutation(sets: Iterable[tuple[str, str]], removes: Iterable[str]) -> pb.HeaderMutation:
    m = pb.HeaderMutation(remove_headers=list(removes))
    for k, v in sets:
        m.set_headers.add(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE)
    return m


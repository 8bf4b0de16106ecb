"""Answers copied from a per-shape skeleton are the answers built field by field."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format

from sidecar import decision as codec
from sidecar.handlers import answer_parts
from sidecar.handlers.answer_parts import AnswerParts

MODE = pm.ProcessingMode(request_header_mode=pm.ProcessingMode.SEND, request_body_mode=pm.ProcessingMode.NONE)
SHARED = (("x-model-router-backend", "pool-a"), ("accept-encoding", "identity"))
REMOVE = ("authorization", "x-api-key")


def decision(rid: str, caller: str) -> dict:
    return {"kind": "routed", "family": "openai", "experiment": "chat-ab", "variant": "control",
            "caller": caller, "strip_usage": False, "backend": "pool-a", "request_id": rid, "key_id": "team-1"}


def by_hand(phase: str, md: dict, own: list[tuple[str, str]], body: bytes | None) -> pb.ProcessingResponse:
    common = pb.CommonResponse(header_mutation=answer_parts.header_mutation((*SHARED, *own), REMOVE),
                               clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    if phase == "headers":
        resp = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), mode_override=MODE)
    else:
        resp = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    shape = codec.shape_of({k: v for k, v in md.items() if k not in codec.PER_REQUEST})
    resp.dynamic_metadata.update({"model_router": {**md, "shape": shape}})
    return resp


def as_dict(resp: pb.ProcessingResponse) -> dict:
    return json_format.MessageToDict(resp)


def test_copies_match_answers_built_by_hand_and_keep_their_own_values() -> None:
    parts = AnswerParts()
    answers = []
    for phase in ("body", "headers"):
        for rid, caller, length in (("r-1", "aa11", "61"), ("r-2", "bb22", "75")):
            own = [("content-length", length)]
            body = b"x" * int(length)
            got = parts.routed(phase, MODE, "model_router", decision(rid, caller), SHARED, REMOVE, own, body)
            assert as_dict(got) == as_dict(by_hand(phase, decision(rid, caller), own, body))
            answers.append((got, rid, caller, phase))
    # A later copy of the same shape changed nothing in an earlier answer.
    for got, rid, caller, phase in answers:
        md = got.dynamic_metadata.fields["model_router"].struct_value.fields
        assert (md["request_id"].string_value, md["caller"].string_value) == (rid, caller)
        common = got.request_body.response if phase == "body" else got.request_headers.response
        assert [h.header.key for h in common.header_mutation.set_headers][-1] == "content-length"
        assert all(h.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
                   for h in common.header_mutation.set_headers)


def test_the_table_stays_bounded(monkeypatch) -> None:
    monkeypatch.setattr(answer_parts, "LIMIT", 8)
    parts = AnswerParts()
    for i in range(50):  # a value a client could vary on every request (a passthrough model name)
        md = {"kind": "passthrough", "client_model": f"m-{i}", "backend": "pool-a"}
        got = parts.routed("body", MODE, "model_router", md, SHARED, REMOVE, [], None)
        assert got.dynamic_metadata.fields["model_router"].struct_value.fields["client_model"].string_value == f"m-{i}"
    assert len(parts._known) <= 8


def test_every_kind_of_value_and_length_is_encoded_as_protobuf_would() -> None:
    parts = AnswerParts()
    long = "é" * 200  # lengths past one varint byte, in UTF-8
    shapes = [
        {"kind": "routed", "backend": "pool-a", "request_id": long, "key_id": "", "caller": "ünï"},
        {"kind": "routed", "estimate": 1234, "reserved": 0.5, "x_explain": True, "cache_key": False,
         "not_found": None, "response_id": {"a": [1, "b", None]}, "span_id": 2**40, "x_request_id": -3},
        {"kind": "passthrough", "client_model": long},
    ]
    for phase in ("body", "headers"):
        for md in shapes:
            for own, body in (([], None), ([("content-length", "0")], b""), ([(":path", "/" + long)], b"x" * 70000),
                              ([("traceparent", "00-ab-cd-01"), ("content-length", "5")], b"hello")):
                got = parts.routed(phase, MODE, "model_router", dict(md), SHARED, REMOVE, own, body)
                want = by_hand(phase, dict(md), own, body)
                assert got == want
                assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)

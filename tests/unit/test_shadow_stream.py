"""The sidecar's side of a shadow copy, message by message (no Envoy: the
integration test is tests/test_shadow.py)."""

from __future__ import annotations

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.config.schema import parse
from sidecar.contract import SHADOW_HEADER
from sidecar.handlers.request_stream import RequestState
from sidecar.handlers.response_stream import header_map
from sidecar.handlers.shadow_stream import ShadowStream, is_shadow
from sidecar.routing import snapshot

CONFIG = """
backends:
  - {name: live, url: "http://127.0.0.1:9000", models: [m-live]}
  - {name: cand, url: "https://cand.example.com", models: [m-cand], api_key: sk-cand}
model_experiments:
  - name: e
    model: chat
    variants: [{id: control, model: m-live, weight: 1}, {id: next, model: m-cand, shadow: {share: 0.5}}]
"""


def headers(**extra: str) -> pb.ProcessingRequest:
    h = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "r1", **extra}
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    for k, v in h.items():
        msg.request_headers.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return msg


def stream(written: list) -> ShadowStream:
    snap = snapshot.build(parse(CONFIG, env={}).config)
    return ShadowStream(snap, headers(**{SHADOW_HEADER: "shadow~e"}), written.extend)


def test_only_a_copy_carries_the_shadow_header():
    assert is_shadow(header_map(headers(**{SHADOW_HEADER: "shadow~e"}).request_headers))
    assert not is_shadow(header_map(headers().request_headers))
    copy = headers(**{SHADOW_HEADER: "shadow~e"}).request_headers
    st = RequestState()
    assert is_shadow(st.read(copy)) and st.headers[SHADOW_HEADER] == "shadow~e"  # the one read the stream makes
    assert not is_shadow(RequestState().read(headers().request_headers))


def test_the_copy_gets_the_arms_model_and_backend_credentials_and_loses_the_router_headers():
    s = stream([])
    m = s.headers().request_headers.response.header_mutation
    assert {SHADOW_HEADER, "x-model-router-backend", "x-api-key"} <= set(m.remove_headers)
    sets = {h.header.key: h.header.raw_value.decode() for h in m.set_headers}
    assert sets["authorization"] == "Bearer sk-cand" and sets["accept-encoding"] == "identity"
    body = s.body(pb.HttpBody(body=b'{"model": "m-live", "messages": [], "stream": false}', end_of_stream=True))
    common = body.request_body.response
    assert orjson.loads(common.body_mutation.body) == {"model": "m-cand", "messages": [], "stream": False}
    length = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}["content-length"]
    assert int(length) == len(common.body_mutation.body)


def test_a_body_that_is_not_a_json_object_is_never_sent_with_the_live_model():
    written: list = []
    s = stream(written)
    s.headers()
    answer = s.body(pb.HttpBody(body=b"--boundary\r\n", end_of_stream=True))
    assert answer.WhichOneof("response") == "immediate_response"
    s.finish()
    assert s.done and written == []  # not counted as an answer of the arm


def test_a_finished_copy_writes_one_shadow_record():
    written: list = []
    s = stream(written)
    s.headers()
    s.body(pb.HttpBody(body=b'{"model": "m-live", "messages": []}', end_of_stream=True))
    status = pb.HttpHeaders(end_of_stream=False)
    for k, v in ((":status", "200"), ("content-type", "application/json")):
        status.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    s.response_headers(status)
    s.response_body(pb.HttpBody(body=b'{"model": "m-cand", "usage": {"prompt_tokens": 3, "completion_tokens": 7}}',
                                end_of_stream=True))
    s.finish()  # the call's end after the answer's: still one record
    (rec,) = written
    assert rec["shadow"] is True and rec["kind"] == "shadow"
    assert (rec["experiment_id"], rec["experiment_variant_id"], rec["upstream_model"], rec["backend"]) == (
        "e", "next", "m-cand", "cand")
    assert (rec["status"], rec["prompt_tokens"], rec["completion_tokens"], rec["request_id"]) == (200, 3, 7, "r1")

"""A routed answer names its shape, and a reader reads a shape's keys once:
what it decodes is always what reading the whole ``Struct`` gives, also after
Envoy merges later writes into the namespace."""

from __future__ import annotations

import asyncio

import orjson
from google.protobuf import struct_pb2

from sidecar import decision
from sidecar.config.schema import parse
from sidecar.contract import NAMESPACE
from sidecar.decision import KEYS, PER_REQUEST, SHAPE, Decision, Reader, encode, unshaped
from sidecar.handlers.answer_parts import NOTHING_MORE, AnswerParts
from sidecar.handlers.extproc import Processor
from sidecar.routing import snapshot

from .test_dispatch import Runtime, _messages, _stream


def _routed(i: int, **more: object) -> dict:
    """The wire metadata of request ``i`` of one arm (its own values vary)."""
    fields = {"kind": "routed", "family": "openai", "backend": "pool-a", "client_model": "chat",
              "upstream_model": "m-a", "experiment": "chat-ab", "variant": "control", "assignment": "sticky",
              "request_id": f"r-{i}", "key_id": f"team-{i % 3}", "caller": f"{i:016x}", "estimate": (i, 2 * i),
              **more}
    return encode(fields)  # type: ignore[arg-type]


def _sent(parts: AnswerParts, md: dict) -> struct_pb2.Struct:
    """The namespace as Envoy holds it after the routed answer."""
    answer = parts.routed("body", NOTHING_MORE, NAMESPACE, dict(md), (), (), [], None)
    return answer.dynamic_metadata.fields[NAMESPACE].struct_value


def _whole(struct: struct_pb2.Struct) -> Decision:
    """The decision read key by key, with no shape to go by."""
    plain = struct_pb2.Struct()
    plain.CopyFrom(struct)
    del plain.fields[SHAPE]
    return Reader(KEYS)(plain)


def test_each_request_of_a_shape_reads_as_its_own_decision(monkeypatch):
    parts, reader = AnswerParts(), Reader(KEYS)
    read_whole = []  # this reader's reads of a whole Struct
    whole = Reader._whole
    monkeypatch.setattr(Reader, "_whole", lambda self, f: (self is reader and read_whole.append(1)) or whole(self, f))
    for i in range(1, 40):
        explained = {"x_explain": "routed: a"} if i % 5 == 0 else {}
        sent = _sent(parts, _routed(i, **explained))
        got = reader(sent)
        assert got == _whole(sent) == Decision.decode(_routed(i, **explained))
        assert (got.request_id, got.caller, got.estimate, got.key_id) == (f"r-{i}", f"{i:016x}", (i, 2 * i),
                                                                          f"team-{i % 3}")
    # Every request took the same arm: one shape, read whole once.
    assert len(reader.shapes) == 1 and len(read_whole) == 1


def test_a_reader_of_some_keys_reads_only_those():
    parts, reader = AnswerParts(), Reader(("kind", "request_id", "backend"))
    for i in range(1, 4):
        got = reader(_sent(parts, _routed(i)))
        assert got == Decision(kind="routed", request_id=f"r-{i}", backend="pool-a")


def test_different_arms_are_different_shapes():
    parts, reader = AnswerParts(), Reader(KEYS)
    control, treatment = _sent(parts, _routed(1)), _sent(parts, _routed(2, variant="treatment"))
    assert control.fields[SHAPE].string_value != treatment.fields[SHAPE].string_value
    assert (reader(control).variant, reader(treatment).variant, reader(control).variant) == (
        "control", "treatment", "control")


def test_a_later_write_envoy_merges_in_is_read():
    parts, reader = AnswerParts(), Reader(KEYS)
    reader(_sent(parts, _routed(1)))  # the shape is known
    # A fallback hop's write: it overwrites keys the shape holds (and adds none).
    hop = _sent(parts, _routed(2))
    merged = Decision.decode(hop) | Decision(backend="pool-b", upstream_model="m-b")
    written = struct_pb2.Struct()
    written.update(unshaped(merged))
    hop.MergeFrom(written)  # as Envoy merges a namespace
    assert reader(hop) == merged
    # A write that leaves the shape in place but adds a key is read whole too.
    left = _sent(parts, _routed(3))
    extra = struct_pb2.Struct()
    extra.update({"fallback_reason": "upstream_error"})
    left.MergeFrom(extra)
    assert reader(left).fallback_reason == "upstream_error" and reader(left).request_id == "r-3"


def test_a_shape_cut_by_another_release_is_read_whole_and_not_kept():
    reader = Reader(KEYS)
    for i in range(1, 4):
        struct = struct_pb2.Struct()
        # Another release's PER_REQUEST set, tagged differently: the same shape, other values.
        struct.update({**encode({"kind": "routed", "backend": f"pool-{i}", "request_id": f"r-{i}"}),
                       SHAPE: "0123456789abcdef.zzzzzz"})
        assert reader(struct) == Decision(kind="routed", backend=f"pool-{i}", request_id=f"r-{i}")
    assert reader.shapes == {}


def test_the_shapes_a_reader_keeps_are_bounded(monkeypatch):
    monkeypatch.setattr(decision, "SHAPES", 8)
    parts, reader = AnswerParts(), Reader(KEYS)
    for i in range(50):  # a value a client can vary (a passthrough model name) makes a shape each
        sent = _sent(parts, _routed(i, client_model=f"m-{i}"))
        assert reader(sent).client_model == f"m-{i}"
        assert len(reader.shapes) <= 8


def test_a_shape_names_the_keys_that_are_not_the_requests_own():
    parts = AnswerParts()
    one, two = _sent(parts, _routed(1)), _sent(parts, _routed(2))
    assert one.fields[SHAPE].string_value == two.fields[SHAPE].string_value
    shared = {k: v for k, v in _routed(1).items() if k not in PER_REQUEST}
    assert one.fields[SHAPE].string_value == decision.shape_of(shared)


BUDGETED = """
proxy: {passthrough_backend: a}
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m]}
api_keys:
  - {key: sk-all, id: all}
limits:
  - {model: m, tokens: 100000, token_window: 60s}
"""


def test_requests_under_a_token_budget_share_their_shape():
    """The budget's remaining tokens and reset time change with every request:
    they are the request's own, not a new shape (and skeleton) each time."""
    processor = Processor(Runtime(snapshot.build(parse(BUDGETED, env={}).config)))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})

    async def metadata() -> struct_pb2.Struct:
        messages = _messages("POST", "/v1/chat/completions", {"authorization": "Bearer sk-all"}, body)
        answers = [a async for a in processor.Process(_stream(messages), None)]
        return answers[-1].dynamic_metadata.fields[NAMESPACE].struct_value

    sent = [asyncio.run(metadata()) for _ in range(3)]
    remaining = [s.fields["x_ratelimit_remaining_tokens"].string_value for s in sent]
    assert len(set(remaining)) == 3, remaining  # each request reserved tokens: the budget moved
    assert len({s.fields[SHAPE].string_value for s in sent}) == 1
    reader = Reader(KEYS)
    assert [reader(s).x_ratelimit_remaining_tokens for s in sent] == remaining
    assert len(reader.shapes) == 1

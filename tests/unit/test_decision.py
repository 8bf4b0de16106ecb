"""The decision codec (sidecar/decision.py): every field survives the wire,
an older or partial entry decodes, and every key a writer emits is one the
codec knows."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from sidecar import decision
from sidecar.accounting.budgets import Budgets
from sidecar.backends.monitor import BackendState
from sidecar.config.schema import parse
from sidecar.contract import NAMESPACE
from sidecar.decision import EMPTY, KEYS, Decision, Retry
from sidecar.deploy import envoy, envoy_limits, envoy_replies
from sidecar.errors import Reply
from sidecar.handlers.extproc import Processor
from sidecar.payload.response_ids import Owner, tag
from sidecar.routing import Request, Route, authenticate, decide, dispatch, snapshot
from sidecar.routing.ingress import lookup
from sidecar.routing.retarget import retarget
from sidecar.routing.snapshot import Snapshot

# One value of every field, in its typed form.
EVERY: decision.Fields = {
    "kind": "routed", "reply": "sidecar", "refusal": "model_not_found", "request_id": "r-1", "x_request_id": "r-1",
    "ingress": "/v1/chat/completions", "key_id": "team-a", "span_id": "00f067aa0ba902b7", "x_explain": "routed: a",
    "x_cache": "miss", "family": "openai", "backend": "a", "client_model": "chat", "upstream_model": "m-a",
    "retry": Retry((("b", "m-b"),), "m-a", (("m-b", "r1", "r2"),), "/v1/chat/completions", True).encode(),
    "auth_replaced": True, "estimate": (12, 1024), "background": True, "response_id": "resp_1",
    "experiment": "chat-ab", "variant": "control", "assignment": "sticky", "caller": "0a1b2c3d4e5f6071",
    "x_experiment": "chat-ab", "x_experiment_variant": "control", "suffix": "thinking", "suffix_applied": False,
    "x_model_variant": "thinking", "x_model_variant_applied": False, "fallback_from": "m-a", "fallback_to": "m-b",
    "fallback_reason": "upstream_error", "x_fallback_model": "m-b", "rewrite_model": "chat", "strip_usage": True,
    "id_tag": "a\0chat\x001\0team-a", "not_found": "resp_mr2x", "cache_key": "ab" * 32, "cache_ttl_s": 300,
    "cache_max_bytes": 1 << 20, "limit_model": "chat", "limit_refused": "tokens", "x_rl_unit": "s",
    "x_rl_limit": "8", "budgets": ("*/chat", "team-a/chat"), "reserved": (1036, 1_700_000_000.125),
    "x_ratelimit_limit_tokens": "1000", "x_ratelimit_remaining_tokens": "964", "x_ratelimit_reset_tokens": "59s",
    "feedback_for": "r-0", "feedback_name": "thumbs", "feedback_value": 0.5, "feedback_replaces": False,
    "feedback_revision": 2, "feedback_comment": "fine",
}


def _struct(wire: dict) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({NAMESPACE: wire})
    return md.fields[NAMESPACE].struct_value


def test_every_field_has_a_value_here_and_the_same_type_as_a_keyword():
    assert set(EVERY) == set(KEYS)
    keywords = {k: getattr(t, "__forward_arg__", t) + " | None" for k, t in decision.Fields.__annotations__.items()}
    assert keywords == {f.name: f.type for f in dataclasses.fields(Decision)}


def test_every_field_round_trips_through_the_wire_and_a_struct():
    d = Decision(**EVERY)
    wire = d.encode()
    assert set(wire) == set(KEYS)
    assert all(isinstance(v, (str, bool, int, float)) for v in wire.values())
    assert Decision.decode(wire) == d
    assert Decision.decode(_struct(wire)) == d
    for key in KEYS:  # and each on its own
        one = Decision(**{key: EVERY[key]})  # type: ignore[misc]
        assert set(one.encode()) == {key}
        assert Decision.decode(one.encode()) == one == Decision.decode(_struct(one.encode())), key


def test_the_wire_values_are_the_ones_envoy_and_the_usage_records_read():
    wire = Decision(**EVERY).encode()
    assert wire["estimate"] == "12,1024" and wire["reserved"] == "1036@1700000000.125"
    assert wire["budgets"] == "*/chat\nteam-a/chat" and Decision(budgets=()).encode() == {"budgets": ""}
    assert wire["cache_ttl_s"] == "300" and wire["cache_max_bytes"] == str(1 << 20)
    assert wire["x_model_variant_applied"] == "false" and wire["suffix_applied"] is False
    assert orjson.loads(wire["retry"]) == {"hops": [["b", "m-b"]], "origin": "m-a", "limits": [["m-b", "r1", "r2"]],
                                           "path": "/v1/chat/completions", "drop_effort": True}


def test_a_partial_or_older_entry_decodes_and_unknown_keys_are_dropped():
    old = {"kind": "routed", "backend": "a", "some_retired_key": "x", "estimate": "12,x", "reserved": "7@later",
           "suffix_applied": "yes", "cache_ttl_s": "-1", "feedback_revision": 3.0, "caller": 7}
    for form in (old, _struct(old)):
        d = Decision.decode(form)
        assert (d.kind, d.backend) == ("routed", "a")
        assert d.estimate is d.reserved is d.suffix_applied is d.cache_ttl_s is d.caller is None
        assert d.experiment is None and d.retry_plan() is None
        assert d.feedback_revision == 3 and "some_retired_key" not in d.encode()
    assert not Decision.decode({}) and not EMPTY and Decision.decode(_struct({})) == EMPTY
    assert Decision(kind="routed", variant=None).encode() == {"kind": "routed"}  # None: not set


def test_merging_lets_the_right_side_win_and_without_drops_keys():
    d = Decision(kind="routed", backend="a") | Decision(backend="b", key_id="k")
    assert d.encode() == {"kind": "routed", "backend": "b", "key_id": "k"}
    assert d.without(decision.KIND).encode() == {"backend": "b", "key_id": "k"}


def test_a_retry_plan_that_does_not_read_keeps_what_does():
    plan = Retry.decode(orjson.dumps({"hops": [["b", "m-b"], ["c"]], "origin": 3, "limits": [[]]}).decode())
    assert plan == Retry((("b", "m-b"), None), None, (None,), None, False)
    assert Retry.decode("not json") is None and Retry.decode("[]") is None


def test_the_envoy_config_spells_the_codec_keys():
    keys = set(KEYS)
    assert set(envoy._ATTRIBUTION_KEYS.values()) | {envoy._ANTHROPIC_REQUEST_ID[1]} <= keys
    assert set(envoy_limits.TOKEN_HEADERS.values()) <= keys
    text = orjson.dumps([envoy_replies.local_reply_config(1024), envoy_limits.response_headers_to_add()]).decode()
    named = set(re.findall(r"DYNAMIC_METADATA\(" + NAMESPACE + r":(\w+)\)", text))
    named |= set(re.findall(r'"key":"(\w+)"', text)) - {"x-should-retry", "retry-after"}
    assert named and named <= keys, named - keys


# ------------------------------------------------------------------ the writers

CONFIG = """
proxy: {variant_suffixes: {enabled: true}}
server: {admin_token: tok-admin}
api_keys:
  - {key: sk-a, id: team-a}
backends:
  - {name: a, url: "http://127.0.0.1:1/base", models: [m-a, m-c], api_key: sk-backend}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b, m-c]}
model_metadata:
  - {id: m-a, reasoning_efforts: [low, high]}
fallback_chains:
  m-a: [m-b]
model_experiments:
  - name: chat-ab
    model: chat
    response_model: client
    response_headers: true
    variants:
      - {id: control, model: m-a, weight: 1}
limits:
  - {model: chat, requests_per_second: 5, tokens: 100000, token_window: 60s}
  - {model: m-c, tokens: 10}
cache: {}
"""


@pytest.fixture(scope="module")
def snap() -> Snapshot:
    return snapshot.build(parse(CONFIG, env={}).config)


def _decide(snap: Snapshot, model: str, path: str = "/v1/chat/completions", states=None, spent=None, **extra):
    caller = authenticate(snap, {"authorization": "Bearer sk-a"}, "openai")
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **extra})
    return decide(snap, Request(ingress=lookup(path), path=path, headers={}, body=body, caller=caller,
                                now=1_700_000_000.0, states=states or {}, spent=spent or {}))


def _writers(snap: Snapshot) -> list[Decision]:
    """The decisions routing writes, for requests that take every branch."""
    routed = _decide(snap, "chat")
    assert isinstance(routed, Route) and routed.plan.experiment and routed.limits is not None
    chained = _decide(snap, "m-a")
    assert isinstance(chained, Route) and chained.hops
    suffixed = _decide(snap, "m-a:thinking")
    down = _decide(snap, "m-a", states={"a": BackendState("a", healthy=False)})
    background = _decide(snap, "m-a", path="/v1/responses", input="hi", background=True)
    spent = _decide(snap, "m-c", spent={"*/m-c": (int(1_700_000_000 // 86400), 10)})
    unknown = _decide(snap, "nope")
    assert isinstance(spent, Reply) and isinstance(unknown, Reply)
    rid = tag(Owner("a", "m-a", False, "team-a"), "resp_up", snap.id_key)
    path = f"/v1/responses/{rid}"
    head = dispatch.at_headers(snap, path, {"authorization": "Bearer sk-a"}, "GET", body_follows=False)
    follow_up = head.outcome
    hop = retarget(snap, suffixed.decision(), 2, suffixed.body or b"{}")
    assert hop is not None
    routes = [routed, chained, suffixed, down, background, follow_up]
    assert all(isinstance(r, Route) for r in routes), routes
    return [r.decision() for r in routes] + [spent.meta, unknown.meta, hop.decision]


def _answers(snap: Snapshot) -> list[Decision]:
    """The decisions the request handler publishes (routed, refused, explained, anthropic)."""

    class Runtime:
        def __init__(self) -> None:
            self.snapshot = snap
            self.budgets = Budgets(lambda: snap)

        def backend_states(self) -> dict:
            return {}

        def count_request(self) -> None:
            pass

        def exports_traces(self) -> bool:
            return True  # the router names its span upstream: span_id is published

    def messages(path: str, headers: dict[str, str], body: dict):
        raw = orjson.dumps(body)
        entries = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                   {":method": "POST", ":path": path, "x-request-id": "r-1", "authorization": "Bearer sk-a",
                    **headers}.items()]
        yield pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=entries)))
        yield pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))

    async def run(path: str, headers: dict[str, str], body: dict) -> list[Decision]:
        async def stream():
            for m in messages(path, headers, body):
                yield m
        out = []
        async for answer in Processor(Runtime()).Process(stream(), None):
            if NAMESPACE in answer.dynamic_metadata.fields:
                wire = answer.dynamic_metadata.fields[NAMESPACE].struct_value
                out.append((Decision.decode(wire), set(wire.fields)))
        return out

    found = []
    for path, headers, body in (
        ("/v1/chat/completions", {"x-model-router-explain": "1", "x-model-router-admin-token": "tok-admin"},
         {"model": "chat", "messages": []}),
        ("/anthropic/v1/messages", {}, {"model": "m-b", "max_tokens": 5, "messages": []}),
        ("/v1/chat/completions", {}, {"model": "nope", "messages": []}),
    ):
        for d, keys in asyncio.run(run(path, headers, body)):
            # Every answer names its shape (or none, ""); every other key is the codec's.
            assert decision.SHAPE in keys and keys - {decision.SHAPE} <= set(KEYS), keys - set(KEYS)
            found.append(d)
    return found


def test_every_key_a_writer_emits_is_the_codecs_and_round_trips(snap):
    emitted: set[str] = set()
    for d in _writers(snap) + _answers(snap):
        wire = d.encode()
        assert set(wire) <= set(KEYS), set(wire) - set(KEYS)
        assert Decision.decode(wire) == d == Decision.decode(_struct(wire))
        emitted |= set(wire)
    # Accepted feedback is written by the experiments' feedback handler; the
    # rest of the codec's keys come from routing and the request handler.
    feedback = {k for k in KEYS if k.startswith("feedback_")}
    assert emitted | feedback == set(KEYS), set(KEYS) - emitted - feedback


def test_a_route_decision_is_its_plan_limits_and_backend(snap):
    routed = _decide(snap, "chat")
    d = routed.decision()
    assert (d.kind, d.experiment, d.variant, d.backend, d.limit_model) == ("routed", "chat-ab", "control", "a", "chat")
    assert routed.metadata() == d.encode()
    chained = _decide(snap, "m-a").decision()
    plan = chained.retry_plan()
    assert plan is not None and plan.hops == (("b", "m-b"),) and plan.origin == "m-a" and chained.auth_replaced

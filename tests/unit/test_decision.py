"""The decision codec (sidecar/decision.py): every field survives the wire,
an older or partial entry decodes, and a retry plan reads as far as it can."""

from __future__ import annotations

import orjson
from google.protobuf import struct_pb2

from sidecar import decision
from sidecar.contract import NAMESPACE
from sidecar.decision import EMPTY, KEYS, Decision, Retry

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


def test_every_field_has_a_value_here():
    assert set(EVERY) == set(KEYS) == set(decision.Fields.__annotations__)


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

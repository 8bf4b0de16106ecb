"""Response ids that name their owner, and the pure decisions that read them."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.schema import parse
from sidecar.payload.response_ids import Owner, tag, untag
from sidecar.payload.rewrite import rewrite_json_body
from sidecar.routing import Caller, Route, decide, follow_up, snapshot
from sidecar.routing.ingress import follow_up as follow_up_path

from .test_decide import refusal, req

CONFIG = """
backends:
  - {name: a, url: "http://127.0.0.1:1/base", models: [m, m-a]}
  - {name: b, url: "http://127.0.0.1:2", models: [m], api_key: sk-b}
  - {name: hidden, url: "http://127.0.0.1:3", models: [m], internal: true}
  - {name: retired, url: "http://127.0.0.1:4", models: [m], enabled: false}
api_keys:
  - {key: k-all, id: all}
  - {key: k-a, id: a-only, allowed_backends: [a]}
  - {key: k-ma, id: ma-only, allowed_models: [m-a]}
model_experiments:
  - name: secret
    model: chat
    response_model: client
    hide_variant_models: true
    variants: [{id: only, model: m-a, weight: 1, backends: [a]}]
"""


@pytest.fixture(scope="module")
def snap():
    return snapshot.build(parse(CONFIG, env={}).config)


def caller(snap, key="k-all"):
    return Caller(key, snap.keys[key])


KEY = b"k" * 32
NO_NUL = st.text().filter(lambda s: "\0" not in s)


def rid(snap, owner: Owner, upstream: str = "resp_up") -> str:
    return tag(owner, upstream, snap.id_key)


@given(NO_NUL.filter(bool), NO_NUL, st.booleans(), NO_NUL, st.text(min_size=1))
def test_an_owner_round_trips_through_its_tag(backend, model, rewrite, key_id, upstream):
    owner = Owner(backend, model, rewrite, key_id)
    assert untag(tag(owner, upstream, KEY), KEY) == (owner, upstream)


def test_an_id_names_no_backend_or_model_and_needs_the_key():
    value = tag(Owner("pool-secret", "hidden-model", True, "team-a"), "resp_1", KEY)
    assert value.startswith("resp_mr2") and value.endswith("_resp_1")
    for word in ("pool", "secret", "hidden", "model", "team"):
        assert word not in value.lower()
    import base64
    code = value[len("resp_mr2"):].partition("_")[0]
    raw = base64.b32decode(code.upper() + "=" * (-len(code) % 8))
    assert b"pool" not in raw and b"hidden" not in raw
    assert untag(value, b"x" * 32) is None  # another router's key


@given(st.data())
def test_any_edit_of_an_id_breaks_it(data):
    value = tag(Owner("a", "m", False, "all"), "resp_up", KEY)
    i = data.draw(st.integers(0, len(value) - 1))
    c = data.draw(st.characters(codec="ascii").filter(lambda c: c != value[i]))
    edited = value[:i] + c + value[i + 1:]
    assert untag(edited, KEY) is None


def test_the_engine_id_is_sealed_too():
    mine = tag(Owner("a", "m", False, "me"), "resp_mine", KEY)
    assert untag(mine.replace("resp_mine", "resp_theirs"), KEY) is None


@pytest.mark.parametrize("value", [
    "", "resp_abc", "resp_mr2", "resp_mr2_", "resp_mr2abc_", "resp_mr2!!_x",
    tag(Owner("a", "m", False), "x", KEY)[:-1],  # no engine id after it
    tag(Owner("a", "m", False), "x", KEY).upper(),  # another spelling of the same id
    "resp_mr1" + tag(Owner("a", "m", False), "x", KEY)[8:],  # the earlier, unsigned form
])
def test_other_text_is_no_tag(value):
    assert untag(value, KEY) is None


def test_follow_up_paths():
    assert follow_up_path("/v1/responses/resp_1") == ("resp_1", "")
    assert follow_up_path("/v1/responses/resp_1/cancel") == ("resp_1", "/cancel")
    assert follow_up_path("/v1/responses/resp_1/input_items?limit=2") == ("resp_1", "/input_items")
    assert follow_up_path("/v1/responses/resp_1/") == ("resp_1", "")
    assert follow_up_path("/v1/responses/resp_1/other") is None
    assert follow_up_path("/v1/responses") is None
    assert follow_up_path("/v1/chat/completions/x") is None


def test_a_follow_up_goes_to_the_owner_with_its_credentials_and_the_create_s_names(snap):
    r_id = rid(snap, Owner("b", "m", False, "all"))
    r = follow_up(snap, f"/v1/responses/{r_id}/input_items?limit=2", r_id, "/input_items", caller(snap))
    assert isinstance(r, Route) and r.backend.name == "b"
    assert r.path == "/v1/responses/resp_up/input_items?limit=2"
    assert ("authorization", "Bearer sk-b") in r.set_headers
    # A list of items carries no response id: only its status is looked at.
    assert r.plan.id_tag is None and r.plan.rewrite_model is None and r.plan.not_found == r_id
    hidden = rid(snap, Owner("a", "chat", True, "all"), "resp_h")
    r = follow_up(snap, f"/v1/responses/{hidden}", hidden, "", caller(snap))
    assert r.path == "/base/v1/responses/resp_h"
    assert (r.plan.id_tag, r.plan.rewrite_model, r.plan.kind) == (
        Owner("a", "chat", True, "all").payload(), "chat", "follow_up")


@pytest.mark.parametrize("owner, key", [
    (Owner("hidden", "m", False, "all"), "k-all"),  # internal
    (Owner("retired", "m", False, "all"), "k-all"),  # disabled
    (Owner("gone", "m", False, "all"), "k-all"),  # unknown
    (Owner("b", "m", False, "a-only"), "k-a"),  # outside the key's allowed_backends
    (Owner("a", "m", False, "ma-only"), "k-ma"),  # outside the key's allowed_models
    (Owner("a", "m-a", False, "all"), "k-all"),  # a reserved model
    (Owner("a", "m", False, "all"), "k-a"),  # another key's response
    (Owner("a", "m", False, ""), "k-all"),  # made without a key
])
def test_every_refused_follow_up_is_the_unknown_id_answer(snap, owner, key):
    r_id = rid(snap, owner)
    got = refusal(follow_up(snap, f"/v1/responses/{r_id}", r_id, "", caller(snap, key)))
    unknown = refusal(follow_up(snap, "/v1/responses/resp_up", "resp_up", "", caller(snap, key)))
    assert got[0] == unknown[0] == 404
    assert orjson.dumps(got[1]).replace(r_id.encode(), b"ID") == orjson.dumps(unknown[1]).replace(b"resp_up", b"ID")


def test_a_continuing_create_goes_to_the_owner_with_the_engine_s_id(snap):
    r_id = rid(snap, Owner("b", "m", False, "all"))
    for n in range(4):  # whatever the round-robin counter says
        r = decide(snap, req("/v1/responses", {"model": "m", "input": "x", "previous_response_id": r_id},
                             snap=snap, pick=n))
        assert r.backend.name == "b"
        assert orjson.loads(r.body)["previous_response_id"] == "resp_up"
        assert r.plan.id_tag == Owner("b", "m", False, "all").payload()


@pytest.mark.parametrize("owner, model, key", [
    (Owner("b", "m", False, "a-only"), "m", "k-a"),  # the key may not use the owner
    (Owner("b", "m", False, "all"), "chat", "k-all"),  # the arm is pinned elsewhere
    (Owner("hidden", "m", False, "all"), "m", "k-all"),
    (Owner("b", "m", False, "all"), "m", "k-a"),  # another key's response
])
def test_a_continuation_the_caller_cannot_reach_is_previous_not_found(snap, owner, model, key):
    r_id = rid(snap, owner)
    status, body = refusal(decide(snap, req("/v1/responses", {"model": model, "input": "x",
                                                              "previous_response_id": r_id}, key=key, snap=snap)))
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        400, "previous_response_not_found", "previous_response_id")


def test_an_unstored_create_is_not_tagged(snap):
    r = decide(snap, req("/v1/responses", {"model": "m", "input": "x", "store": False}, snap=snap))
    assert r.plan is not None and r.plan.id_tag is None and not r.plan.needs_response


def test_json_bodies_get_the_tag_on_response_objects_only():
    def tagger(upstream: str) -> str:
        return "resp_mr2t_" + upstream

    out, _ = rewrite_json_body(b'{"id": "resp_1", "object": "response", "deleted": true}', None, "openai", tagger)
    assert out == b'{"id": "resp_mr2t_resp_1", "object": "response", "deleted": true}'
    items = b'{"object": "list", "data": [{"id": "msg_1"}], "first_id": "msg_1"}'
    assert rewrite_json_body(items, None, "openai", tagger)[0] == items


"""Responses API follow-ups reach the backend that stores the response.

Through real Envoy with the official openai SDK, on a model two demo engines
serve round robin: every retrieve, delete, cancel, input-items listing and
``previous_response_id`` create must land on the engine that created the
response (the engines' request logs show where each call went), and ids the
router did not hand out, edited ones, another key's, or ones whose owner the
caller may not use, get the router's 404 without reaching any engine.
"""

from __future__ import annotations

import base64

import httpx
import openai
import orjson
import pytest

from sidecar.payload.response_ids import Owner, derive, tag, untag

from ..conftest import clear_demo_requests, demo_requests, envoy_stat

CONFIG = """
metering: {flush_interval_ms: 100}
backends:
  - {name: east, url: "demo://", models: [gpt-r, hidden-r]}
  - {name: west, url: "demo://", models: [gpt-r, hidden-r]}
  - {name: vault, url: "demo://", models: [gpt-r], internal: true}
model_experiments:
  - name: hide
    model: smart
    response_model: client
    hide_variant_models: true
    variants: [{id: only, model: hidden-r, weight: 1}]
api_keys:
  - {key: sk-all, id: all}
  - {key: sk-east, id: east-only, allowed_backends: [east]}
  - {key: sk-other, id: other-model, allowed_models: [other]}
  - {key: sk-two, id: two}
"""
ENGINES = ("east", "west", "vault")
ROUNDS = 8  # round robin over two engines: a wrong choice shows within two


KEY: list[bytes] = []  # the stack's response-id key, from its per-run secret


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG)
    KEY[:] = [derive(s.grpc_secret)]
    return s


def sdk(stack, key: str = "sk-all") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=30)


def owner_of(response_id: str) -> tuple[str, str]:
    """(backend, the engine's own id) of an id the router handed out."""
    found = untag(response_id, KEY[0])
    assert found is not None, f"not a router id: {response_id}"
    return found[0].backend, found[1]


def follow_ups(stack) -> dict[str, list[dict]]:
    """Each engine's requests about stored responses (and creates that continue one)."""
    out = {}
    for name in ENGINES:
        out[name] = [
            r for r in demo_requests(stack, name)
            if r["path"].startswith("/v1/responses/") or (r["json"] or {}).get("previous_response_id")
        ]
    return out


def not_found(rid: str) -> dict:
    return {"error": {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error",
                      "param": None, "code": "response_not_found"}}


def test_every_follow_up_reaches_the_engine_that_created_the_response(stack):
    clear_demo_requests(stack)
    client = sdk(stack)
    created: dict[str, set[str]] = {"east": set(), "west": set()}
    firsts = [client.responses.create(model="gpt-r", input=f"turn {i}") for i in range(ROUNDS)]
    for i, first in enumerate(firsts):
        backend, upstream = owner_of(first.id)
        assert first.output_text.startswith(f"[{backend}] gpt-r: turn {i}")
        created[backend].add(upstream)

        again = client.responses.retrieve(first.id)
        assert (again.id, again.output_text) == (first.id, first.output_text)
        items = client.responses.input_items.list(first.id)
        assert [c.text for item in items.data for c in item.content] == [f"turn {i}"]

        second = client.responses.create(model="gpt-r", input="go on", previous_response_id=first.id)
        assert second.previous_response_id == first.id  # the engine's echo, tagged again
        assert owner_of(second.id)[0] == backend
        assert second.output_text.startswith(f"[{backend}] gpt-r: go on")
        created[backend].add(owner_of(second.id)[1])

        client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):  # the owner's own 404: it is gone there
            client.responses.retrieve(second.id)
    assert created["east"] and created["west"], "round robin should have used both engines"

    seen = follow_ups(stack)
    assert seen["vault"] == []
    for name in ("east", "west"):
        # input_items, retrieve x2, delete, and the continuing create, per response the engine made.
        assert len(seen[name]) == 5 * len(created[name]) // 2
        for r in seen[name]:
            upstream = r["json"]["previous_response_id"] if r["method"] == "POST" else r["path"].split("/")[3]
            assert upstream in created[name], f"{r['method']} {r['path']} reached {name}, not the owner"


def test_a_streamed_create_hands_out_the_owner_in_every_event(stack):
    clear_demo_requests(stack)
    client = sdk(stack)
    owners = set()
    for _ in range(4):
        with client.responses.create(model="gpt-r", input="stream me", stream=True) as events:
            lifecycle = [e for e in events if hasattr(e, "response")]
        ids = {e.response.id for e in lifecycle}
        assert len(ids) == 1 and len(lifecycle) == 3  # created, in_progress, completed
        rid = ids.pop()
        backend, upstream = owner_of(rid)
        owners.add(backend)
        done = lifecycle[-1].response
        assert client.responses.retrieve(rid).output_text == done.output_text
        assert [r["path"] for r in follow_ups(stack)[backend]][-1] == f"/v1/responses/{upstream}"
    assert owners == {"east", "west"}


def test_cancel_reaches_the_owner(stack):
    client = sdk(stack)
    for _ in range(2):
        queued = client.responses.create(model="gpt-r", input="later", background=True)
        assert queued.status == "queued"
        backend, upstream = owner_of(queued.id)
        cancelled = client.responses.cancel(queued.id)
        assert (cancelled.id, cancelled.status) == (queued.id, "cancelled")
        assert client.responses.retrieve(queued.id).status == "cancelled"
        paths = [r["path"] for r in follow_ups(stack)[backend]]
        assert f"/v1/responses/{upstream}/cancel" in paths


def test_a_hidden_arm_stays_hidden_on_retrieve(stack):
    client = sdk(stack)
    r = client.responses.create(model="smart", input="who are you")
    assert r.model == "smart"
    owner = untag(r.id, KEY[0])[0]
    assert (owner.model, owner.rewrite) == ("smart", True)
    got = client.responses.retrieve(r.id)
    assert got.model == "smart" and got.output_text == r.output_text
    with client.responses.create(model="smart", input="more", previous_response_id=r.id, stream=True) as events:
        models = {e.response.model for e in events if hasattr(e, "response")}
    assert models == {"smart"}


def unsigned(backend: str, model: str, upstream: str) -> str:
    """An id in the earlier, unsigned form: anyone could write one."""
    raw = f"{backend}\0{model}\0{0}".encode()
    return "resp_mr1" + base64.b32encode(raw).decode().rstrip("=").lower() + "_" + upstream


def edited(rid: str, at: int) -> str:
    c = rid[at]
    return rid[:at] + ("b" if c != "b" else "c") + rid[at + 1:]


def every_follow_up_is_not_found(client, rid: str) -> None:
    """Retrieve, cancel, delete and input items: the router's 404 byte for byte
    (the id it names is the one sent); a continuing create: 400."""
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as info:
            call(rid)
        assert info.value.response.content == orjson.dumps(not_found(rid)), call
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="gpt-r", input="x", previous_response_id=rid)
    assert bad.value.code == "previous_response_not_found"


def test_unknown_edited_and_forged_ids_get_the_router_404_and_reach_no_engine(stack):
    client = sdk(stack)
    real = client.responses.create(model="gpt-r", input="mine")
    backend, upstream = owner_of(real.id)
    other = client.responses.create(model="gpt-r", input="mine too")
    clear_demo_requests(stack)
    code_end = real.id.index("_", len("resp_mr2"))
    forged = [
        "resp_abc123",  # never handed out by the router
        upstream,  # the engine's own id, without the tag
        unsigned(backend, "gpt-r", upstream),  # the unsigned form, naming the right owner
        unsigned("vault", "gpt-r", upstream),
        tag(Owner(backend, "gpt-r", False, "all"), upstream, b"another router's key....."),
        edited(real.id, len("resp_mr2") + 3),  # one character of the seal
        edited(real.id, code_end - 2),  # one character of the sealed owner
        real.id[:code_end + 1] + owner_of(other.id)[1],  # this seal on another response
        real.id + "x",
    ]
    for rid in forged:
        every_follow_up_is_not_found(client, rid)
    assert all(demo_requests(stack, name) == [] for name in ENGINES)
    assert client.responses.retrieve(real.id).output_text == real.output_text  # the real id still works


def test_an_id_the_engine_lost_gets_the_router_404_not_the_engine_s(stack):
    """Deleted on the engine: the engine answers 404 in its own words; the
    client gets the router's bytes (and headers), as for an id never issued."""
    client = sdk(stack)
    gone = client.responses.create(model="gpt-r", input="soon gone")
    client.responses.delete(gone.id)
    never = gone.id[:-3] + "zzz"  # same length and shape, never issued
    auth = {"authorization": "Bearer sk-all"}
    for method, suffix in (("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"), ("DELETE", "")):
        lost = httpx.request(method, f"{stack.url}/v1/responses/{gone.id}{suffix}", headers=auth, timeout=30)
        unknown = httpx.request(method, f"{stack.url}/v1/responses/{never}{suffix}", headers=auth, timeout=30)
        assert lost.status_code == unknown.status_code == 404
        assert lost.content == orjson.dumps(not_found(gone.id))
        assert lost.content.replace(gone.id.encode(), b"ID") == unknown.content.replace(never.encode(), b"ID")
        assert sorted(lost.headers.keys()) == sorted(unknown.headers.keys()), suffix


def test_another_key_cannot_reach_a_response_by_its_id(stack):
    mine = sdk(stack).responses.create(model="gpt-r", input="my secret is 42")
    theirs = sdk(stack, "sk-two")
    clear_demo_requests(stack)
    every_follow_up_is_not_found(theirs, mine.id)
    assert all(demo_requests(stack, name) == [] for name in ENGINES)
    assert sdk(stack).responses.retrieve(mine.id).output_text == mine.output_text


def test_a_key_that_may_not_use_the_owner_is_refused_like_an_unknown_id(stack):
    everyone = sdk(stack)
    west = next(r for r in (everyone.responses.create(model="gpt-r", input="w") for _ in range(4))
                if owner_of(r.id)[0] == "west")
    clear_demo_requests(stack)
    for key in ("sk-east", "sk-other"):  # allowed_backends without west; allowed_models without gpt-r
        limited = sdk(stack, key)
        with pytest.raises(openai.NotFoundError) as info:
            limited.responses.retrieve(west.id)
        assert orjson.loads(info.value.response.content) == not_found(west.id)
        with pytest.raises(openai.NotFoundError):
            limited.responses.delete(west.id)
    east_only = sdk(stack, "sk-east")
    with pytest.raises(openai.BadRequestError) as bad:
        east_only.responses.create(model="gpt-r", input="x", previous_response_id=west.id)
    assert bad.value.code == "previous_response_not_found"
    assert demo_requests(stack, "west") == [] and demo_requests(stack, "east") == []
    # Its own responses (all on east) it follows up as usual.
    own = east_only.responses.create(model="gpt-r", input="e")
    assert owner_of(own.id)[0] == "east"
    assert east_only.responses.retrieve(own.id).output_text == own.output_text


def test_follow_ups_cost_one_ext_proc_message_plus_the_rewrite_of_their_answer(stack):
    """Decided at the request headers. An input items listing's answer is
    looked at only for its status (an engine's 404 becomes the router's); a
    retrieve's answer gets its id tagged (headers and body)."""
    client = sdk(stack)
    r = client.responses.create(model="gpt-r", input="count")
    for call, cost in ((client.responses.input_items.list, 2), (client.responses.retrieve, 3)):
        before = envoy_stat(stack, "stream_msgs_sent")  # the request and the response processors
        for _ in range(3):
            call(r.id)
        assert envoy_stat(stack, "stream_msgs_sent") - before == 3 * cost

"""The pure decision function: request context + snapshot -> route or refusal."""

from __future__ import annotations

import orjson
import pytest

from sidecar.config.schema import parse
from sidecar.errors import Reply
from sidecar.routing import Caller, Request, authenticate, decide, passthrough, snapshot
from sidecar.routing.ingress import INGRESSES, lookup

CONFIG = """
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a, shared]}
  - {name: b, url: "http://127.0.0.1:2/v1", models: [m-b, shared], api_key: sk-b}
  - {name: c, url: "https://claude.example.com", type: anthropic, models: [claude], api_key: sk-c}
  - {name: hidden, url: "http://127.0.0.1:3", models: [m-int], internal: true}
api_keys:
  - {key: k-all, id: all}
  - {key: k-chat, id: chat-only, allowed_models: [chat, m-a]}
  - {key: k-a, id: a-only, allowed_backends: [a]}
model_aliases: {old: chat, sonnet: claude}
model_experiments:
  - name: exp
    model: chat
    response_model: client
    response_headers: true
    variants:
      - {id: control, model: m-a, weight: 1}
      - {id: pinned, model: m-b, weight: 0, backends: [b]}
  - name: pinned-only
    model: chat-b
    sticky_key: header:x-user
    variants: [{id: only, model: m-b, weight: 1, backends: [b]}]
"""


@pytest.fixture(scope="module")
def snap():
    return snapshot.build(parse(CONFIG, env={}).config)


def req(path, body, key="k-all", snap=None, headers=None, **kw):
    s = snap
    caller = Caller(key, s.keys.get(key) if s and key else None)
    return Request(
        ingress=lookup(path), path=path, headers=headers or {},
        body=orjson.dumps(body) if isinstance(body, dict) else body, caller=caller, **kw,
    )


def refusal(result) -> tuple[int, dict]:
    assert isinstance(result, Reply), result
    return result.status, orjson.loads(result.body)


def test_plain_model_routes_to_its_backend(snap):
    r = decide(snap, req("/v1/chat/completions", {"model": "m-a", "messages": []}, snap=snap))
    assert r.backend.name == "a" and r.upstream_model == "m-a" and r.body is None and r.path is None
    assert r.remove_headers == ("authorization", "x-api-key")  # a router key never goes upstream


def test_backend_base_path_and_credentials(snap):
    r = decide(snap, req("/v1/chat/completions", {"model": "m-b"}, snap=snap))
    assert r.backend.name == "b" and r.backend.base_path == "" and r.path is None  # trailing /v1 dropped
    assert r.set_headers == (("authorization", "Bearer sk-b"),)
    r = decide(snap, req("/anthropic/v1/messages", {"model": "claude"}, snap=snap))
    assert r.path == "/v1/messages"
    assert r.set_headers == (("x-api-key", "sk-c"),)
    # A hosted (https) backend never gets the client's address.
    assert r.remove_headers == ("authorization", "x-forwarded-for", "x-envoy-external-address")


def test_experiment_rewrites_model_and_plans_response(snap):
    r = decide(snap, req("/v1/chat/completions", {"model": "chat", "stream": True}, snap=snap))
    assert r.upstream_model == "m-a" and r.client_model == "chat"
    body = orjson.loads(r.body)
    assert body["model"] == "m-a"
    assert body["stream_options"] == {"include_usage": True}
    p = r.plan
    assert (p.experiment, p.variant, p.assignment) == ("exp", "control", "sticky")
    assert p.rewrite_model == "chat" and p.strip_injected_usage and p.read_usage and p.needs_response
    md = r.metadata()
    assert (md["x_experiment"], md["x_experiment_variant"]) == ("exp", "control")
    assert (md["experiment"], md["variant"], md["assignment"], md["kind"]) == ("exp", "control", "sticky", "routed")
    assert (md["client_model"], md["upstream_model"], md["backend"]) == ("chat", "m-a", r.backend.name)
    assert md["rewrite_model"] == "chat" and md["strip_usage"] is True


def test_client_usage_request_is_not_stripped(snap):
    r = decide(snap, req("/v1/chat/completions",
                         {"model": "chat", "stream": True, "stream_options": {"include_usage": True}}, snap=snap))
    assert not r.plan.strip_injected_usage


def test_key_gate_judges_client_name(snap):
    ok = decide(snap, req("/v1/chat/completions", {"model": "chat"}, key="k-chat", snap=snap))
    assert ok.upstream_model == "m-a"
    status, body = refusal(decide(snap, req("/v1/chat/completions", {"model": "m-b"}, key="k-chat", snap=snap)))
    assert status == 403 and body["error"]["code"] == "model_not_permitted"


def test_key_gate_refusal_names_the_model_as_sent_not_the_alias_target(snap):
    status, body = refusal(decide(snap, req("/v1/responses", {"model": "sonnet", "input": "x"}, key="k-chat", snap=snap)))
    assert status == 403 and body["error"]["message"] == "This API key is not permitted to use the model 'sonnet'."


def test_pin_outside_key_backends_is_403_naming_client_model(snap):
    status, body = refusal(decide(snap, req("/v1/chat/completions", {"model": "chat-b"}, key="k-a", snap=snap,
                                            headers={"x-user": "u1"})))
    assert status == 403 and "'chat-b'" in body["error"]["message"]


def test_sticky_header_and_random_assignment(snap):
    r = decide(snap, req("/v1/chat/completions", {"model": "chat-b"}, snap=snap, headers={"x-user": "u1"}))
    assert r.plan.assignment == "sticky"
    r = decide(snap, req("/v1/chat/completions", {"model": "chat-b"}, snap=snap, headers={"x-user": "  "}))
    assert r.plan.assignment == "random"


def test_aliases_apply_only_on_their_ingresses(snap):
    r = decide(snap, req("/v1/responses", {"model": "old"}, snap=snap))
    assert r.client_model == "chat" and r.upstream_model == "m-a"
    status, body = refusal(decide(snap, req("/v1/chat/completions", {"model": "old"}, snap=snap)))
    assert status == 404 and "'old'" in body["error"]["message"]
    r = decide(snap, req("/anthropic/v1/messages", {"model": "sonnet"}, snap=snap))
    assert r.backend.name == "c" and orjson.loads(r.body)["model"] == "claude"


def test_literal_ingresses_skip_experiments(snap):
    status, body = refusal(decide(snap, req("/v1/rerank", {"model": "chat"}, snap=snap)))
    assert status == 404
    r = decide(snap, req("/v1/realtime?model=m-a&x=1", b"", snap=snap))
    assert r.backend.name == "a" and r.path is None


def test_internal_backends_are_never_selected(snap):
    status, _ = refusal(decide(snap, req("/v1/chat/completions", {"model": "m-int"}, snap=snap)))
    assert status == 404


def test_anthropic_errors_use_anthropic_shape(snap):
    status, body = refusal(decide(snap, req("/anthropic/v1/messages", {"model": "nope"}, snap=snap)))
    assert status == 404
    assert body == {"type": "error", "error": {"type": "not_found_error",
                                               "message": "The model 'nope' does not exist or you do not have access to it."}}


def test_round_robin_over_shared_model(snap):
    seen = {decide(snap, req("/v1/embeddings", {"model": "shared"}, snap=snap, pick=i)).backend.name for i in range(4)}
    assert seen == {"a", "b"}


def test_multipart_model_is_rewritten_in_place(snap):
    boundary = "XyZ"
    body = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na cat\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"x.png\"\r\n"
        f"Content-Type: image/png\r\n\r\n\x89PNG\r\n--{boundary}--\r\n"
    ).encode("latin-1")
    r = decide(snap, req("/v1/images/edits", body, snap=snap,
                         headers={"content-type": f"multipart/form-data; boundary={boundary}"}))
    assert r.upstream_model == "m-a"
    assert r.body == body.replace(b"\r\n\r\nchat\r\n", b"\r\n\r\nm-a\r\n")


@pytest.mark.parametrize("body, ctype", [
    (b"not multipart", "multipart/form-data; boundary=q"),
    (b"--q\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat", "multipart/form-data; boundary=q"),
    (b"--q--\r\n", "multipart/form-data; boundary=q"),
    (b"", "application/json"),
])
def test_bad_multipart_is_400(snap, body, ctype):
    status, _ = refusal(decide(snap, req("/v1/images/edits", body, snap=snap, headers={"content-type": ctype})))
    assert status == 400


def test_authenticate(snap):
    assert authenticate(snap, {"authorization": "Bearer k-all"}, "openai").key.id == "all"
    assert authenticate(snap, {"x-api-key": "k-a"}, "anthropic").key.id == "a-only"
    for headers in ({}, {"authorization": "Bearer "}, {"authorization": "Basic k-all"}, {"x-api-key": "zz"}):
        assert authenticate(snap, headers, "openai").status == 401
    open_snap = snapshot.build(parse("backends: [{name: a, url: 'http://x'}]", env={}).config)
    assert authenticate(open_snap, {}, "openai") == Caller(None, None)
    assert authenticate(open_snap, {"x-api-key": "anything"}, "openai").api_key == "anything"


def test_paths_outside_the_table_are_refused_unless_passthrough_is_configured(snap):
    status, payload = refusal(passthrough(snap, "/v1/files?x=1", Caller("k-all", snap.keys["k-all"]), "openai", []))
    assert status == 404 and payload["error"]["code"] == "unknown_endpoint"
    assert "'/v1/files'" in payload["error"]["message"]
    status, payload = refusal(passthrough(snap, "/anthropic/v1/files", Caller(None, None), "anthropic", []))
    assert status == 404 and payload["error"]["type"] == "not_found_error"


PASSTHROUGH = CONFIG.replace("api_keys:", "proxy: {passthrough_backend: b}\napi_keys:").replace(
    "model_experiments:", "model_experiments:\n  - {name: hidden, model: h, hide_variant_models: true, "
    "variants: [{id: x, model: m-x, weight: 1}]}", 1,
)


def test_passthrough_goes_to_the_configured_backend_after_the_gates():
    snap = snapshot.build(parse(PASSTHROUGH, env={}).config)
    r = passthrough(snap, "/v1/files", Caller("k-all", snap.keys["k-all"]), "openai", ["m-a"])
    assert r.backend.name == "b" and r.path is None  # sent as it came
    assert ("authorization", "Bearer sk-b") in r.set_headers
    # A key limited to some models or backends cannot reach unjudged endpoints.
    for key in ("k-chat", "k-a"):
        assert refusal(passthrough(snap, "/tokenize", Caller(key, snap.keys[key]), "openai", []))[0] == 403
    # A reserved model named on any path answers as an unknown one, in every spelling.
    unknown = decide(snap, req("/v1/chat/completions", {"model": "nope"}, snap=snap))
    for name in ("m-x", "m-x:nitro"):
        got = passthrough(snap, "/tokenize", Caller("k-all", snap.keys["k-all"]), "openai", ["m-a", name])
        assert got.status == 404 and got.reserved_by == "hidden"
        assert got.body == unknown.body.replace(b"nope", name.encode())


@pytest.mark.parametrize("path, row", [
    ("/v1/chat/completions/", "/v1/chat/completions"),
    ("/V1/Chat/Completions", "/v1/chat/completions"),
    ("/v1/messages", "/anthropic/v1/messages"),
    ("/v1/messages/", "/anthropic/v1/messages"),
    ("/v1/messages/count_tokens?beta=true", "/anthropic/v1/messages/count_tokens"),
    ("/v1/realtime/?model=chat", "/v1/realtime"),
])
def test_engine_spellings_resolve_to_their_row(path, row):
    assert lookup(path) is INGRESSES[row]


def test_listing_spellings_keep_the_model_id():
    from sidecar.routing.ingress import listing_path

    assert listing_path("/v1/models/") == "/v1/models"
    assert listing_path("/V1/Models/Org/Model-7B") == "/v1/models/Org/Model-7B"
    assert listing_path("/anthropic/v1/models?limit=5") == "/anthropic/v1/models"
    assert listing_path("/v1/modelsx") is None


@pytest.mark.parametrize("raw, expected", [
    ("/v1/chat/%63ompletions", "/v1/chat/completions"),
    ("//v1//chat/./completions?x=%2F", "/v1/chat/completions?x=%2F"),
    ("/v1/x/../chat/completions", "/v1/chat/completions"),
    ("/v1%2Fchat%2Fcompletions", "/v1/chat/completions"),
    ("/anthropic/v1/messages", "/anthropic/v1/messages"),
    ("/v1/models/a%2Fb", "/v1/models/a/b"),
])
def test_canonical_paths(raw, expected):
    from sidecar.routing.ingress import canonical

    assert canonical(raw) == expected


def test_every_ingress_row_is_reachable():
    for path, row in INGRESSES.items():
        assert lookup(path + "?q=1") is row
    assert lookup("/v1/batches") is None


@pytest.mark.parametrize("body", [
    b'{"model": "m-a", "user": "\\ud800"}',
    b'{"model": "\\udc00"}',
])
def test_lone_surrogates_are_400_not_a_crash(snap, body):
    status, payload = refusal(decide(snap, req("/v1/chat/completions", body, snap=snap)))
    assert status == 400 and payload["error"]["code"] == "invalid_json"


def test_integers_beyond_64_bits_still_route(snap):
    r = decide(snap, req("/v1/chat/completions", b'{"model": "chat", "seed": 123456789012345678901234567890}', snap=snap))
    assert r.upstream_model == "m-a"
    assert b"123456789012345678901234567890" in r.body


def test_engines_that_answer_with_their_own_name_get_the_requested_name_written_back():
    s = snapshot.build(parse("""
backends:
  - {name: llama, url: "http://127.0.0.1:1", type: llamacpp, models: [tiny, both]}
  - {name: tgi, url: "http://127.0.0.1:2", type: tgi, models: [t]}
  - {name: vllm, url: "http://127.0.0.1:3", type: vllm, models: [v, both]}
  - {name: hosted, url: "http://127.0.0.1:4", type: openai, models: [o]}
model_metadata:
  - {id: tiny, aliases: [small]}
""", env={}).config)
    for sent, backend, written in (("tiny", "llama", "tiny"), ("small", "llama", "tiny"), ("t", "tgi", "t"),
                                   ("v", "vllm", None), ("o", "hosted", None)):
        r = decide(s, req("/v1/chat/completions", {"model": sent, "messages": []}, key=None, snap=s))
        assert r.backend.name == backend and r.plan.rewrite_model == written, sent
        assert r.plan.needs_response == (written is not None), sent
    r = decide(s, req("/v1/chat/completions", {"model": "both", "messages": []}, key=None, snap=s, headers={"x-backend": "llama"}))
    # x-backend is a preference; whichever serves it, only llama.cpp's answer is renamed
    assert (r.plan.rewrite_model == "both") == (r.backend.name == "llama")

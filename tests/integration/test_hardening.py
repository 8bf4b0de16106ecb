"""What an attacker or a careless client tries, through real Envoy.

Every request that names a model meets the same gates whatever its path;
router-owned headers never reach a backend; header counts near Envoy's limit
are routed or refused with a 431, never a 503; every 4xx carries a code.
"""

from __future__ import annotations

import httpx
import pytest

from ..conftest import clear_demo_requests, demo_requests, envoy_stat
from .test_bad_input import check_error, raw_request

pytestmark = pytest.mark.integration

HIDDEN = """
backends:
  - {name: pool-a, url: "demo://", models: [model-a, plain]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_experiments:
  - name: split
    model: chat
    hide_variant_models: true
    response_headers: true
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 1}
"""

KEY = "sk-hardening-unrestricted"
PASSTHROUGH = HIDDEN + f"""
proxy: {{passthrough_backend: pool-a}}
api_keys:
  - {{key: {KEY}, id: open}}
"""
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def hidden(stack_factory):
    return stack_factory(HIDDEN)


@pytest.fixture(scope="module")
def passthrough(stack_factory):
    return stack_factory(PASSTHROUGH)


def unknown_reply(stack, path: str, name: str, headers: dict | None = None) -> httpx.Response:
    body = {"model": name, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(stack.url + path, json=body, headers=headers or {})


def served_model_requests(stack, model: str) -> list[dict]:
    return [
        rec for name in stack.demo_urls for rec in demo_requests(stack, name)
        if model in str(rec.get("json") or "") + str(rec.get("query") or "") + str(rec.get("body") or "")
    ]


# ------------------------------------------------------- 1. reserved models on every path


@pytest.mark.parametrize("path", [
    "/v1/messages", "/v1/messages/count_tokens", "/v1/messages/", "/V1/Messages",
    "/v1/chat/completions/", "/V1/CHAT/COMPLETIONS", "//v1//chat//completions",
    "/anthropic/v1/messages/", "/v1/responses/",
])
def test_a_reserved_model_is_unknown_on_every_spelling_of_an_ingress(hidden, path):
    """The engine spellings of a model endpoint are that endpoint: a hidden
    arm's model gets the unknown-model refusal, byte for byte."""
    clear_demo_requests(hidden)
    got = unknown_reply(hidden, path, "model-b")
    want = unknown_reply(hidden, path, "no-such-model")
    assert got.status_code == want.status_code == 404
    assert got.content == want.content.replace(b"no-such-model", b"model-b")
    assert got.headers["content-type"] == want.headers["content-type"]
    assert served_model_requests(hidden, "model-b") == []


@pytest.mark.parametrize("path, upstream", [
    ("/v1/messages", "/v1/messages"),
    ("/v1/chat/completions/", "/v1/chat/completions"),
    ("/V1/Chat/Completions", "/v1/chat/completions"),
])
def test_engine_spellings_are_decided_and_sent_canonical(hidden, path, upstream):
    clear_demo_requests(hidden)
    r = unknown_reply(hidden, path, "chat")
    assert r.status_code == 200, r.text
    assert r.headers["x-continuum-experiment"] == "split"
    seen = demo_requests(hidden, "pool-a") + demo_requests(hidden, "pool-b")
    assert [rec["path"] for rec in seen] == [upstream]
    assert seen[0]["json"]["model"] in ("model-a", "model-b")


def test_paths_outside_the_table_are_refused_by_default(hidden):
    clear_demo_requests(hidden)
    for method, path, family in (("GET", "/v1/files", "openai"), ("POST", "/tokenize", "openai"),
                                 ("POST", "/anthropic/v1/files", "anthropic")):
        r = httpx.request(method, hidden.url + path, json={"model": "model-b"} if method == "POST" else None)
        assert r.status_code == 404, r.text
        doc = check_error(r.status_code, r.headers, r.content, family)
        if family == "openai":
            assert doc["error"]["code"] == "unknown_endpoint"
        else:
            assert doc["error"]["type"] == "not_found_error"
    assert all(demo_requests(hidden, name) == [] for name in hidden.demo_urls)


def test_passthrough_judges_the_model_a_body_or_query_names(passthrough):
    """With proxy.passthrough_backend set, other paths are forwarded untouched,
    except that naming a reserved model answers as an unknown model would."""
    clear_demo_requests(passthrough)
    want = httpx.post(passthrough.url + "/v1/chat/completions", json={"model": "no-such-model"}, headers=AUTH)
    for name in ("model-b", "model-b:nitro"):
        expected = want.content.replace(b"no-such-model", name.encode())
        for request in (
            dict(method="POST", url="/tokenize", json={"model": name, "prompt": "hi"}),
            dict(method="POST", url="/v1/moderations", content=b'  {"input": "x",\n "model": "%s"}' % name.encode(),
                 headers={"content-type": "text/plain"}),
            dict(method="POST", url="/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")},
                 data={"model": name}),
            dict(method="GET", url=f"/v1/score?model=plain&model={name}"),
            dict(method="POST", url="/v1/embeddings/extra", json={"model": name}),
        ):
            for headers in ({}, AUTH):
                kw = dict(request)
                kw["headers"] = {**kw.get("headers", {}), **headers} if headers else kw.get("headers", {})
                kw["url"] = passthrough.url + kw["url"]
                r = httpx.request(**kw)
                if not headers:
                    assert r.status_code == 401  # api_keys configured: the key gate comes first
                    continue
                assert r.status_code == 404 and r.content == expected, (request["url"], r.text)
    assert served_model_requests(passthrough, "model-b") == []
    # A body naming a model the router does not reserve goes through untouched.
    r = httpx.post(passthrough.url + "/v1/moderations", json={"model": "plain", "input": "hi"}, headers=AUTH)
    assert r.status_code == 404  # the demo engine's own answer: it has no moderations API
    rec = demo_requests(passthrough, "pool-a")[-1]
    assert rec["path"] == "/v1/moderations" and rec["json"] == {"model": "plain", "input": "hi"}


def test_a_compressed_body_cannot_hide_its_model(passthrough):
    import gzip

    body = gzip.compress(b'{"model": "model-b"}')
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(passthrough.url + path, content=body,
                       headers={**AUTH, "content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_content_encoding"
    assert served_model_requests(passthrough, "model-b") == []


# ------------------------------------------------------------- 4. header counts


def test_header_counts_near_envoys_limit_are_routed_or_431(hidden):
    """Every request the listener accepts (up to Envoy's 100 headers) is routed
    or, past what the routing headers leave room for, a JSON 431; never a 503.
    Past the listener's limit Envoy 1.40's HTTP/1 codec closes the connection."""
    seen: dict[int, int] = {}
    for n in range(80, 101):
        # raw_request adds host, connection and content-length to these.
        sent = [(b"content-type", b"application/json")] + [(b"x-repeat", b"v%d" % i) for i in range(n - 4)]
        status, headers, out = raw_request(hidden.listen, "POST", b"/v1/chat/completions", sent,
                                           b'{"model": "chat", "messages": []}')
        seen[n] = status
        assert status in (200, 431), (n, status, out[:300])
        if status == 431:
            doc = check_error(status, headers, out, "openai")
            assert doc["error"]["code"] == "request_headers_too_large"
        else:
            assert headers["x-continuum-experiment"] == "split"
    assert seen[80] == 200 and seen[100] == 431
    assert sorted(seen.values()) == [seen[n] for n in sorted(seen)]  # 200s, then 431s
    # The sidecar refused what would not fit: Envoy rejected no header mutation.
    assert envoy_stat(hidden, "ext_proc.rejected_header_mutations") == 0
    status, _, _ = raw_request(hidden.listen, "POST", b"/v1/chat/completions",
                               [(b"x-repeat", b"v%d" % i) for i in range(98)], b"{}")
    assert status in (0, 431)


# ------------------------------------------------------ 5. router-owned request headers


def test_router_owned_headers_never_reach_a_backend(hidden):
    clear_demo_requests(hidden)
    forged = {
        "x-continuum-experiment": "forged", "x-continuum-experiment-variant": "forged",
        "x-continuum-model-variant": "forged", "X-Continuum-Model-Variant-Applied": "forged",
        "x-model-router-backend": "pool-b", "x-model-router-explain": "1", "x-continuum-anything": "forged",
    }
    for _ in range(4):
        r = httpx.post(hidden.url + "/v1/chat/completions", json={"model": "plain", "messages": []}, headers=forged)
        assert r.status_code == 200
        assert "x-continuum-experiment" not in r.headers  # no experiment resolved for 'plain'
    seen = demo_requests(hidden, "pool-a") + demo_requests(hidden, "pool-b")
    assert len(seen) == 4
    for rec in seen:
        owned = [h for h in rec["headers"] if h.lower().startswith(("x-continuum-", "x-model-router-"))]
        assert owned == [], owned


# ------------------------------------------------------------------ 6. error codes


@pytest.mark.parametrize("request_kw, status, code", [
    (dict(json={"model": "chat\u0007"}), 400, "invalid_model"),
    (dict(json={"model": "m" * 300}), 400, "invalid_model"),
    (dict(json={"model": 5}), 400, "missing_model"),
    (dict(json={"messages": []}), 400, "missing_model"),
    (dict(content=b"{nope"), 400, "invalid_json"),
])
def test_every_400_carries_a_code(hidden, request_kw, status, code):
    r = httpx.post(hidden.url + "/v1/chat/completions", headers={"content-type": "application/json"}, **request_kw)
    doc = check_error(r.status_code, r.headers, r.content, "openai")
    assert (r.status_code, doc["error"]["code"]) == (status, code)


def test_bad_multipart_and_wrong_method_carry_codes(hidden):
    r = httpx.post(hidden.url + "/v1/images/edits", content=b"--x\r\nbroken",
                   headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_multipart"
    r = httpx.post(hidden.url + "/v1/models", json={})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "GET, HEAD"

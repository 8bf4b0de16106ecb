"""The spine through real Envoy: routing, rewrites, refusals and limits."""

from __future__ import annotations

import subprocess

import httpx
import openai
import pytest

from sidecar.config.schema import parse
from sidecar.deploy import envoy as envoyconf
from sidecar.devstack.stack import envoy_binary

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, routed_again

pytestmark = pytest.mark.integration

CONFIG = """
server:
  max_body_bytes: 25165824      # 24 MiB
proxy: {passthrough_backend: alpha}
backends:
  - {name: alpha, url: "demo://", models: [m-alpha, shared]}
  - {name: beta, url: "demo://", models: [m-beta, shared]}
model_aliases: {old-name: m-beta}
model_experiments:
  - name: rename
    model: chat
    variants: [{id: only, model: m-beta, weight: 1}]
"""

NOT_FOUND = {
    "error": {
        "message": "The model 'no-such-model' does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
}


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="caller-1", max_retries=0)


def test_buffered_chat_through_envoy(stack, client):
    r = client.chat.completions.create(model="m-alpha", messages=[{"role": "user", "content": "hello"}])
    assert r.model == "m-alpha"
    assert r.choices[0].message.content.startswith("[alpha] m-alpha")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_through_envoy(stack, client):
    chunks = list(client.chat.completions.create(
        model="m-beta", messages=[{"role": "user", "content": "one two three"}], stream=True,
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("[beta] m-beta")
    assert {c.model for c in chunks} == {"m-beta"}
    assert all(c.usage is None for c in chunks)


def test_rewritten_model_reaches_upstream_with_correct_length(stack, client):
    clear_demo_requests(stack)
    r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x" * 1000}])
    assert r.choices[0].message.content.startswith("[beta] m-beta")
    seen = demo_requests(stack, "beta")
    assert len(seen) == 1 and demo_requests(stack, "alpha") == []
    got = seen[0]
    assert got["json"]["model"] == "m-beta"
    assert int(got["headers"]["content-length"]) == got["body_len"]
    assert got["json"]["messages"][0]["content"] == "x" * 1000


def test_unknown_model_404_in_openai_shape(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": []})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/json"
    assert r.json() == NOT_FOUND


def test_sdk_raises_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[])
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body, code, fragment",
    [
        (b'{"model": "m-alpha", ', "invalid_json", "not valid JSON"),
        (b"", "invalid_json", "empty"),
        (b"[1, 2]", "invalid_json", "JSON object"),
        (b'{"messages": []}', "missing_model", "no 'model' field"),
        (b'{"model": 42}', "missing_model", "must be a string"),
        (b'{"model": "   "}', "missing_model", "must not be empty"),
        (b'{"model": "m-\\u0000alpha"}', None, "control characters"),
        (b'{"model": "' + b"m" * 300 + b'"}', None, "longer than"),
    ],
)
def test_bad_request_bodies_get_400(stack, body, code, fragment):
    r = httpx.post(stack.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["code"] == code or code is None
    assert fragment in err["message"]


def test_body_of_20_mib_is_accepted(stack):
    clear_demo_requests(stack)
    content = "y" * (20 * 1024 * 1024)
    r = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": content}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text[:500]
    got = demo_requests(stack, "beta")[-1]
    assert got["json"]["model"] == "m-beta"
    assert got["body_len"] > 20 * 1024 * 1024


def test_body_over_limit_gets_413(stack):
    big = b'{"model": "m-alpha", "pad": "' + b"z" * (25 * 1024 * 1024) + b'"}'
    r = httpx.post(stack.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_limit_gets_413(stack):
    def chunks():
        yield b'{"model": "m-alpha", "pad": "'
        for _ in range(26):
            yield b"z" * (1024 * 1024)
        yield b'"}'

    r = httpx.post(stack.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"  # Envoy's reply, the sidecar's code


def test_client_routing_header_never_steers(stack):
    clear_demo_requests(stack)
    r = httpx.post(
        stack.url + "/v1/chat/completions",
        json={"model": "m-alpha", "messages": []},
        headers={"x-model-router-backend": "beta"},
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"].startswith("[alpha]")
    assert demo_requests(stack, "beta") == []
    # Nor on a path the sidecar passes through, nor toward a cluster that does not exist.
    httpx.get(stack.url + "/v1/files", headers={"x-model-router-backend": "beta"})
    assert demo_requests(stack, "beta") == []
    assert demo_requests(stack, "alpha")[-1]["path"] == "/v1/files"
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "m-beta", "messages": []},
                   headers={"x-model-router-backend": "model-router-sidecar"})
    assert r.status_code == 200 and r.json()["model"] == "m-beta"
    seen = demo_requests(stack, "alpha")
    assert all("x-model-router-backend" not in s["headers"] for s in seen)


def test_other_paths_pass_through_untouched(stack):
    clear_demo_requests(stack)
    r = httpx.get(stack.url + "/v1/files?x=1", headers={"authorization": "Bearer caller-1"})
    assert r.status_code == 404  # the demo engine's own answer: it has no files API
    got = demo_requests(stack, "alpha")[-1]
    assert got["path"] == "/v1/files" and got["query"] == {"x": "1"}
    assert got["headers"]["authorization"] == "Bearer caller-1"  # no api_keys section: credentials pass


def test_envoy_saw_no_ext_proc_errors(stack):
    assert envoy_stat(stack, "ext_proc.spurious_msgs_received") == 0
    assert envoy_stat(stack, "ext_proc.streams_failed") == 0
    assert envoy_stat(stack, "ext_proc.message_timeouts") == 0


KEYS_CONFIG = """
backends:
  - {name: alpha, url: "demo://", models: [m-alpha]}
  - {name: beta, url: "demo://", models: [m-beta]}
api_keys:
  - {key: sk-team-a, id: team-a, allowed_models: [m-alpha]}
  - {key: sk-team-b, id: team-b, allowed_backends: [beta]}
"""


@pytest.fixture(scope="module")
def keyed(stack_factory):
    return stack_factory(KEYS_CONFIG)


def test_missing_or_unknown_key_is_401_in_family_shape(keyed):
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"model": "m-alpha", "messages": []})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"model": "m-alpha"}, headers={"authorization": "Bearer nope"})
    assert r.status_code == 401
    r = httpx.post(keyed.url + "/anthropic/v1/messages", json={"model": "m-alpha", "max_tokens": 5, "messages": []})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "An API key is required (Authorization: Bearer or x-api-key)."}}
    # Listings and passthrough paths are gated too.
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert httpx.get(keyed.url + "/v1/files").status_code == 401


def test_router_key_never_travels_upstream(keyed):
    clear_demo_requests(keyed)
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"model": "m-alpha", "messages": []},
                   headers={"x-api-key": "sk-team-a"})
    assert r.status_code == 200
    got = demo_requests(keyed, "alpha")[-1]
    assert "authorization" not in got["headers"] and "x-api-key" not in got["headers"]


def test_key_gates(keyed):
    a = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-team-a", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as info:
        a.chat.completions.create(model="m-beta", messages=[])
    assert info.value.body["code"] == "model_not_permitted"
    b = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-team-b", max_retries=0)
    assert b.chat.completions.create(model="m-beta", messages=[]).model == "m-beta"
    with pytest.raises(openai.PermissionDeniedError):
        b.chat.completions.create(model="m-alpha", messages=[])


@pytest.mark.parametrize("config_text", [
    CONFIG,
    KEYS_CONFIG,
    """
backends:
  - {name: openai, url: "https://api.openai.com/v1", api_key: sk-x, models: [gpt-4o]}
  - {name: claude, url: "https://api.anthropic.com", type: anthropic, api_key: sk-y}
  - {name: local, url: "http://localhost:8000"}
server: {grpc_listen: "127.0.0.1:50051"}
""",
])
def test_generated_bootstrap_passes_envoy_validate(tmp_path, config_text):
    cfg = parse(config_text, env={}).config
    urls = {b.name: "http://127.0.0.1:9" for b in cfg.backends if b.is_demo}
    boot = envoyconf.bootstrap(cfg, backend_urls=urls)
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(boot))
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout + out.stderr
    clusters = {c["name"] for c in boot["static_resources"]["clusters"]}
    assert clusters == {b.name for b in cfg.backends} | {"model-router-sidecar"}
    tls = [c for c in boot["static_resources"]["clusters"] if "transport_socket" in c]
    assert {c["transport_socket"]["typed_config"]["sni"] for c in tls} == {
        b.url.split("/")[2] for b in cfg.backends if b.url.startswith("https")
    }


def test_sidecar_down_fails_closed_with_json_503(stack):
    """Runs last in this module: it stops and restarts the sidecar."""
    clear_demo_requests(stack)
    stack.stop_sidecar()
    try:
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": []})
        assert r.status_code == 503
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.get(stack.url + "/v1/files")
        assert r.status_code == 503
        assert demo_requests(stack, "alpha") == [] and demo_requests(stack, "beta") == []
    finally:
        stack.start_sidecar()
    assert routed_again(stack).json()["model"] == "m-beta"  # the restarted sidecar resolved it


def test_a_plain_request_costs_two_ext_proc_messages(keyed):
    """Nothing in the response needs the sidecar: request headers and body only."""
    before = envoy_stat(keyed, "ext_proc.stream_msgs_sent")
    for _ in range(5):
        r = httpx.post(keyed.url + "/v1/chat/completions", json={"model": "m-alpha", "messages": []},
                       headers={"authorization": "Bearer sk-team-a"})
        assert r.status_code == 200
    assert envoy_stat(keyed, "ext_proc.stream_msgs_sent") - before == 10

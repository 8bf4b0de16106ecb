"""Envoy's own replies to routed requests, through real Envoy: the model the
client asked for, what failed in plain words, the ingress's error shape, and
none of Envoy's internals."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .test_bad_input import check_error

pytestmark = pytest.mark.integration

CONFIG = """
envoy: {idle_timeout_s: 2, upstream_timeout_s: 0}
monitor: {passive_holdout_s: 0}
backends:
  - {name: gone, url: "http://127.0.0.1:9", models: [gone-model, claude-gone]}  # nothing listens
  - {name: slow, url: "demo://", models: [slow-model]}
model_experiments:
  - name: split
    model: chat
    variants: [{id: only, model: gone-model, weight: 1}]
"""
# What Envoy would otherwise tell a client about itself.
INTERNALS = ("upstream connect error", "disconnect/reset", "delayed_connect", "connection_failure", "_",
             "upstream_response_timeout", "%")


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def plain(message: str) -> None:
    assert not any(word in message for word in INTERNALS), message


def test_an_unreachable_backend_is_named_by_the_clients_model(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": []})
    doc = check_error(r.status_code, r.headers, r.content, "openai")
    assert r.status_code == 503 and doc["error"]["code"] == "upstream_unavailable", doc
    assert doc["error"]["message"] == (
        "The backend serving the model 'chat' could not be reached or closed the connection; retry shortly.")
    assert "gone-model" not in r.text  # the arm's model stays the router's business
    plain(doc["error"]["message"])
    assert r.headers["retry-after"] == "1"


def test_the_anthropic_ingress_gets_the_same_in_its_shape(stack):
    client = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="any", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as exc:
        client.messages.create(model="claude-gone", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    r = exc.value.response
    doc = check_error(r.status_code, r.headers, r.content, "anthropic")
    assert doc["error"]["type"] == "api_error"
    assert "'claude-gone'" in doc["error"]["message"] and "could not be reached" in doc["error"]["message"]
    plain(doc["error"]["message"])


def test_a_silent_backend_is_a_timeout_named_by_the_model(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="any", max_retries=0,
                           default_headers={"x-demo-delay-ms": "4500"})
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="slow-model", messages=[])
    r = exc.value.response
    doc = check_error(r.status_code, r.headers, r.content, "openai")
    assert r.status_code == 504 and doc["error"]["code"] == "upstream_timeout", doc
    assert doc["error"]["message"] == "Timeout: the backend serving the model 'slow-model' did not answer in time."
    assert r.headers["x-should-retry"] == "false"

"""Envoy's own error replies take the shape of the API family the request used."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ..conftest import clear_demo_requests, demo_requests

pytestmark = pytest.mark.integration

CONFIG = """
monitor: {passive_holdout_s: 0}
backends:
  - {name: gone, url: "http://127.0.0.1:9", models: [claude-gone, gpt-gone]}  # nothing listens
"""


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def test_an_unreachable_backend_answers_anthropic_callers_in_anthropic_shape(stack):
    """The sidecar rewrote /anthropic/v1/messages to /v1/messages; the reply
    is shaped by the family the decision recorded, not by the path."""
    client = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="any", max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as exc:
        client.messages.create(model="claude-gone", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 503
    body = exc.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error", body
    assert body["error"]["message"]


def test_an_unreachable_backend_answers_openai_callers_in_openai_shape(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "gpt-gone", "messages": []})
    assert r.status_code == 503
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "upstream_unavailable"


# --------------------------------------------------------------------------- timeouts

TIMEOUTS = """
envoy: {idle_timeout_s: 2, upstream_timeout_s: 0}
monitor: {passive_holdout_s: 0}
backends:
  - {name: slow, url: "demo://", models: [slow-model]}
"""


@pytest.fixture(scope="module")
def slow(stack_factory):
    return stack_factory(TIMEOUTS)


def test_a_stream_outlives_the_idle_timeout_while_it_keeps_producing(slow):
    """40 events 100 ms apart, paced by the engine: 4 s in all, never 2 s silent
    (a wide margin, so a busy machine's scheduling cannot fake a silence)."""
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="any",
                           default_headers={"x-demo-events": "40", "x-demo-interval-ms": "100"})
    chunks = list(client.chat.completions.create(model="slow-model", messages=[], stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks if c.choices) == 40


def test_a_silent_upstream_gets_a_504_the_sdk_does_not_retry(slow):
    clear_demo_requests(slow)
    client = openai.OpenAI(base_url=slow.url + "/v1", api_key="any", max_retries=2,
                           default_headers={"x-demo-delay-ms": "4500"})
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="slow-model", messages=[])
    assert exc.value.status_code == 504
    assert exc.value.response.headers["x-should-retry"] == "false"
    assert set(exc.value.response.json()["error"]) == {"message", "type", "param", "code"}
    assert exc.value.response.json()["error"]["code"] == "upstream_timeout"
    assert len(demo_requests(slow, "slow")) == 1  # one upstream attempt, not three

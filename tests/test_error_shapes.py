"""Envoy's own error replies take the shape of the API family the request used."""

from __future__ import annotations

import anthropic
import httpx
import pytest

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

"""A stream whose upstream falls silent ends with an error event, not a reset.

Envoy's idle timer resets a stream whose headers are out; the response
processor ends an event stream it handles a little before that timer, with
an error event in the ingress's family shape, which the official SDKs raise
as an API error. Real Envoy, demo engines paced by ``x-demo-interval-ms``.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .conftest import metric

CONFIG = """
envoy: {idle_timeout_s: 2}
backends:
  - {name: pool, url: "demo://", models: [m-up]}
model_experiments:
  - name: cut
    model: chat
    response_model: client
    variants: [{id: only, model: m-up, weight: 1}]
"""
SILENT = {"x-demo-interval-ms": "6000"}  # far past the 2 s idle timeout between events
PACED = {"x-demo-interval-ms": "400", "x-demo-events": "8"}  # 3 s in all, never 2 s silent


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def test_a_silent_openai_stream_ends_with_an_error_the_sdk_raises(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0, timeout=60)
    before = metric(stack, "model_router_streams_cut_total", reason="idle")
    got = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "one two three"}], stream=True, extra_headers=SILENT,
        ):
            got.append(chunk)
    assert got and {c.model for c in got} == {"chat"}  # what came before the silence, rewritten
    assert info.value.body["code"] == "upstream_timeout"
    assert "sent nothing for 1.5 seconds" in info.value.message
    assert metric(stack, "model_router_streams_cut_total", reason="idle") == before + 1


def test_the_raw_stream_ends_cleanly_after_the_error_event(stack):
    body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=60) as http:
        r = http.post(stack.url + "/v1/chat/completions", json=body, headers=SILENT)
    assert r.status_code == 200  # a complete response, not a transport error
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1].startswith('data: {"error":')
    assert "[DONE]" not in r.text


def test_a_silent_anthropic_stream_ends_with_an_error_event(stack):
    client = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="k", max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as info:
        with client.messages.stream(
            model="chat", max_tokens=50, messages=[{"role": "user", "content": "hi there"}], extra_headers=SILENT,
        ) as s:
            for _ in s:
                pass
    assert info.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "The upstream sent nothing for 1.5 seconds; the router ended the stream."}}


def test_a_slow_stream_that_is_never_silent_that_long_completes(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "x"}], stream=True, extra_headers=PACED,
    ))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 8
    assert chunks[-1].choices[0].finish_reason == "stop"

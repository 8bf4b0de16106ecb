"""A stream whose upstream falls silent ends with an error event, and the
upstream request is reset.

Envoy's idle timer resets a stream whose headers are out; the response
processor ends an event stream it handles a little before that timer, with
an error event in the ingress's family shape, which the official SDKs raise
as an API error, then resets the upstream request (the engine stops
generating for a caller that is gone). The cut is an upstream timeout in the
per-arm metrics and the usage record. Real Envoy, demo engines paced by
``x-demo-interval-ms``.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, metered, metric

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


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def records(stack) -> list[dict]:
    return [json.loads(line) for line in stack.usage_records.read_text().splitlines()]


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never: {what}")
        time.sleep(0.1)


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


def test_the_cut_resets_the_upstream_and_is_recorded_as_a_timeout(stack):
    clear_demo_requests(stack)
    before = metric(stack, "model_experiment_requests_total", experiment="cut", variant="only", status="server_error")
    body = {"model": "chat", "stream": True, "max_tokens": 30, "messages": [{"role": "user", "content": "hi"}]}
    got = b""
    with httpx.Client(timeout=60) as http:
        with pytest.raises(httpx.RemoteProtocolError):  # the client's stream is reset after the event
            with http.stream("POST", stack.url + "/v1/chat/completions", json=body, headers=SILENT) as r:
                request_id = r.headers["x-request-id"]
                for chunk in r.iter_raw():
                    got += chunk
    events = [e for e in got.decode().split("\n\n") if e]
    assert events[-1].startswith('data: {"error":') and "upstream_timeout" in events[-1]
    assert "[DONE]" not in got.decode()
    # Envoy reset the upstream request: the engine saw its caller go, and nothing stays active.
    chats = lambda: [x for x in demo_requests(stack, "pool") if x.get("path") == "/v1/chat/completions"]  # noqa: E731
    wait_for(lambda: envoy_stat(stack, "cluster.pool.upstream_rq_active", exact=True) == 0, "upstream request ended")
    wait_for(lambda: any(x.get("disconnected") for x in chats()), "the engine saw the reset")
    assert "envoy_bug" not in stack.log("envoy")
    # An error on its arm, and a record that says so, charged its estimate.
    assert metered(stack)
    assert metric(stack, "model_experiment_requests_total", experiment="cut", variant="only",
                  status="server_error") == before + 1
    record = next(r for r in records(stack) if r["request_id"] == request_id)
    assert record["status"] == 504 and record["estimated"] is True
    # The completion is what was streamed before the cut (the events the client got), not max_tokens.
    assert record["completion_tokens"] == len(events) - 1 and record["prompt_tokens"] > 0


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

"""Tests for the demo engine, driven through the official OpenAI and Anthropic SDKs and httpx."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from aiohttp import web

from sidecar.devstack.demo.engine import SPLIT_WORD, add_arguments, build_app, start
from sidecar.devstack.stack import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class RunningEngine:
    """A demo engine serving on loopback from a background thread with its own event loop."""

    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    runner: web.AppRunner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=10)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="x", max_retries=0, timeout=10)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _launch(make_runner: Callable[[], Coroutine[Any, Any, web.AppRunner]]) -> RunningEngine:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="demo-engine", daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(make_runner(), loop).result(10)
    port = next(addr[1] for addr in runner.addresses if isinstance(addr, tuple))
    return RunningEngine(port=port, loop=loop, thread=thread, runner=runner)


def launch(name: str = "alpha", models: list[str] | None = None) -> RunningEngine:
    """Start an engine through the public ``start()`` on an OS-chosen free port."""
    chosen = ["m-one", "m-two"] if models is None else models
    return _launch(lambda: start("127.0.0.1", 0, name=name, models=chosen))


def launch_app(app: web.Application) -> RunningEngine:
    async def make() -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    return _launch(make)


@pytest.fixture
def engine() -> Iterator[RunningEngine]:
    running = launch()
    try:
        yield running
    finally:
        running.stop()


def metric_values(text: str) -> dict[str, tuple[str, float]]:
    """Map each sample name in Prometheus text to its (labels, value)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        out[name] = (labels.rstrip("}"), float(value))
    return out


def word_count(text: str) -> int:
    return len(text.split())


# ---------------------------------------------------------------------- basics


def test_health_and_models_list(engine: RunningEngine) -> None:
    with engine.http() as http:
        health = http.get("/health")
    assert health.status_code == 200
    assert health.headers["content-type"] == "application/json"
    assert health.json() == {"status": "ok"}

    models = engine.openai().models.list()
    assert [m.id for m in models.data] == ["m-one", "m-two"]
    assert {m.owned_by for m in models.data} == {"alpha"}
    assert {m.object for m in models.data} == {"model"}
    assert len({m.created for m in models.data}) == 1


def test_prices_are_reported_per_model() -> None:
    running = launch_app(build_app(name="priced", models=["a", "b"], prices={"a": {"input": 1.5, "output": 2}}))
    try:
        with running.http() as http:
            data = http.get("/v1/models").json()["data"]
    finally:
        running.stop()
    assert data[0]["pricing"] == {"input": 1.5, "output": 2}
    assert "pricing" not in data[1]


# ------------------------------------------------------------------ OpenAI chat


def test_chat_buffered_names_engine_and_model(engine: RunningEngine) -> None:
    client = engine.openai()
    resp = client.chat.completions.create(
        model="m-two",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": [{"type": "text", "text": "what is   routing?"}]},
        ],
    )
    text = resp.choices[0].message.content
    assert resp.model == "m-two"
    assert resp.object == "chat.completion"
    assert text == "[alpha] m-two: what is routing?"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == 9
    assert resp.usage.completion_tokens == word_count(text)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_reasoning_effort_and_token_cap(engine: RunningEngine) -> None:
    client = engine.openai()
    long_prompt = "word " * 100
    resp = client.chat.completions.create(
        model="m-one",
        messages=[{"role": "user", "content": long_prompt}],
        reasoning_effort="high",
        max_completion_tokens=3,
    )
    text = resp.choices[0].message.content
    assert text.startswith("[alpha] m-one: word word")
    assert text.endswith(" (effort=high)")
    assert len(text) <= len("[alpha] m-one: ") + 200 + len(" (effort=high)")
    assert resp.usage.prompt_tokens == 100
    assert resp.usage.completion_tokens == 3

    capped = client.chat.completions.create(
        model="m-one", messages=[{"role": "user", "content": "a b c d e f"}], max_tokens=2
    )
    assert capped.usage.completion_tokens == 2


def test_chat_stream_without_usage(engine: RunningEngine) -> None:
    client = engine.openai()
    chunks = list(
        client.chat.completions.create(
            model="m-one", messages=[{"role": "user", "content": "stream me please"}], stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert "".join(contents) == "[alpha] m-one: stream me please"
    assert len(contents) == 5
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.object == "chat.completion.chunk" and c.model == "m-one" for c in chunks)
    assert all(c.usage is None and "usage" not in c.model_fields_set for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_with_include_usage(engine: RunningEngine) -> None:
    client = engine.openai()
    chunks = list(
        client.chat.completions.create(
            model="m-two",
            messages=[{"role": "user", "content": "count my tokens"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    earlier = chunks[:-1]
    assert all("usage" in c.model_fields_set and c.usage is None for c in earlier)
    assert earlier[-1].choices[0].finish_reason == "stop"
    content_chunks = [c for c in earlier if c.choices and c.choices[0].delta.content]
    assert final.usage.completion_tokens == len(content_chunks) == 5
    assert final.usage.prompt_tokens == 3
    assert final.usage.total_tokens == 8


def test_chat_stream_raw_sse_framing(engine: RunningEngine) -> None:
    with engine.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": "m-one", "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    assert resp.headers["content-type"] == "text/event-stream"
    events = resp.text.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])


def test_text_completions_buffered_and_streamed(engine: RunningEngine) -> None:
    client = engine.openai()
    buffered = client.completions.create(model="m-one", prompt="once upon a time")
    assert buffered.object == "text_completion"
    assert buffered.model == "m-one"
    assert buffered.choices[0].text == "[alpha] m-one: once upon a time"
    assert buffered.usage.prompt_tokens == 4
    assert buffered.usage.completion_tokens == 6

    chunks = list(
        client.completions.create(
            model="m-two", prompt="once upon", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "[alpha] m-two: once upon"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


# ----------------------------------------------------- embeddings and responses


def test_embeddings_float_and_base64_agree(engine: RunningEngine) -> None:
    client = engine.openai()
    default = client.embeddings.create(model="m-one", input=["alpha beta", "gamma"])
    as_float = client.embeddings.create(model="m-one", input=["alpha beta", "gamma"], encoding_format="float")
    single = client.embeddings.create(model="m-two", input="alpha beta", encoding_format="float")
    assert default.model == "m-one" and single.model == "m-two"
    assert [len(d.embedding) for d in as_float.data] == [8, 8]
    assert [d.embedding for d in default.data] == [d.embedding for d in as_float.data]
    assert single.data[0].embedding == as_float.data[0].embedding
    assert as_float.data[0].embedding != as_float.data[1].embedding
    assert all(-1.0 <= x < 1.0 for d in as_float.data for x in d.embedding)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == 3

    with engine.http() as http:
        records = http.get("/_demo/requests").json()
    assert records[0]["json"]["encoding_format"] == "base64"


def test_responses_api(engine: RunningEngine) -> None:
    client = engine.openai()
    resp = client.responses.create(
        model="m-two",
        instructions="answer briefly",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "why route models"}]}],
        reasoning={"effort": "low"},
    )
    assert resp.object == "response"
    assert resp.model == "m-two"
    assert resp.output_text == "[alpha] m-two: why route models (effort=low)"
    assert resp.usage.input_tokens == 5
    assert resp.usage.output_tokens == word_count(resp.output_text)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_responses_are_stored_streamed_and_followed_up(engine: RunningEngine) -> None:
    client = engine.openai()
    first = client.responses.create(model="m-one", input="remember this")
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [c.text for i in items.data for c in i.content] == ["remember this"]
    with client.responses.create(model="m-one", input="and this", previous_response_id=first.id, stream=True) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    done = events[-1].response
    assert done.previous_response_id == first.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert client.responses.retrieve(done.id).output_text == done.output_text
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="m-one", input="x", previous_response_id="resp_nope")
    assert bad.value.code == "previous_response_not_found"

    queued = client.responses.create(model="m-one", input="later", background=True)
    assert queued.status == "queued"
    assert client.responses.cancel(queued.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(first.id)  # not a background response
    later = client.responses.create(model="m-one", input="later", background=True)
    assert client.responses.retrieve(later.id).status == "completed"

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(model="m-one", input="forget", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# -------------------------------------------------------------------- Anthropic


def test_anthropic_messages_buffered(engine: RunningEngine) -> None:
    client = engine.anthropic()
    msg = client.messages.create(
        model="m-one",
        max_tokens=100,
        system="you are terse",
        messages=[{"role": "user", "content": "hello claude"}],
    )
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.model == "m-one"
    assert msg.content[0].type == "text"
    assert msg.content[0].text == "[alpha] m-one: hello claude"
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens == 5
    assert msg.usage.output_tokens == 4

    count = client.messages.count_tokens(
        model="m-one", system="you are terse", messages=[{"role": "user", "content": "hello claude"}]
    )
    assert count.input_tokens == msg.usage.input_tokens


def test_anthropic_messages_stream(engine: RunningEngine) -> None:
    client = engine.anthropic()
    with client.messages.stream(
        model="m-two",
        max_tokens=100,
        messages=[{"role": "user", "content": [{"type": "text", "text": "stream this reply"}]}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "[alpha] m-two: stream this reply"
    assert final.model == "m-two"
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == 3
    assert final.usage.output_tokens == word_count(text)


def test_anthropic_raw_event_sequence(engine: RunningEngine) -> None:
    with engine.http() as http:
        resp = http.post(
            "/v1/messages",
            json={"model": "m-one", "max_tokens": 2, "messages": [{"role": "user", "content": "a b c"}], "stream": True},
        )
    assert resp.headers["content-type"] == "text/event-stream"
    names = []
    payloads = []
    for block in resp.text.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        names.append(event_line.removeprefix("event: "))
        payloads.append(orjson.loads(data_line.removeprefix("data: ")))
        assert payloads[-1]["type"] == names[-1]
    words = word_count("[alpha] m-one: a b c")
    assert names == (
        ["message_start", "content_block_start"]
        + ["content_block_delta"] * words
        + ["content_block_stop", "message_delta", "message_stop"]
    )
    assert payloads[0]["message"]["model"] == "m-one"
    assert payloads[0]["message"]["usage"]["input_tokens"] == 3
    assert payloads[-2]["usage"]["output_tokens"] == 2


# ------------------------------------------------------------------ model checks


def test_unknown_model_is_404_in_each_api_shape(engine: RunningEngine) -> None:
    with engine.http() as http:
        chat = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        msgs = http.post("/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": []})
    assert chat.status_code == 404
    assert chat.headers["content-type"] == "application/json"
    error = chat.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    assert error["code"] == "model_not_found"
    assert "nope" in error["message"]
    assert msgs.status_code == 404
    body = msgs.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "nope" in body["error"]["message"]

    with pytest.raises(openai.NotFoundError):
        engine.openai().embeddings.create(model="nope", input="x")
    with pytest.raises(anthropic.NotFoundError):
        engine.anthropic().messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_empty_model_list_serves_any_model() -> None:
    running = launch(name="anything", models=[])
    try:
        resp = running.openai().chat.completions.create(
            model="whatever/model-7b", messages=[{"role": "user", "content": "hi"}]
        )
        with running.http() as http:
            listed = http.get("/v1/models").json()
    finally:
        running.stop()
    assert resp.model == "whatever/model-7b"
    assert resp.choices[0].message.content == "[anything] whatever/model-7b: hi"
    assert listed == {"object": "list", "data": []}


# --------------------------------------------------------------------- images


def test_image_generation_and_multipart_edit(engine: RunningEngine) -> None:
    generated = engine.openai().images.generate(model="m-one", prompt="a red fox", n=2)
    assert len(generated.data) == 2
    assert generated.data[0].revised_prompt == "[alpha] m-one: a red fox"
    assert base64.b64decode(generated.data[0].b64_json).startswith(PNG_MAGIC)

    with engine.http() as http:
        http.delete("/_demo/requests")
        edit = http.post(
            "/v1/images/edits",
            data={"model": "m-two", "prompt": "add a hat"},
            files={"image": ("fox.png", PNG_MAGIC + b"\x00" * 64, "image/png")},
        )
        records = http.get("/_demo/requests").json()
    assert edit.status_code == 200
    assert edit.headers["content-type"] == "application/json"
    body = edit.json()
    assert body["model"] == "m-two"
    assert body["data"][0]["revised_prompt"] == "[alpha] m-two: add a hat"
    assert base64.b64decode(body["data"][0]["b64_json"]).startswith(PNG_MAGIC)
    (record,) = records
    assert record["path"] == "/v1/images/edits"
    assert record["json"] is None
    assert record["form"] == {"model": "m-two", "prompt": "add a hat"}
    assert record["headers"]["content-type"].startswith("multipart/form-data; boundary=")
    assert record["body_len"] == int(record["headers"]["content-length"]) > 72


def test_image_edit_through_openai_sdk(engine: RunningEngine) -> None:
    edit = engine.openai().images.edit(
        model="m-one", prompt="make it blue", image=("in.png", PNG_MAGIC + b"\x01" * 8, "image/png")
    )
    assert edit.data[0].revised_prompt == "[alpha] m-one: make it blue"


# ------------------------------------------------------- metrics and test hooks


def test_generation_counter_rises_by_completion_tokens(engine: RunningEngine) -> None:
    with engine.http() as http:
        before = http.get("/metrics")
        assert before.headers["content-type"].startswith("text/plain")
        assert "# TYPE vllm:generation_tokens_total counter" in before.text
        assert "# TYPE vllm:num_requests_running gauge" in before.text
        assert "# TYPE vllm:num_requests_waiting gauge" in before.text
        start_value = metric_values(before.text)["vllm:generation_tokens_total"]
        assert start_value == ('model_name="m-one"', 0.0)

        chat = engine.openai().chat.completions.create(
            model="m-two", messages=[{"role": "user", "content": "one two three"}]
        )
        msg = engine.anthropic().messages.create(
            model="m-one", max_tokens=50, messages=[{"role": "user", "content": "four"}]
        )
        produced = chat.usage.completion_tokens + msg.usage.output_tokens
        after = metric_values(http.get("/metrics").text)["vllm:generation_tokens_total"][1]
        assert after == produced

        state = http.post("/_demo/state", json={"waiting": 4, "running": 2, "extra_generation_tokens": 10})
        assert state.status_code == 200
        values = metric_values(http.get("/metrics").text)
    assert values["vllm:num_requests_waiting"] == ('model_name="m-one"', 4.0)
    assert values["vllm:num_requests_running"] == ('model_name="m-one"', 2.0)
    assert values["vllm:generation_tokens_total"][1] == produced + 10


def test_running_gauge_counts_in_flight_streams(engine: RunningEngine) -> None:
    with engine.http() as http, engine.http() as streamer:
        with streamer.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "m-one", "messages": [{"role": "user", "content": "slow"}], "stream": True},
            headers={"x-demo-interval-ms": "50", "x-demo-events": "6"},
        ) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            during = metric_values(http.get("/metrics").text)["vllm:num_requests_running"][1]
            list(lines)
        after = metric_values(http.get("/metrics").text)["vllm:num_requests_running"][1]
    assert during == 1.0
    assert after == 0.0


def test_unhealthy_state_fails_health_and_api(engine: RunningEngine) -> None:
    with engine.http() as http:
        assert http.post("/_demo/state", json={"healthy": False}).json()["healthy"] is False
        health = http.get("/health")
        chat = http.post("/v1/chat/completions", json={"model": "m-one", "messages": []})
        msgs = http.post("/v1/messages", json={"model": "m-one", "max_tokens": 1, "messages": []})
        assert health.status_code == 503
        assert chat.status_code == 503 and "error" in chat.json()
        assert msgs.status_code == 503 and msgs.json()["type"] == "error"
        http.post("/_demo/state", json={"healthy": True})
        assert http.get("/health").status_code == 200
        bad = http.post("/_demo/state", json={"waiting": "many"})
    assert bad.status_code == 400


def test_state_hooks_stand_in_for_another_engine(engine: RunningEngine) -> None:
    page = '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{tp_rank="0"} 6.0\n'
    with engine.http() as http:
        state = http.post("/_demo/state", json={"metrics_page": page, "health_fail_next": 2, "health_delay_ms": 1})
        assert state.json()["metrics_page"] == page and state.json()["health_fail_next"] == 2
        served = http.get("/metrics")
        assert served.status_code == 200 and served.text == page
        assert served.headers["content-type"].startswith("text/plain")
        assert [http.get("/health").status_code for _ in range(3)] == [503, 503, 200]
        http.post("/_demo/state", json={"metrics_enabled": False})
        off = http.get("/metrics")
        assert off.status_code == 404 and off.json() == {"detail": "Not Found"}
        state = http.post("/_demo/state", json={"metrics_enabled": True, "metrics_page": None}).json()
        assert state["health_checks"] == 3 and state["metrics_scrapes"] == 2
        assert "vllm:num_requests_waiting" in http.get("/metrics").text
        for bad in ({"metrics_page": 3}, {"metrics_enabled": "no"}, {"health_delay_ms": -1},
                    {"health_fail_next": True}):
            assert http.post("/_demo/state", json=bad).status_code == 400


def test_requests_are_recorded_and_cleared(engine: RunningEngine) -> None:
    client = engine.openai()
    client.chat.completions.create(
        model="m-one",
        messages=[{"role": "user", "content": "record me"}],
        extra_headers={"X-Tenant-Id": "team-7"},
        extra_query={"api-version": "2024-01-01"},
    )
    engine.anthropic().messages.create(model="m-two", max_tokens=9, messages=[{"role": "user", "content": "me too"}])
    with engine.http() as http:
        http.get("/health")
        http.get("/metrics")
        records = http.get("/_demo/requests").json()
        assert [r["path"] for r in records] == ["/v1/chat/completions", "/v1/messages"]
        chat, msg = records
        assert chat["method"] == "POST"
        assert chat["query"] == {"api-version": "2024-01-01"}
        assert chat["headers"]["x-tenant-id"] == "team-7"
        assert chat["headers"]["authorization"] == "Bearer x"
        assert all(name == name.lower() for name in chat["headers"])
        assert chat["json"]["messages"] == [{"role": "user", "content": "record me"}]
        assert chat["form"] is None
        assert chat["body_len"] == int(chat["headers"]["content-length"])
        assert msg["headers"].get("x-api-key") == "x" or msg["headers"].get("authorization") == "Bearer x"
        assert "anthropic-version" in msg["headers"]
        assert msg["json"]["model"] == "m-two"

        assert http.delete("/_demo/requests").status_code == 200
        assert http.get("/_demo/requests").json() == []


def test_request_log_keeps_the_most_recent_thousand(engine: RunningEngine) -> None:
    with engine.http() as http:
        for i in range(1005):
            http.get("/v1/models", params={"i": str(i)})
        records = http.get("/_demo/requests").json()
    assert len(records) == 1000
    assert records[0]["query"] == {"i": "5"}
    assert records[-1]["query"] == {"i": "1004"}


def test_status_header_injects_openai_error(engine: RunningEngine) -> None:
    with engine.http() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"model": "m-one", "messages": [{"role": "user", "content": "x"}]},
            headers={"x-demo-status": "429"},
        )
        recorded = http.get("/_demo/requests").json()
    assert resp.status_code == 429
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["type"] == "rate_limit_error"
    assert "429" in resp.json()["error"]["message"]
    assert recorded[-1]["headers"]["x-demo-status"] == "429"
    with pytest.raises(openai.InternalServerError):
        engine.openai().chat.completions.create(
            model="m-one", messages=[{"role": "user", "content": "x"}], extra_headers={"x-demo-status": "502"}
        )


def test_events_and_interval_headers_shape_the_stream(engine: RunningEngine) -> None:
    client = engine.openai()
    chunks = list(
        client.chat.completions.create(
            model="m-one",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-demo-events": "12", "x-demo-interval-ms": "10"},
        )
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 12
    assert "".join(content).split(" ")[:4] == ["[alpha]", "m-one:", "hi", "[alpha]"]
    assert chunks[-1].usage.completion_tokens == 12

    with engine.anthropic().messages.stream(
        model="m-two",
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-demo-events": "2"},
    ) as stream:
        assert "".join(stream.text_stream) == "[alpha] m-two:"


def _chunked_pieces(port: int, path: str, body: dict, headers: dict[str, str]) -> list[bytes]:
    """POST over a raw socket and return the HTTP/1.1 chunks of the response body, one per server write."""
    payload = orjson.dumps(body)
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {len(payload)}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + payload)
        raw = b""
        while data := sock.recv(65536):
            raw += data
    status_and_headers, _, rest = raw.partition(b"\r\n\r\n")
    assert status_and_headers.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in status_and_headers.lower()
    pieces = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return pieces
        pieces.append(rest[:size])
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]


def test_split_header_writes_events_in_awkward_pieces(engine: RunningEngine) -> None:
    body = {"model": "m-one", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    whole = _chunked_pieces(engine.port, "/v1/chat/completions", body, {})
    split = _chunked_pieces(engine.port, "/v1/chat/completions", body, {"x-demo-split": "1"})
    assert len(split) > 3 * len(whole)
    assert b"".join(split).decode().count("data: ") == len(whole) + 1
    assert SPLIT_WORD.encode() in b"".join(split)
    assert b"da" in split and any(p.startswith(b"ta: ") for p in split)

    def undecodable(piece: bytes) -> bool:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            return True
        return False

    assert any(undecodable(p) for p in split)

    crlf = _chunked_pieces(
        engine.port, "/v1/messages", {**body, "max_tokens": 10}, {"x-demo-split": "1", "x-demo-crlf": "1"}
    )
    joined = b"".join(crlf)
    assert joined.startswith(b"event: message_start\r\ndata: {")
    assert b"\n\n" not in joined.replace(b"\r\n", b"")
    assert any(p.endswith(b"\r\n\r") for p in crlf) and b"\n" in crlf


def test_sdks_reassemble_split_crlf_streams(engine: RunningEngine) -> None:
    hooks = {"x-demo-split": "1", "x-demo-crlf": "1"}
    chunks = engine.openai().chat.completions.create(
        model="m-two", messages=[{"role": "user", "content": "naïve café"}], stream=True, extra_headers=hooks
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"[alpha] m-two: naïve café {SPLIT_WORD}"

    with engine.anthropic().messages.stream(
        model="m-one", max_tokens=100, messages=[{"role": "user", "content": "über"}], extra_headers=hooks
    ) as stream:
        assert "".join(stream.text_stream) == f"[alpha] m-one: über {SPLIT_WORD}"
        assert stream.get_final_message().usage.output_tokens == 4


# -------------------------------------------------------------------------- CLI


def test_add_arguments_defaults_and_repeatable_model() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args(["--port", "9"])
    assert (defaults.host, defaults.port, defaults.name, defaults.model) == ("127.0.0.1", 9, "demo", ["demo-model"])
    several = parser.parse_args(["--port", "9", "--model", "a", "--model", "b"])
    assert several.model == ["a", "b"]
    assert parser.parse_args(["--port", "9"]).model == ["demo-model"]
    with pytest.raises(SystemExit):
        parser.parse_args([])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_serves_until_signalled(sig: signal.Signals) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with subprocess.Popen(
        [sys.executable, "-m", "sidecar.devstack.demo.engine", "--port", str(port), "--name", "cli", "--model", "x1"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            line = proc.stdout.readline()
            assert line == f"demo engine cli listening on http://127.0.0.1:{port}\n"
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
                assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["x1"]
            proc.send_signal(sig)
            assert proc.wait(timeout=10) == 0
            assert proc.stdout.read() == ""
            assert "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

"""``response_model: client`` through real Envoy: the client gets the upstream's
bytes, with only the model value changed.

The upstream is a scripted aiohttp server that answers each request with the
raw bytes its ``x-script`` header names, written in several pieces (split
inside the ``data:`` prefix, inside the model value, inside a UTF-8 character
and between ``\\r`` and ``\\n``) so the sidecar sees events cut anywhere.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson
import pytest
from aiohttp import web

from sidecar.payload.response_ids import Owner, derive, tag

from ..conftest import metric, wait_metric

pytestmark = pytest.mark.integration

UPSTREAM = b'"up-model"'
CLIENT = b'"chat"'

JSON_BODY = (
    b'{\n'
    b'  "id" : "chatcmpl-1",\n'
    b'  "object": "chat.completion",\n'
    b'  "model":   "up-model",\n'
    b'  "choices": [ {"index": 0, "message": {"role": "assistant", '
    b'"content": "caf\\u00e9 \\"model\\": \\"x\\" \xc3\xa9", "model": "nested"}, "finish_reason": "stop"} ],\n'
    b'  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}\n'
    b'}\n'
)

CHAT_SSE = (
    b'data:{"id":"c1","object":"chat.completion.chunk","created":1,"model":"up-model",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"caf\\u00e9"},"finish_reason":null}]}\n\n'
    b": keep-alive\n\n"
    b'data: {"id": "c1", "object": "chat.completion.chunk",\n'
    b'data:  "model" : "up-model", "choices": [{"index": 0, "delta": {"content": " \xc3\xa9t\xc3\xa9 \\"model\\""},'
    b' "finish_reason": null}]}\n\n'
    b'event: chunk\r\ndata: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"up-model",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop","model":"nested"}]}\r\n\r\n'
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    b"data: [DONE]\n\n"
)

# Streamed for a client that did not ask for usage: the router asks for it
# upstream, drops the usage chunk and removes the "usage": null it caused.
INJECTED_SSE = (
    b'data:{"id":"c2","model":"up-model","choices":[{"index":0,"delta":{"content":"caf\\u00e9"}}],"usage":null}\n\n'
    b'data: {"id": "c2",\n'
    b'data:  "usage": null,\n'
    b'data: "model": "up-model", "choices": [{"index": 0, "delta": {"content": "\xc3\xa9"}}]}\r\n\r\n'
    b'data: {"id":"c2","model":"up-model","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)
INJECTED_EXPECTED = (
    b'data:{"id":"c2","model":"chat","choices":[{"index":0,"delta":{"content":"caf\\u00e9"}}]}\n\n'
    b'data: {"id": "c2",\n'
    b"data:  \n"
    b'data: "model": "chat", "choices": [{"index": 0, "delta": {"content": "\xc3\xa9"}}]}\r\n\r\n'
    b"data: [DONE]\n\n"
)

RESPONSES_SSE = (
    b"event: response.created\n"
    b'data: {"type":"response.created","sequence_number":0,'
    b'"response":{"id":"resp_1","object":"response","model":"up-model","output":[],"usage":null}}\n\n'
    b"event: response.output_text.delta\n"
    b'data:{"type":"response.output_text.delta","sequence_number":1,"delta":"caf\\u00e9 \\"model\\""}\n\n'
    b"event: response.completed\n"
    b'data: {"type": "response.completed",\n'
    b'data: "sequence_number": 2, "response": {"id": "resp_1", "model" :"up-model", "output": [],'
    b' "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}}\n\n'
)

ANTHROPIC_SSE = (
    b"event: message_start\n"
    b'data: {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",'
    b' "model": "up-model", "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}}\n\n'
    b"event: content_block_delta\n"
    b'data:{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"caf\\u00e9 \xc3\xa9"}}\n\n'
    b"event: message_delta\r\n"
    b'data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}\r\n\r\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)

# What strict JSON forbids and engines emit: NaN / Infinity logprobs, a lone
# surrogate escape in generated text.
LENIENT_JSON = (
    b'{"id": "c3", "model": "up-model", "choices": [{"index": 0, "message": {"content": "\\ud800!"},'
    b' "logprobs": {"content": [{"token": "x", "logprob": NaN}]}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
)
LENIENT_SSE = (
    b'data: {"id":"c4","model":"up-model","choices":[{"index":0,"delta":{"content":"\\udfff"},'
    b'"logprobs":{"content":[{"token":"y","logprob":-Infinity}]}}]}\n\n'
    b'data: {"id":"c4","model":"up-model","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)

# An engine that reports usage on every chunk (vLLM continuous_usage_stats)
# and on the finish chunk, never in a chunk of its own.
CONTINUOUS_SSE = (
    b'data: {"id":"c5","model":"up-model","choices":[{"index":0,"delta":{"content":"a"}}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b'data: {"id":"c5","model":"up-model","usage": {"prompt_tokens":3,"completion_tokens":2},'
    b' "choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)
CONTINUOUS_EXPECTED = (
    b'data: {"id":"c5","model":"chat","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    b'data: {"id":"c5","model":"chat","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)

SSE = "text/event-stream"
JSON = "application/json"
# name: (content type, body, declare a content-length)
SCRIPTS = {
    "json": (JSON, JSON_BODY, True),
    "json-chunked": (JSON, JSON_BODY, False),
    "chat-sse": (SSE, CHAT_SSE, False),
    "injected-sse": (SSE, INJECTED_SSE, False),
    "injected-sse-linger": (SSE, INJECTED_SSE, False),
    "lenient-json": (JSON, LENIENT_JSON, True),
    "lenient-sse": (SSE, LENIENT_SSE, False),
    "continuous-sse": (SSE, CONTINUOUS_SSE, False),
    "responses-sse": (SSE, RESPONSES_SSE, False),
    "anthropic-sse": (SSE, ANTHROPIC_SSE, False),
}


def cut_points(body: bytes) -> list[int]:
    """Awkward places to end a write: inside ``data:``, inside the model value,
    inside a UTF-8 character and between ``\\r`` and ``\\n``."""
    points = set()
    for needle, offset in ((b"data:", 3), (UPSTREAM, 4), (b"\xc3\xa9", 1), (b"\r\n", 1)):
        at = body.find(needle)
        if at >= 0:
            points.add(at + offset)
    return sorted(points)


class Upstream:
    """The scripted engine on a loopback port, served from a background thread."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scripted-upstream", daemon=True)
        self.thread.start()
        self.runner = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = next(a[1] for a in self.runner.addresses if isinstance(a, tuple))

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "up-model", "object": "model"}]})
        script = request.headers.get("x-script")
        if script not in SCRIPTS:
            return web.json_response({"error": {"message": "no script"}}, status=404)
        body = await request.read()
        self.requests.append({"path": request.path, "json": orjson.loads(body) if body else None})
        ctype, data, declared = SCRIPTS[script]
        if declared:
            return web.Response(body=data, headers={"Content-Type": ctype})
        response = web.StreamResponse(headers={"Content-Type": ctype})
        response.enable_chunked_encoding()
        await response.prepare(request)
        last = 0
        for point in [*cut_points(data), len(data)]:
            await response.write(data[last:point])
            await asyncio.sleep(0.02)
            last = point
        if script.endswith("-linger"):
            await asyncio.sleep(1.0)  # [DONE] is out; the stream's end comes later
        await response.write_eof()
        return response

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


CONFIG = """
metering: {flush_interval_ms: 100}
backends:
  - {name: scripted, url: "http://127.0.0.1:%d", models: [up-model]}
model_experiments:
  - name: bytes
    model: chat
    response_model: client
    variants: [{id: only, model: up-model, weight: 1}]
"""


@pytest.fixture(scope="module")
def upstream():
    u = Upstream()
    yield u
    u.stop()


@pytest.fixture(scope="module")
def stack(stack_factory, upstream):
    return stack_factory(CONFIG % upstream.port)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


def post(http: httpx.Client, path: str, script: str, body: dict) -> httpx.Response:
    r = http.post(path, content=orjson.dumps(body), headers={"content-type": JSON, "x-script": script})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("script", ["json", "json-chunked"])
def test_json_body_keeps_every_byte_but_the_model(http, script):
    r = post(http, "/v1/chat/completions", script, {"model": "chat", "messages": []})
    expected = JSON_BODY.replace(UPSTREAM, CLIENT)
    assert r.content == expected
    if script == "json":
        assert r.headers["content-length"] == str(len(expected))


def test_chat_stream_keeps_every_byte_but_the_model(http, upstream):
    body = {"model": "chat", "stream": True, "messages": [], "stream_options": {"include_usage": True}}
    r = post(http, "/v1/chat/completions", "chat-sse", body)
    assert r.headers["content-type"].startswith(SSE)
    assert r.content == CHAT_SSE.replace(UPSTREAM, CLIENT)
    assert upstream.requests[-1]["json"]["model"] == "up-model"


def test_injected_usage_is_cut_out_byte_for_byte(http, upstream):
    r = post(http, "/v1/chat/completions", "injected-sse", {"model": "chat", "stream": True, "messages": []})
    assert r.content == INJECTED_EXPECTED
    assert upstream.requests[-1]["json"]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    "path, script, raw",
    [
        ("/v1/responses", "responses-sse", RESPONSES_SSE),
        ("/anthropic/v1/messages", "anthropic-sse", ANTHROPIC_SSE),
    ],
)
def test_responses_and_anthropic_streams_keep_every_byte_but_the_model(stack, http, path, script, raw):
    """...and the Responses API's response ids, which name the backend that stores them."""
    r = post(http, path, script, {"model": "chat", "stream": True, "input": "hi", "max_tokens": 5, "messages": []})
    expected = raw.replace(UPSTREAM, CLIENT)
    if path == "/v1/responses":
        tagged = tag(Owner("scripted", "chat", True), "resp_1", derive(stack.grpc_secret))
        expected = expected.replace(b'"resp_1"', b'"%s"' % tagged.encode())
        assert expected.count(tagged.encode()) == 2
    assert r.content == expected


def test_injected_usage_is_counted_when_the_client_leaves_after_done(stack, http):
    """The client stops reading at [DONE] and closes, before the upstream ends
    the stream: the usage the router cut out still counts on the arm."""
    before = {k: metric(stack, "model_experiment_tokens_total", experiment="bytes", kind=k)
              for k in ("prompt", "completion")}
    body = orjson.dumps({"model": "chat", "stream": True, "messages": []})
    with http.stream("POST", "/v1/chat/completions", content=body,
                     headers={"content-type": JSON, "x-script": "injected-sse-linger"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
    after = {k: wait_metric(stack, "model_experiment_tokens_total", before[k] + 1,
                            experiment="bytes", kind=k) for k in ("prompt", "completion")}
    assert (after["prompt"] - before["prompt"], after["completion"] - before["completion"]) == (3, 2)


def test_payloads_strict_json_refuses_are_rewritten_and_counted(stack, http):
    """NaN, -Infinity and lone surrogates: the hidden model name still never
    reaches the client, and the usage still counts."""
    before = metric(stack, "model_experiment_tokens_total", experiment="bytes", kind="prompt")
    r = post(http, "/v1/chat/completions", "lenient-json", {"model": "chat", "messages": []})
    assert r.content == LENIENT_JSON.replace(UPSTREAM, CLIENT)
    body = {"model": "chat", "stream": True, "messages": [], "stream_options": {"include_usage": True}}
    r = post(http, "/v1/chat/completions", "lenient-sse", body)
    assert r.content == LENIENT_SSE.replace(UPSTREAM, CLIENT)
    assert UPSTREAM not in r.content
    assert wait_metric(stack, "model_experiment_tokens_total", before + 6, experiment="bytes",
                       kind="prompt") == before + 6


def test_usage_the_router_asked_for_is_stripped_whatever_chunk_carries_it(stack, http):
    before = {k: metric(stack, "model_experiment_tokens_total", experiment="bytes", kind=k)
              for k in ("prompt", "completion")}
    r = post(http, "/v1/chat/completions", "continuous-sse", {"model": "chat", "stream": True, "messages": []})
    assert r.content == CONTINUOUS_EXPECTED
    after = {k: wait_metric(stack, "model_experiment_tokens_total", before[k] + 1,
                            experiment="bytes", kind=k) for k in ("prompt", "completion")}
    assert (after["prompt"] - before["prompt"], after["completion"] - before["completion"]) == (3, 2)

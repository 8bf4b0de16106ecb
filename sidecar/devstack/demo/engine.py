"""A small, deterministic OpenAI- and Anthropic-compatible LLM engine.

The demo engine is a real aiohttp HTTP server. ``model-router up`` runs a few of
them as the upstreams of the local demo stack, and integration tests put them
behind Envoy. Every reply names the engine and the model it served, token
counts are simple word counts, and nothing sleeps unless a request asks for it.

Served routes:

* ``GET /health``, ``GET /metrics`` (vLLM metric names, or a page set through
  ``/_demo/state``), ``GET /v1/models``, ``GET /v1/models/{model}``
* OpenAI: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
  ``/v1/responses`` (buffered or streamed; stored responses can be retrieved,
  deleted, cancelled and their input items listed: see :mod:`sidecar.devstack.demo.responses`),
  ``/v1/images/generations``, ``/v1/images/edits``
* Anthropic: ``POST /v1/messages``, ``/v1/messages/count_tokens``
* Test hooks under ``/_demo/``: ``GET``/``DELETE /_demo/requests`` (a
  streamed request whose peer went away before its last event is marked
  ``"disconnected": true``) and ``POST /_demo/state``.

``POST /_demo/state`` takes a JSON object with any of: ``waiting``, ``running``
and ``extra_generation_tokens`` (the vLLM-shaped gauges and counter),
``healthy``; ``metrics_page`` (Prometheus text served verbatim on ``/metrics``
in place of the vLLM-shaped page, so the engine can stand in for another
engine; null restores it), ``metrics_enabled`` (false: ``/metrics`` answers
404, as SGLang does without ``--enable-metrics``), ``health_delay_ms`` (every
``/health`` answers after this long, as SGLang's generation check does) and
``health_fail_next`` (the next ``n`` ``/health`` checks answer 503). It answers
the resulting state, with ``health_checks`` and ``metrics_scrapes``: how many
``/health`` and ``/metrics`` requests arrived so far.

Request headers that shape a reply on any ``/v1/`` route:

* ``x-demo-status: <code>`` (400-599): answer that status with an OpenAI-shaped
  error body instead of serving the request.
* ``x-demo-interval-ms: <n>``: sleep ``n`` ms between streamed events.
* ``x-demo-events: <n>``: the reply has exactly ``n`` words, so a streamed reply
  has exactly ``n`` content events (words repeat as needed).
* ``x-demo-split: 1``: the reply ends with the word ``héllo→✓`` and each
  streamed event leaves in several writes, split inside the ``data:``/``event:``
  prefix, inside a JSON string, inside a multi-byte UTF-8 character and between
  the two closing line breaks.
* ``x-demo-crlf: 1``: streamed events use ``\\r\\n`` line endings.

Every response to a ``/v1/`` route carries an ``x-demo-engine: <name>`` header.

Chat Completions and Messages requests with ``tools``, ``response_format``,
``n`` or ``logprobs`` get tool calls, schema-shaped JSON, ``n`` choices and
logprobs planned by :mod:`sidecar.devstack.demo.shapes` (see docs/demo-engine.md).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import collections
import hashlib
import itertools
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import BodyPartReader, WSMsgType, web
from aiohttp.typedefs import Handler

from . import shapes as demo_shapes

__all__ = ["add_arguments", "build_app", "main", "run", "start"]

CREATED = 1_700_000_000
"""The fixed ``created`` timestamp used in every response."""

MAX_RECORDS = 1000
ECHO_LIMIT = 200
EMBEDDING_DIM = 8
SPLIT_WORD = "héllo→✓"
DEFAULT_MODEL = "demo-model"

_PNG_1X1 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
_JSON = "application/json"
_SSE = "text/event-stream"
_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class _Reject(Exception):
    """Raised by handlers to answer with an error response."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass
class _Hooks:
    """Reply-shaping options read from the ``x-demo-*`` request headers."""

    interval_ms: int = 0
    delay_ms: int = 0  # before the answer starts (its headers)
    events: int | None = None
    split: bool = False
    crlf: bool = False


@dataclass
class _State:
    """Mutable engine state: recorded requests, gauges, counter, health."""

    records: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_RECORDS)
    )
    waiting: int = 0
    running: int = 0
    in_flight: int = 0
    generation_tokens: int = 0
    healthy: bool = True
    metrics_page: str | None = None  # served verbatim on /metrics when set
    metrics_enabled: bool = True
    health_delay_ms: int = 0
    health_fail_next: int = 0
    health_checks: int = 0
    metrics_scrapes: int = 0
    seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


@dataclass
class _Parsed:
    """What the middleware read from one API request."""

    json: Any = None
    json_error: bool = False
    form: dict[str, str] | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    hooks: _Hooks = field(default_factory=_Hooks)
    record: dict[str, Any] | None = None  # this request's entry in /_demo/requests


_PARSED: Any = web.RequestKey("demo_parsed", _Parsed) if hasattr(web, "RequestKey") else "demo_parsed"


def _json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON, headers=headers)


def _words(text: str) -> int:
    return len(text.split())


def _content_text(content: Any) -> str:
    """Text of an OpenAI/Anthropic message ``content`` (string or list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                elif "content" in part:
                    parts.append(_content_text(part.get("content")))
        return " ".join(p for p in parts if p)
    if isinstance(content, dict):
        return _content_text([content])
    return str(content)


def _last_user_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


def _all_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return _content_text(messages)
    return " ".join(
        _content_text(m.get("content")) if isinstance(m, dict) else _content_text(m) for m in messages
    )


def _prompt_text(prompt: Any) -> str:
    """Text of a ``/v1/completions`` prompt: string, list of strings, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(_prompt_text(p) if isinstance(p, (str, list)) else str(p) for p in prompt)
    if prompt is None:
        return ""
    return str(prompt)


def _cap(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return max(value, 0)


def _embedding(text: str, dims: int) -> list[float]:
    """Deterministic vector whose components are exact float32 values in [-1, 1)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return [(digest[i] - 128) / 128 for i in range(dims)]


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _split_points(frame: bytes) -> list[int]:
    """Awkward offsets at which to cut one SSE event into separate writes."""
    points: set[int] = set()
    for prefix in (b"event:", b"data:"):
        idx = frame.find(prefix)
        if idx >= 0:
            points.add(idx + 2)
    start = frame.find(b"{")
    if start >= 0:
        quote = frame.find(b'"', start)
        if quote >= 0:
            points.add(quote + 2)
        value = frame.find(b'":"', start)
        if value >= 0:
            points.add(value + 4)
    for idx, byte in enumerate(frame):
        if byte >= 0xC0:
            points.add(idx + 1)
            break
    points.add(len(frame) - 1)
    return sorted(p for p in points if 0 < p < len(frame))


class _Engine:
    """Request handlers and state of one demo engine."""

    def __init__(self, name: str, models: list[str], prices: dict[str, Any] | None) -> None:
        self.name = name
        self.models = list(models)
        self.prices = dict(prices or {})
        self.state = _State()

    # ----------------------------------------------------------------- errors

    def openai_error(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> web.Response:
        if type_ is None:
            type_ = _OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        return _json_response(body, status=status)

    def anthropic_error(self, status: int, message: str, *, type_: str | None = None) -> web.Response:
        if type_ is None:
            type_ = _ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return _json_response({"type": "error", "error": {"type": type_, "message": message}}, status=status)

    def error_for(self, request: web.Request, status: int, message: str, **kw: Any) -> web.Response:
        if request.path.startswith("/v1/messages"):
            return self.anthropic_error(status, message)
        return self.openai_error(status, message, **kw)

    # ------------------------------------------------------------ middleware

    async def capture(self, request: web.Request) -> dict[str, Any]:
        """Read and parse the body once, remember it on the request, return the record."""
        headers: dict[str, str] = {}
        for key, value in request.headers.items():
            lower = key.lower()
            # Bytes that are not UTF-8 arrive as surrogate escapes; keep the log encodable.
            value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            headers[lower] = f"{headers[lower]}, {value}" if lower in headers else value
        parsed: Any = None
        json_error = False
        form: dict[str, str] | None = None
        files: list[dict[str, Any]] = []
        body_len = 0
        if request.content_type.startswith("multipart/"):
            form = {}
            counted = 0
            reader = await request.multipart()
            async for part in reader:
                if not isinstance(part, BodyPartReader):
                    continue
                data = await part.read(decode=True)
                counted += len(data)
                if part.filename is None:
                    charset = part.get_charset(default="utf-8")
                    form[part.name or ""] = data.decode(charset, errors="replace")
                else:
                    files.append(
                        {
                            "name": part.name,
                            "filename": part.filename,
                            "content_type": part.headers.get("Content-Type"),
                            "data": data,
                        }
                    )
            body_len = request.content_length if request.content_length is not None else counted
        else:
            raw = await request.read()
            body_len = len(raw)
            if raw:
                try:
                    parsed = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    json_error = True
        request[_PARSED] = _Parsed(json=parsed, json_error=json_error, form=form, files=files)
        return {
            "method": request.method,
            "path": request.path,
            "query": dict(request.query.items()),
            "headers": headers,
            "json": parsed,
            "form": form,
            "body_len": body_len,
        }

    def read_hooks(self, request: web.Request) -> _Hooks:
        hooks = _Hooks()
        for header, attr in (
            ("x-demo-interval-ms", "interval_ms"), ("x-demo-delay-ms", "delay_ms"), ("x-demo-events", "events"),
        ):
            raw = request.headers.get(header)
            if raw is None:
                continue
            try:
                value = int(raw.strip())
            except ValueError:
                value = -1
            if value < 0:
                raise _Reject(self.openai_error(400, f"invalid {header} header: {raw!r}", param=header))
            setattr(hooks, attr, value)
        hooks.split = request.headers.get("x-demo-split", "").strip() not in ("", "0")
        hooks.crlf = request.headers.get("x-demo-crlf", "").strip() not in ("", "0")
        return hooks

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not (request.path.startswith("/v1/") or request.path == "/embed_sparse"):
            return await handler(request)
        try:
            record = await self.capture(request)
        except web.HTTPException as exc:
            return self.error_for(request, exc.status, exc.reason)
        except ValueError as exc:
            return self.error_for(request, 400, f"malformed request body: {exc}")
        self.state.records.append(record)
        if _PARSED in request:
            request[_PARSED].record = record
        response = await self.serve_api(request, handler)
        if not response.prepared:
            response.headers["x-demo-engine"] = self.name
        return response

    async def serve_api(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.state.healthy:
            return self.error_for(request, 503, f"demo engine {self.name} is unhealthy")
        raw_status = request.headers.get("x-demo-status")
        if raw_status is not None:
            try:
                status = int(raw_status.strip())
            except ValueError:
                status = 0
            if not 400 <= status <= 599:
                return self.openai_error(400, f"invalid x-demo-status header: {raw_status!r}", param="x-demo-status")
            return self.openai_error(
                status,
                f"demo engine {self.name}: injected status {status}",
                code=f"demo_status_{status}",
            )
        try:
            request[_PARSED].hooks = self.read_hooks(request)
        except _Reject as rej:
            return rej.response
        self.state.in_flight += 1
        try:
            if request[_PARSED].hooks.delay_ms:
                await asyncio.sleep(request[_PARSED].hooks.delay_ms / 1000)
            return await handler(request)
        except _Reject as rej:
            return rej.response
        finally:
            self.state.in_flight -= 1

    # ---------------------------------------------------------------- helpers

    def body(self, request: web.Request) -> dict[str, Any]:
        if request[_PARSED].json_error:
            raise _Reject(self.error_for(request, 400, "request body is not valid JSON"))
        body = request[_PARSED].json
        if not isinstance(body, dict):
            raise _Reject(self.error_for(request, 400, "request body must be a JSON object"))
        return body

    def model(self, request: web.Request, value: Any) -> str:
        if not isinstance(value, str) or not value:
            if request.path.startswith("/v1/messages"):
                raise _Reject(self.anthropic_error(400, "model: field required"))
            raise _Reject(self.openai_error(400, "you must provide a model parameter", param="model"))
        if self.models and value not in self.models:
            message = f"The model `{value}` does not exist on demo engine {self.name}."
            if request.path.startswith("/v1/messages"):
                raise _Reject(self.anthropic_error(404, message, type_="not_found_error"))
            raise _Reject(
                self.openai_error(404, message, type_="invalid_request_error", param="model", code="model_not_found")
            )
        return value

    def reply_words(self, model: str, echo: str, hooks: _Hooks, effort: Any = None) -> list[str]:
        """Words of the reply: ``[<name>] <model>: <echo>`` plus optional effort and split word."""
        echo = " ".join(echo.split())[:ECHO_LIMIT].rstrip()
        text = f"[{self.name}] {model}:"
        if echo:
            text += f" {echo}"
        if effort is not None:
            text += f" (effort={effort})"
        if hooks.split:
            text += f" {SPLIT_WORD}"
        words = text.split(" ")
        if hooks.events is not None:
            words = [words[i % len(words)] for i in range(hooks.events)]
        return words

    def next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self.state.seq):08d}"

    def account(self, completion_tokens: int) -> None:
        self.state.generation_tokens += completion_tokens

    @staticmethod
    def pieces(words: list[str]) -> list[str]:
        """Stream deltas whose concatenation equals ``" ".join(words)``."""
        return [w if i == 0 else f" {w}" for i, w in enumerate(words)]

    async def stream(
        self, request: web.Request, events: list[tuple[str | None, Any]]
    ) -> web.StreamResponse:
        """Write ``events`` as SSE; each item is ``(event name or None, JSON object or raw bytes)``."""
        hooks: _Hooks = request[_PARSED].hooks
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": _SSE, "Cache-Control": "no-cache", "x-demo-engine": self.name},
        )
        await response.prepare(request)
        try:
            await self._write_events(response, events, hooks)
        except ConnectionResetError:
            # The peer reset or closed the stream before its end: a test can see
            # that the engine stopped generating for a caller that is gone.
            record = request[_PARSED].record
            if record is not None:
                record["disconnected"] = True
        return response

    @staticmethod
    async def _write_events(
        response: web.StreamResponse, events: list[tuple[str | None, Any]], hooks: _Hooks
    ) -> None:
        newline = b"\r\n" if hooks.crlf else b"\n"
        for index, (event, data) in enumerate(events):
            if index and hooks.interval_ms:
                await asyncio.sleep(hooks.interval_ms / 1000)
            frame = b""
            if event is not None:
                frame += b"event: " + event.encode() + newline
            payload = data if isinstance(data, bytes) else orjson.dumps(data)
            frame += b"data: " + payload + newline + newline
            if hooks.split:
                last = 0
                for point in [*_split_points(frame), len(frame)]:
                    await response.write(frame[last:point])
                    await asyncio.sleep(0)
                    last = point
            else:
                await response.write(frame)
        await response.write_eof()

    # ------------------------------------------------------------- basic routes

    async def health(self, request: web.Request) -> web.Response:
        self.state.health_checks += 1
        if self.state.health_delay_ms:
            await asyncio.sleep(self.state.health_delay_ms / 1000)
        if self.state.health_fail_next:
            self.state.health_fail_next -= 1
            return _json_response({"status": "unhealthy"}, status=503)
        if not self.state.healthy:
            return _json_response({"status": "unhealthy"}, status=503)
        return _json_response({"status": "ok"})

    def model_object(self, model: str) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": model, "object": "model", "created": CREATED, "owned_by": self.name}
        if model in self.prices:
            obj["pricing"] = self.prices[model]
        return obj

    async def list_models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self.model_object(m) for m in self.models]})

    async def get_model(self, request: web.Request) -> web.Response:
        model = self.model(request, request.match_info["model"])
        return _json_response(self.model_object(model))

    async def metrics(self, request: web.Request) -> web.Response:
        self.state.metrics_scrapes += 1
        if not self.state.metrics_enabled:
            return _json_response({"detail": "Not Found"}, status=404)
        if self.state.metrics_page is not None:
            return web.Response(body=self.state.metrics_page.encode(), headers={"Content-Type": _METRICS_CONTENT_TYPE})
        label = _escape_label(self.models[0] if self.models else self.name)
        running = self.state.running + self.state.in_flight
        lines = [
            "# HELP vllm:num_requests_running Number of requests currently running on GPU.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{label}"}} {float(running)}',
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{label}"}} {float(self.state.waiting)}',
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f'vllm:generation_tokens_total{{model_name="{label}"}} {float(self.state.generation_tokens)}',
        ]
        return web.Response(
            body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": _METRICS_CONTENT_TYPE}
        )

    # ---------------------------------------------------------------- test hooks

    async def get_requests(self, request: web.Request) -> web.Response:
        return _json_response(list(self.state.records))

    async def clear_requests(self, request: web.Request) -> web.Response:
        self.state.records.clear()
        return _json_response({"cleared": True})

    def state_view(self) -> dict[str, Any]:
        return {
            "waiting": self.state.waiting,
            "running": self.state.running,
            "generation_tokens": self.state.generation_tokens,
            "healthy": self.state.healthy,
            "metrics_page": self.state.metrics_page,
            "metrics_enabled": self.state.metrics_enabled,
            "health_delay_ms": self.state.health_delay_ms,
            "health_fail_next": self.state.health_fail_next,
            "health_checks": self.state.health_checks,
            "metrics_scrapes": self.state.metrics_scrapes,
        }

    async def set_state(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError:
            return self.openai_error(400, "state body is not valid JSON")
        if not isinstance(body, dict):
            return self.openai_error(400, "state body must be a JSON object")
        for key in ("waiting", "running", "extra_generation_tokens", "health_delay_ms", "health_fail_next"):
            if key in body and (isinstance(body[key], bool) or not isinstance(body[key], int) or body[key] < 0):
                return self.openai_error(400, f"{key} must be a non-negative integer", param=key)
        for key in ("healthy", "metrics_enabled"):
            if key in body and not isinstance(body[key], bool):
                return self.openai_error(400, f"{key} must be a boolean", param=key)
        if "metrics_page" in body and not isinstance(body["metrics_page"], (str, type(None))):
            return self.openai_error(400, "metrics_page must be a string or null", param="metrics_page")
        if "extra_generation_tokens" in body:
            self.state.generation_tokens += body["extra_generation_tokens"]
        for key in ("waiting", "running", "healthy", "metrics_page", "metrics_enabled", "health_delay_ms",
                    "health_fail_next"):
            if key in body:
                setattr(self.state, key, body[key])
        return _json_response(self.state_view())

    # ------------------------------------------------------------------ OpenAI

    def openai_usage(self, prompt_text: str, lengths: list[int], cap: int | None) -> dict[str, int]:
        """Usage of a reply whose choices have ``lengths`` tokens each (``cap`` applies per choice)."""
        prompt_tokens = max(_words(prompt_text), 1)
        completion_tokens = sum(n if cap is None else min(n, cap) for n in lengths)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = self.body(request)
        model = self.model(request, body.get("model"))
        messages = body.get("messages")
        hooks: _Hooks = request[_PARSED].hooks
        words = self.reply_words(model, _last_user_text(messages), hooks, body.get("reasoning_effort"))
        cap = _cap(body.get("max_completion_tokens"))
        if cap is None:
            cap = _cap(body.get("max_tokens"))
        completion_id = self.next_id("chatcmpl-demo")
        fingerprint = f"fp_{self.name}"
        tool_reply = self.scripted_tools(body, words) if not body.get("stream") else None
        if tool_reply is not None:
            message, finish, words = tool_reply
            usage = self.openai_usage(_all_text(messages), [len(words)], cap)
            self.account(usage["completion_tokens"])
            return _json_response({
                "id": completion_id, "object": "chat.completion", "created": CREATED, "model": model,
                "system_fingerprint": fingerprint,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": usage,
            })
        replies = demo_shapes.chat_replies(body, words)
        usage = self.openai_usage(_all_text(messages), [r.tokens for r in replies], cap)
        self.account(usage["completion_tokens"])
        seq = completion_id.rsplit("-", 1)[-1]
        if not body.get("stream"):
            return _json_response({
                "id": completion_id, "object": "chat.completion", "created": CREATED, "model": model,
                "system_fingerprint": fingerprint,
                "choices": [demo_shapes.chat_choice(i, r, body, seq) for i, r in enumerate(replies)],
                "usage": usage,
            })
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "system_fingerprint": fingerprint,
        }
        per_choice = [demo_shapes.chat_deltas(i, r, body, seq) for i, r in enumerate(replies)]
        events: list[tuple[str | None, Any]] = []
        for step in range(max(len(c) for c in per_choice)):
            for choices in per_choice:
                if step < len(choices):
                    obj = {**base, "choices": [choices[step]]}
                    if include_usage:
                        obj["usage"] = None
                    events.append((None, obj))
        if include_usage:
            events.append((None, {**base, "choices": [], "usage": usage}))
        events.append((None, b"[DONE]"))
        return await self.stream(request, events)

    def scripted_tools(self, body: dict[str, Any], words: list[str]) -> tuple[dict[str, Any], str, list[str]] | None:
        """Tool use, scripted by markers in the first user message.

        ``[search:N]`` makes the engine call an offered ``web_search`` tool
        until N tool results are in the conversation, then answer citing the
        URLs it was given; ``[client-tool]`` makes it call the first offered
        tool that is not ``web_search``. Returns (message, finish_reason,
        reply words) or None when no tool is involved.
        """
        given = body.get("messages")
        messages: list[Any] = given if isinstance(given, list) else []
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
        names = [(t.get("function") or {}).get("name") for t in tools]
        first_user = next((m for m in messages if isinstance(m, dict) and m.get("role") == "user"), {})
        text = _content_text(first_user.get("content")) if first_user else ""
        done = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool")
        if "[client-tool]" in text and done == 0:
            other = next((n for n in names if n and n != "web_search"), None)
            if other:
                call = {"id": f"call_{self.name}_client", "type": "function",
                        "function": {"name": other, "arguments": orjson.dumps({"city": "Paris"}).decode()}}
                return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", ["tool"]
        wanted = 0
        if "[search:" in text:
            tail = text.split("[search:", 1)[1].split("]", 1)[0]
            wanted = int(tail) if tail.isdigit() else 0
        if "web_search" in names and done < wanted:
            query = f"{_last_user_text(messages)[:80]} #{done + 1}"
            call = {"id": f"call_{self.name}_{done + 1}", "type": "function",
                    "function": {"name": "web_search", "arguments": orjson.dumps({"query": query}).decode()}}
            return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls", ["search"]
        if done:
            urls = []
            for m in messages:
                if isinstance(m, dict) and m.get("role") == "tool":
                    urls += [w for w in str(m.get("content", "")).split() if w.startswith("http")]
            reply = words + ["sources:"] + urls
            return {"role": "assistant", "content": " ".join(reply), "refusal": None}, "stop", reply
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = self.body(request)
        model = self.model(request, body.get("model"))
        prompt = _prompt_text(body.get("prompt"))
        hooks: _Hooks = request[_PARSED].hooks
        words = self.reply_words(model, prompt, hooks)
        usage = self.openai_usage(prompt, [len(words)], _cap(body.get("max_tokens")))
        self.account(usage["completion_tokens"])
        base = {"id": self.next_id("cmpl-demo"), "object": "text_completion", "created": CREATED, "model": model}

        def logprobs(pieces: list[str], offset: int = 0) -> dict[str, Any] | None:
            if body.get("logprobs") is None:
                return None
            return demo_shapes.completion_logprobs(pieces, body.get("logprobs"), offset)

        if not body.get("stream"):
            return _json_response(
                {
                    **base,
                    "choices": [{"text": " ".join(words), "index": 0, "finish_reason": "stop",
                                 "logprobs": logprobs(self.pieces(words))}],
                    "usage": usage,
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, finish_reason: str | None = None, offset: int = 0) -> dict[str, Any]:
            lp = logprobs([text], offset) if text else None
            obj = {**base, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish_reason}]}
            if include_usage:
                obj["usage"] = None
            return obj

        pieces = self.pieces(words)
        offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
        events: list[tuple[str | None, Any]] = [(None, chunk(p, None, o)) for p, o in zip(pieces, offsets)]
        events.append((None, chunk("", "stop")))
        if include_usage:
            events.append((None, {**base, "choices": [], "usage": usage}))
        events.append((None, b"[DONE]"))
        return await self.stream(request, events)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = self.body(request)
        model = self.model(request, body.get("model"))
        raw_input = body.get("input")
        if isinstance(raw_input, str):
            inputs = [raw_input]
        elif isinstance(raw_input, list) and raw_input and all(isinstance(x, int) for x in raw_input):
            inputs = [" ".join(str(x) for x in raw_input)]
        elif isinstance(raw_input, list) and raw_input:
            inputs = [x if isinstance(x, str) else _prompt_text(x) for x in raw_input]
        else:
            raise _Reject(self.openai_error(400, "input must be a string or a non-empty list", param="input"))
        dims = body.get("dimensions")
        if dims is None:
            dims = EMBEDDING_DIM
        if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= EMBEDDING_DIM:
            raise _Reject(
                self.openai_error(400, f"dimensions must be between 1 and {EMBEDDING_DIM}", param="dimensions")
            )
        as_base64 = body.get("encoding_format") == "base64"
        data = []
        for index, text in enumerate(inputs):
            vector = _embedding(text, dims)
            embedding: Any = vector
            if as_base64:
                embedding = base64.b64encode(array.array("f", vector).tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = max(sum(_words(t) for t in inputs), 1)
        return _json_response(
            {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        )

    def image_response(self, model: str, prompt: str, n: Any) -> web.Response:
        count = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        revised = f"[{self.name}] {model}: {' '.join(prompt.split())[:ECHO_LIMIT]}".rstrip()
        return _json_response(
            {
                "created": CREATED,
                "data": [{"b64_json": _PNG_1X1, "revised_prompt": revised} for _ in range(count)],
                "model": model,
            }
        )

    async def image_generations(self, request: web.Request) -> web.Response:
        body = self.body(request)
        model = self.model(request, body.get("model"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise _Reject(self.openai_error(400, "prompt must be a string", param="prompt"))
        return self.image_response(model, prompt, body.get("n"))

    async def image_edits(self, request: web.Request) -> web.Response:
        form = request[_PARSED].form
        if form is None:
            raise _Reject(self.openai_error(400, "images/edits expects multipart/form-data"))
        model = self.model(request, form.get("model"))
        if not request[_PARSED].files:
            raise _Reject(self.openai_error(400, "an image file part is required", param="image"))
        n = form.get("n")
        return self.image_response(model, form.get("prompt", ""), int(n) if n and n.isdigit() else 1)

    async def rerank(self, request: web.Request) -> web.Response:
        """Scores documents by shared words with the query (deterministic)."""
        body = self.body(request)
        model = self.model(request, body.get("model"))
        query = body.get("query")
        docs = body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list):
            raise _Reject(self.openai_error(400, "query (string) and documents (list) are required"))
        words = set(query.lower().split())
        results = []
        for i, d in enumerate(docs):
            text = d if isinstance(d, str) else str(d)
            overlap = len(words & set(text.lower().split()))
            results.append({"index": i, "relevance_score": overlap / (len(words) or 1)})
        results.sort(key=lambda r: -r["relevance_score"])
        return _json_response({"id": "rerank-demo", "model": model, "results": results,
                               "usage": {"total_tokens": _words(query) + sum(_words(str(d)) for d in docs)}})

    async def embed_sparse(self, request: web.Request) -> web.Response:
        """Sparse embeddings: one (token hash, weight) list per input."""
        body = self.body(request)
        model = self.model(request, body.get("model"))
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list):
            raise _Reject(self.openai_error(400, "input must be a string or a list of strings", param="input"))
        data = []
        for i, text in enumerate(inputs):
            tokens = sorted({int.from_bytes(hashlib.sha256(w.encode()).digest()[:2], "big") for w in str(text).split()})
            data.append({"index": i, "indices": tokens, "values": [1.0] * len(tokens)})
        return _json_response({"object": "list", "model": model, "data": data})

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        """A WebSocket that announces the model it serves, then echoes text frames."""
        model = self.model(request, request.query.get("model"))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(orjson.dumps({"type": "session.created", "session": {"model": model, "engine": self.name}}).decode())
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await ws.send_str(msg.data)
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                break
        return ws

    # --------------------------------------------------------------- Anthropic

    @staticmethod
    def anthropic_input_tokens(body: dict[str, Any]) -> int:
        system = _content_text(body.get("system"))
        return max(_words(f"{system} {_all_text(body.get('messages'))}"), 1)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = self.body(request)
        model = self.model(request, body.get("model"))
        hooks: _Hooks = request[_PARSED].hooks
        words = self.reply_words(model, _last_user_text(body.get("messages")), hooks)
        message_id = self.next_id("msg_demo")
        block, start_block, deltas = self.anthropic_content(body, words, message_id)
        cap = _cap(body.get("max_tokens"))
        input_tokens = self.anthropic_input_tokens(body)
        output_tokens = len(deltas) if cap is None else min(len(deltas), cap)
        self.account(output_tokens)
        stop_reason = "tool_use" if block["type"] == "tool_use" else "end_turn"
        if not body.get("stream"):
            return _json_response(
                {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [block],
                    "stop_reason": stop_reason,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
                }
            )
        start_message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": min(output_tokens, 1)},
        }
        events: list[tuple[str | None, Any]] = [
            ("message_start", {"type": "message_start", "message": start_message}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start_block}),
        ]
        events += [
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}) for delta in deltas
        ]
        events += [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        return await self.stream(request, events)

    def anthropic_content(
        self, body: dict[str, Any], words: list[str], message_id: str
    ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """The reply's content block, its streamed start block and its deltas: text or a tool call."""
        tool = demo_shapes.anthropic_tool(body)
        if tool is None:
            deltas = [{"type": "text_delta", "text": piece} for piece in self.pieces(words)]
            return {"type": "text", "text": " ".join(words)}, {"type": "text", "text": ""}, deltas
        arguments = demo_shapes.schema_instance(tool[1])
        head = {"type": "tool_use", "id": f"toolu_{message_id.removeprefix('msg_')}", "name": tool[0]}
        pieces = demo_shapes.json_pieces(orjson.dumps(arguments).decode())
        deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in pieces]
        return {**head, "input": arguments}, {**head, "input": {}}, deltas

    async def count_tokens(self, request: web.Request) -> web.Response:
        body = self.body(request)
        self.model(request, body.get("model"))
        return _json_response({"input_tokens": self.anthropic_input_tokens(body)})


ENGINE_KEY: web.AppKey[_Engine] = web.AppKey("demo_engine", _Engine)


def build_app(*, name: str, models: list[str], prices: dict[str, Any] | None = None) -> web.Application:
    """Build the demo engine application.

    ``name`` appears in every reply and in ``owned_by``; ``models`` lists the
    served model names (empty: any model name is served); ``prices`` maps a
    model name to an arbitrary JSON value that ``/v1/models`` reports as that
    model's ``pricing``.
    """
    engine = _Engine(name, models, prices)
    app = web.Application(middlewares=[engine.middleware], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app.router.add_get("/health", engine.health)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/v1/models", engine.list_models)
    app.router.add_get("/v1/models/{model}", engine.get_model)
    app.router.add_post("/v1/chat/completions", engine.chat_completions)
    app.router.add_post("/v1/completions", engine.completions)
    app.router.add_post("/v1/embeddings", engine.embeddings)
    from .responses import ResponsesAPI  # it builds on this module's helpers

    ResponsesAPI(engine).routes(app)
    app.router.add_post("/v1/images/generations", engine.image_generations)
    app.router.add_post("/v1/images/edits", engine.image_edits)
    app.router.add_get("/v1/realtime", engine.realtime)
    app.router.add_post("/v1/rerank", engine.rerank)
    app.router.add_post("/embed_sparse", engine.embed_sparse)
    app.router.add_post("/v1/messages", engine.messages)
    app.router.add_post("/v1/messages/count_tokens", engine.count_tokens)
    app.router.add_get("/_demo/requests", engine.get_requests)
    app.router.add_delete("/_demo/requests", engine.clear_requests)
    app.router.add_post("/_demo/state", engine.set_state)
    return app


async def start(host: str, port: int, *, name: str, models: list[str]) -> web.AppRunner:
    """Start serving on ``host:port`` and return the runner; the caller awaits ``runner.cleanup()``.

    With ``port=0`` the OS picks a free port; read it from ``runner.addresses``.
    """
    runner = web.AppRunner(build_app(name=name, models=models), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def _bound_port(runner: web.AppRunner, default: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return default


async def _serve(host: str, port: int, name: str, models: list[str]) -> None:
    runner = await start(host, port, name=name, models=models)
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        shown_host = f"[{host}]" if ":" in host else host
        print(f"demo engine {name} listening on http://{shown_host}:{_bound_port(runner, port)}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def run(host: str, port: int, *, name: str, models: list[str]) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly and return."""
    asyncio.run(_serve(host, port, name, models))


class _AppendReplacingDefault(argparse.Action):
    """Like ``append``, but the first use replaces the default list instead of extending it."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        current = getattr(namespace, self.dest, None)
        if current is self.default or current is None:
            current = []
        setattr(namespace, self.dest, [*current, values])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--host``, ``--port``, ``--name`` and the repeatable ``--model`` options."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--name", default="demo", help="engine name shown in replies (default demo)")
    parser.add_argument(
        "--model",
        action=_AppendReplacingDefault,
        default=[DEFAULT_MODEL],
        metavar="MODEL",
        help=f"model name to serve; repeat for several (default {DEFAULT_MODEL})",
    )


def main(args: argparse.Namespace) -> int:
    """Run the engine described by parsed ``add_arguments`` options; return the exit code."""
    models = list(args.model or [DEFAULT_MODEL])
    run(args.host, args.port, name=args.name, models=models)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m sidecar.devstack.demo.engine", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))

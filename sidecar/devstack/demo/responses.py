"""The demo engine's Responses API: create (buffered or streamed), and the
calls about a stored response (retrieve, delete, cancel, input items).

Each engine keeps its own store, as a real engine does, so a call that
reaches an engine other than the one that created the response gets that
engine's 404, and a ``previous_response_id`` it does not hold gets a 400.

``background: true`` stores the response ``queued``; the first retrieve
finishes it (``completed``) and a cancel before that makes it ``cancelled``.
``store: false`` keeps nothing.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

from aiohttp import web

from .engine import _PARSED, CREATED, _all_text, _cap, _Engine, _json_response, _last_user_text, _Reject, _words
from .shapes import format_json

MAX_STORED = 10_000


class ResponsesAPI:
    """The Responses API handlers of one demo engine."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        # Ids differ between engines, as real engines' random ids do, so a call
        # that reaches the wrong engine cannot find a response by chance.
        self.token = hashlib.sha256(engine.name.encode()).hexdigest()[:8]
        self.stored: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.inputs: dict[str, list[dict[str, Any]]] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)

    # ----------------------------------------------------------------- errors

    def not_found(self, rid: str) -> web.Response:
        return self.engine.openai_error(404, f"Response with id '{rid}' not found.", type_="invalid_request_error")

    def found(self, request: web.Request) -> dict[str, Any]:
        rid = request.match_info["id"]
        obj = self.stored.get(rid)
        if obj is None:
            raise _Reject(self.not_found(rid))
        return obj

    # ----------------------------------------------------------------- create

    async def create(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        body = engine.body(request)
        model = engine.model(request, body.get("model"))
        prev = body.get("previous_response_id")
        if prev is not None and (not isinstance(prev, str) or prev not in self.stored):
            raise _Reject(engine.openai_error(
                400, f"Previous response with id '{prev}' not found.", param="previous_response_id",
                code="previous_response_not_found",
            ))
        raw_input = body.get("input")
        if isinstance(raw_input, str):
            echo, input_text = raw_input, raw_input
            items: list[dict[str, Any]] = [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw_input}]}
            ]
        else:
            echo, input_text = _last_user_text(raw_input), _all_text(raw_input)
            items = [dict(i) for i in raw_input if isinstance(i, dict)] if isinstance(raw_input, list) else []
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            input_text = f"{instructions} {input_text}"
        reasoning = body.get("reasoning")
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        words = engine.reply_words(model, echo, request[_PARSED].hooks, effort)
        text_options = body.get("text")
        structured = format_json(text_options.get("format") if isinstance(text_options, dict) else None, words)
        if structured is not None:
            words = [structured]
        cap = _cap(body.get("max_output_tokens"))
        input_tokens = max(_words(input_text), 1)
        output_tokens = len(words) if cap is None else min(len(words), cap)
        engine.account(output_tokens)
        seq = next(engine.state.seq)
        rid, mid = f"resp_demo{self.token}{seq:08d}", f"msg_demo{self.token}{seq:08d}"
        text = " ".join(words)
        background = body.get("background") is True
        obj: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": CREATED, "status": "completed",
            "background": background, "model": model,
            "output": [{
                "type": "message", "id": mid, "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }],
            "usage": {
                "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            },
            "error": None, "incomplete_details": None, "instructions": instructions,
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": True,
            "previous_response_id": prev, "tool_choice": "auto", "tools": [],
            "reasoning": {"effort": effort, "summary": None},
        }
        if body.get("store") is not False:
            for n, item in enumerate(items):
                item.setdefault("id", f"msg_in{self.token}{seq:08d}_{n}")
            self.remember(rid, obj, items)
        if background:
            queued = {**obj, "status": "queued", "output": [], "usage": None}
            if rid in self.stored:
                self.stored[rid] = {**queued, "_final": obj}
            return _public(queued)
        if body.get("stream"):
            return await engine.stream(request, _events(obj, words))
        return _public(obj)

    def remember(self, rid: str, obj: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self.stored[rid] = obj
        self.inputs[rid] = items
        while len(self.stored) > MAX_STORED:
            old, _ = self.stored.popitem(last=False)
            self.inputs.pop(old, None)

    # -------------------------------------------------------------- follow-ups

    async def retrieve(self, request: web.Request) -> web.Response:
        obj = self.found(request)
        if "_final" in obj:  # a queued background response finishes when first looked at
            obj = self.stored[obj["id"]] = obj["_final"]
        return _public(obj)

    async def delete(self, request: web.Request) -> web.Response:
        obj = self.found(request)
        del self.stored[obj["id"]]
        self.inputs.pop(obj["id"], None)
        return _public({"id": obj["id"], "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        obj = self.found(request)
        if not obj.get("background"):
            raise _Reject(self.engine.openai_error(400, "Only responses created with background=true can be cancelled."))
        if "_final" in obj:
            obj = {k: v for k, v in obj.items() if k != "_final"} | {"status": "cancelled"}
            self.stored[obj["id"]] = obj
        return _public(obj)

    async def input_items(self, request: web.Request) -> web.Response:
        obj = self.found(request)
        data = list(reversed(self.inputs.get(obj["id"], [])))
        if request.query.get("order") == "asc":
            data.reverse()
        return _public({
            "object": "list", "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
        })


def _public(obj: dict[str, Any]) -> web.Response:
    return _json_response({k: v for k, v in obj.items() if k != "_final"})


def _events(obj: dict[str, Any], words: list[str]) -> list[tuple[str | None, Any]]:
    """The Responses API stream of ``obj``: lifecycle events around one message's text deltas."""
    item = obj["output"][0]
    part = item["content"][0]
    start = {**obj, "status": "in_progress", "output": [], "usage": None}
    ref = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    payloads: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **ref, "part": {**part, "text": ""}},
        *({"type": "response.output_text.delta", **ref, "delta": d, "logprobs": []} for d in _Engine.pieces(words)),
        {"type": "response.output_text.done", **ref, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **ref, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": obj},
    ]
    return [(p["type"], {"type": p["type"], "sequence_number": n, **p}) for n, p in enumerate(payloads)]

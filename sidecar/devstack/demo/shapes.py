"""Reply shapes of the demo engine beyond plain text.

The demo engine (:mod:`sidecar.devstack.demo.engine`) answers ``tools``,
``response_format``, ``n`` and ``logprobs`` with plausible, deterministic
content, so SDK helpers such as ``chat.completions.parse()`` or LangChain's
``with_structured_output`` work against ``model-router up``:

* :func:`schema_instance` builds a JSON value that matches a JSON Schema
  (objects, arrays, strings with ``enum``/``const``/``format``, bounded
  numbers, ``anyOf``/``oneOf`` first branch, ``$ref`` into ``$defs``).
* :func:`openai_tool` / :func:`anthropic_tool` pick the tool a request makes
  the engine call, honouring ``tool_choice``.
* :func:`chat_replies` plans the ``n`` choices of a chat completion: a tool
  call, JSON for ``response_format``, or text (distinct per choice).
* :func:`chat_logprobs` / :func:`completion_logprobs` give per-token
  logprobs with top alternatives.

Nothing here does I/O; the engine turns the plans into responses and streams.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "MAX_CHOICES",
    "Reply",
    "ToolCall",
    "anthropic_tool",
    "chat_choice",
    "chat_deltas",
    "chat_logprobs",
    "chat_replies",
    "choice_count",
    "completion_logprobs",
    "format_json",
    "json_pieces",
    "openai_tool",
    "schema_instance",
]

MAX_CHOICES = 16
MAX_DEPTH = 8
# The :online loop's own search tool: the engine calls it only when a
# ``[search:N]`` marker asks (see ``_Engine.scripted_tools``).
SCRIPTED_TOOL = "web_search"
_ALTERNATIVES = (" the", " a", " and", ",", ".", " of")
_FORMATS = {
    "date": "2026-01-15",
    "date-time": "2026-01-15T12:00:00Z",
    "time": "12:00:00",
    "email": "demo@example.com",
    "uri": "https://example.com/demo",
    "url": "https://example.com/demo",
    "hostname": "demo.example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


@dataclass(frozen=True)
class ToolCall:
    """A function call the engine makes: the tool's name and its JSON arguments."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """One planned choice: text content or a tool call, with its stream pieces."""

    content: str | None
    tool_call: ToolCall | None
    pieces: list[str]

    @property
    def tokens(self) -> int:
        return max(len(self.pieces), 1)


# ------------------------------------------------------------ JSON Schema


def schema_instance(schema: Any, hint: str = "value") -> Any:
    """A deterministic JSON value matching ``schema`` (``hint`` names string content)."""
    return _Generator(schema if isinstance(schema, dict) else {}).value(schema, hint, 0)


class _Generator:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root

    def resolve(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """Follow ``$ref`` (local pointers only) and merge ``allOf``."""
        hops = 0
        while isinstance(schema.get("$ref"), str) and hops < MAX_DEPTH:
            target: Any = self.root
            ref: str = schema["$ref"]
            for part in ref.lstrip("#").split("/"):
                if part:
                    part = part.replace("~1", "/").replace("~0", "~")
                    target = target.get(part) if isinstance(target, dict) else None
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**(target if isinstance(target, dict) else {}), **rest}
            hops += 1
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                if isinstance(part, dict):
                    merged = _merge(self.resolve(part, depth + 1), merged)
            schema = merged
        return schema

    def value(self, schema: Any, hint: str, depth: int) -> Any:
        if not isinstance(schema, dict) or depth > 4 * MAX_DEPTH:  # a schema that only recurses
            return None
        schema = self.resolve(schema, depth)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        for key in ("anyOf", "oneOf"):
            branches = [b for b in _list(schema.get(key)) if isinstance(b, dict)]
            if branches:
                if depth >= MAX_DEPTH and any(b.get("type") == "null" for b in branches):
                    return None
                chosen = next((b for b in branches if b.get("type") != "null"), branches[0])
                return self.value({**{k: v for k, v in schema.items() if k != key}, **chosen}, hint, depth + 1)
        kind = _type_of(schema)
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, hint, depth)
        if kind == "integer":
            return _integer(schema)
        if kind == "number":
            return _number(schema)
        if kind == "boolean":
            return True
        if kind == "null":
            return None
        return _string(schema, hint)

    def object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        if not isinstance(props, dict):
            return {}
        required = {r for r in _list(schema.get("required")) if isinstance(r, str)}
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if depth >= MAX_DEPTH and name not in required:
                continue
            out[name] = self.value(sub, name, depth + 1)
        return out

    def array(self, schema: dict[str, Any], hint: str, depth: int) -> list[Any]:
        prefix = [s for s in _list(schema.get("prefixItems")) if isinstance(s, dict)]
        low = _int(schema.get("minItems"), 0) or 0
        high = _int(schema.get("maxItems"), None)
        count = max(low, len(prefix), 0 if depth >= MAX_DEPTH else 1)
        if high is not None:
            count = min(count, high)
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [self.value(prefix[i] if i < len(prefix) else items, hint, depth + 1) for i in range(count)]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, with their ``properties`` and ``required`` combined."""
    out = {**base, **over}
    props = {**_dict(base.get("properties")), **_dict(over.get("properties"))}
    if props:
        out["properties"] = props
    required = [r for r in [*_list(base.get("required")), *_list(over.get("required"))] if isinstance(r, str)]
    if required:
        out["required"] = list(dict.fromkeys(required))
    return out


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _bounds(schema: dict[str, Any]) -> tuple[float | None, float | None, bool, bool]:
    def num(key: str) -> float | None:
        v = schema.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    low, high = num("minimum"), num("maximum")
    ex_low, ex_high = num("exclusiveMinimum"), num("exclusiveMaximum")
    if ex_low is not None and (low is None or ex_low >= low):
        low, low_open = ex_low, True
    else:
        low_open = False
    if ex_high is not None and (high is None or ex_high <= high):
        high, high_open = ex_high, True
    else:
        high_open = False
    return low, high, low_open, high_open


def _integer(schema: dict[str, Any]) -> int:
    low, high, low_open, high_open = _bounds(schema)
    lo = None if low is None else (math.floor(low) + 1 if low_open else math.ceil(low))
    hi = None if high is None else (math.ceil(high) - 1 if high_open else math.floor(high))
    value = 1
    if lo is not None and value < lo:
        value = lo
    if hi is not None and value > hi:
        value = hi
    step = _int(schema.get("multipleOf"), None)
    if step and step > 0 and value % step:
        up = value + (step - value % step)
        value = up if hi is None or up <= hi else value - value % step
    return value


def _number(schema: dict[str, Any]) -> float:
    low, high, low_open, high_open = _bounds(schema)
    value = 1.5
    if low is not None and (value < low or (low_open and value <= low)):
        value = (low + high) / 2 if high is not None else low + 1.0
    if high is not None and (value > high or (high_open and value >= high)):
        value = (low + high) / 2 if low is not None else high - 1.0
    return float(value)


def _string(schema: dict[str, Any], hint: str) -> str:
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    text = f"demo {hint}"
    low = _int(schema.get("minLength"), 0) or 0
    high = _int(schema.get("maxLength"), None)
    if len(text) < low:
        text += "x" * (low - len(text))
    if high is not None:
        text = text[:high]
    return text


# -------------------------------------------------------------------- tools


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _last_role_is_tool_result(messages: Any) -> bool:
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return False
    last = messages[-1]
    if last.get("role") == "tool":
        return True
    content = last.get("content")
    return isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content)


def openai_tool(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The (name, parameters schema) of the Chat Completions tool to call, or None.

    ``tool_choice: none`` calls nothing; a named function calls it;
    ``required`` calls the first tool; ``auto`` (the default) calls the first
    tool other than the :online search tool, unless the conversation ends
    with a tool result (then the engine answers in text).
    """
    tools = [t.get("function") for t in _list(body.get("tools")) if isinstance(t, dict)]
    functions = [f for f in tools if isinstance(f, dict) and isinstance(f.get("name"), str)]
    choice = body.get("tool_choice", "auto")
    if not functions or choice == "none":
        return None
    if isinstance(choice, dict):
        name = _dict(choice.get("function")).get("name")
        chosen = next((f for f in functions if f["name"] == name), None)
    elif choice == "required":
        chosen = functions[0]
    else:
        if _last_role_is_tool_result(body.get("messages")):
            return None
        chosen = next((f for f in functions if f["name"] != SCRIPTED_TOOL), None)
    return None if chosen is None else (chosen["name"], chosen.get("parameters") or {})


def anthropic_tool(body: dict[str, Any]) -> tuple[str, Any] | None:
    """The (name, input schema) of the Messages API tool to call, or None.

    ``tool_choice`` ``{type: none}`` calls nothing, ``{type: tool, name}``
    that tool, ``{type: any}`` the first client tool, ``{type: auto}`` (the
    default) the first client tool unless the last turn carries tool results.
    Server tools (no ``input_schema``) are never called.
    """
    tools = [t for t in _list(body.get("tools")) if isinstance(t, dict) and isinstance(t.get("name"), str)]
    client = [t for t in tools if isinstance(t.get("input_schema"), dict)]
    raw = body.get("tool_choice")
    choice: dict[str, Any] = raw if isinstance(raw, dict) else {"type": "auto"}
    kind = choice.get("type")
    if not client or kind == "none":
        return None
    if kind == "tool":
        chosen = next((t for t in client if t["name"] == choice.get("name")), None)
    elif kind == "any":
        chosen = client[0]
    else:
        if _last_role_is_tool_result(body.get("messages")):
            return None
        chosen = client[0]
    return None if chosen is None else (chosen["name"], chosen["input_schema"])


# ------------------------------------------------------------------- choices


def choice_count(body: dict[str, Any]) -> int:
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool):
        return 1
    return max(1, min(n, MAX_CHOICES))


def json_pieces(text: str, size: int = 8) -> list[str]:
    """Stream pieces of a JSON text (their concatenation is the text)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def format_json(fmt: Any, words: list[str]) -> str | None:
    """The JSON text a ``response_format`` (or Responses ``text.format``) asks for, or None.

    ``json_object`` gives ``{"answer": <text>}``; ``json_schema`` a value of
    its schema, nested under ``json_schema`` (Chat Completions) or inline
    (Responses API).
    """
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_object":
        return orjson.dumps({"answer": " ".join(words)}).decode()
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            spec = fmt
        return orjson.dumps(schema_instance(spec.get("schema") or {})).decode()
    return None


def chat_replies(body: dict[str, Any], words: list[str]) -> list[Reply]:
    """The ``n`` choices of a chat completion for ``body``; ``words`` is the text reply."""
    count = choice_count(body)
    tool = openai_tool(body)
    if tool is not None:
        arguments = orjson.dumps(schema_instance(tool[1])).decode()
        call = ToolCall(tool[0], arguments)
        return [Reply(None, call, json_pieces(arguments)) for _ in range(count)]
    text = format_json(body.get("response_format"), words)
    if text is not None:
        return [Reply(text, None, json_pieces(text)) for _ in range(count)]
    replies = []
    for index in range(count):
        chosen = words if index == 0 else [*words, f"(choice {index + 1})"]
        pieces = [w if i == 0 else f" {w}" for i, w in enumerate(chosen)]
        replies.append(Reply(" ".join(chosen), None, pieces))
    return replies


# ------------------------------------------------------------------ logprobs


def _logprob(token: str) -> float:
    digest = hashlib.sha256(token.encode()).digest()
    return -round(0.01 + int.from_bytes(digest[:2], "big") / 65535 * 2.5, 4)


def _top(token: str, count: int) -> list[tuple[str, float]]:
    """The chosen token first, then distinct lower-probability alternatives."""
    lp = _logprob(token)
    out = [(token, lp)]
    for alt in _ALTERNATIVES:
        if len(out) >= count:
            break
        if alt != token:
            out.append((alt, round(lp - len(out) * 1.25, 4)))
    return out[:count]


def chat_logprobs(pieces: list[str], top: Any) -> dict[str, Any]:
    """A Chat Completions ``logprobs`` object for the streamed ``pieces``."""
    count = _int(top, 0) or 0
    content = []
    for piece in pieces:
        alternatives = [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in _top(piece, min(count, 20))
        ]
        content.append(
            {"token": piece, "logprob": _logprob(piece), "bytes": list(piece.encode()), "top_logprobs": alternatives}
        )
    return {"content": content, "refusal": None}


def completion_logprobs(pieces: list[str], top: Any, offset: int = 0) -> dict[str, Any]:
    """A legacy Completions ``logprobs`` object (``logprobs: k`` alternatives per token)."""
    count = max(_int(top, 0) or 0, 1)
    offsets, position = [], offset
    for piece in pieces:
        offsets.append(position)
        position += len(piece)
    return {
        "tokens": list(pieces),
        "token_logprobs": [_logprob(p) for p in pieces],
        "top_logprobs": [dict(_top(p, min(count, 5))) for p in pieces],
        "text_offset": offsets,
    }


# ------------------------------------------------------- chat payload parts


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.tool_call is not None else "stop"


def _call_id(index: int, seq: str) -> str:
    return f"call_{seq}_{index}"


def chat_choice(index: int, reply: Reply, body: dict[str, Any], seq: str) -> dict[str, Any]:
    """One non-streamed Chat Completions choice for ``reply``."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_call is not None:
        message["tool_calls"] = [{
            "id": _call_id(index, seq), "type": "function",
            "function": {"name": reply.tool_call.name, "arguments": reply.tool_call.arguments},
        }]
    logprobs = None
    if body.get("logprobs"):  # a tool call's arguments carry no content logprobs
        logprobs = chat_logprobs(reply.pieces if reply.tool_call is None else [], body.get("top_logprobs"))
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": _finish(reply)}


def chat_deltas(index: int, reply: Reply, body: dict[str, Any], seq: str) -> list[dict[str, Any]]:
    """The streamed choice objects of ``reply``: role, one per piece, then the finish."""
    want_logprobs = bool(body.get("logprobs"))
    out: list[dict[str, Any]] = []
    if reply.tool_call is not None:
        call = reply.tool_call
        first = {"index": 0, "id": _call_id(index, seq), "type": "function",
                 "function": {"name": call.name, "arguments": ""}}
        out.append({"role": "assistant", "content": None, "tool_calls": [first]})
        out += [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in reply.pieces]
    else:
        out.append({"role": "assistant", "content": ""})
        out += [{"content": p} for p in reply.pieces]
    choices = []
    for position, delta in enumerate(out):
        logprobs = None
        if want_logprobs and position and reply.tool_call is None:
            logprobs = chat_logprobs([reply.pieces[position - 1]], body.get("top_logprobs"))
        choices.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None})
    choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": _finish(reply)})
    return choices

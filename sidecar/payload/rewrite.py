"""Rewriting a complete JSON response and reading its token usage.

:func:`rewrite_json_body` optionally replaces the model name reported by the
upstream with the name the client asked for, tags a Responses API object's
ids, and reads the token usage into a :class:`Usage`. A streamed response is
:mod:`sidecar.payload.sse`'s; both read usage with the readers here. Everything
here is pure computation: no I/O, no logging.

Family specific behaviour (``family`` is ``"openai"`` or ``"anthropic"``):

openai
    Chat Completions bodies and chunks carry a top-level ``model`` and
    ``usage: {prompt_tokens, completion_tokens}``. Responses API bodies carry
    a top-level ``model`` and ``usage: {input_tokens, output_tokens}``;
    Responses API stream events carry both inside ``response``
    (``{"type": "response.completed", "response": {"model": ..., "usage": ...}}``).
anthropic
    Message bodies carry a top-level ``model`` and
    ``usage: {input_tokens, output_tokens}``. Streams carry the model and the
    input count in ``message_start`` (``message.model``, ``message.usage``)
    and the cumulative output count in every ``message_delta``
    (``usage.output_tokens``; the last one is the total).

Token counts that are not non-negative integers are read as ``0``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from .jsonedit import SCAN_ERRORS, id_edits, object_edits, splice

__all__ = [
    "ID_KEYS",
    "MAX_JSON_REWRITE",
    "Usage",
    "check_family",
    "count",
    "loads",
    "read_anthropic_usage",
    "read_openai_usage",
    "rewrite_json_body",
]

MAX_JSON_REWRITE = 32 * 1024 * 1024
"""JSON bodies longer than this many bytes are passed through untouched and
their usage is not read. Read at call time, so it can be changed at runtime."""

_FAMILIES = ("openai", "anthropic")

# A Responses API object's own id, and the one it continues.
ID_KEYS = (b'"id"', b'"previous_response_id"')

@dataclass
class Usage:
    """Token usage reported by the upstream.

    ``seen`` is true once a usage object has been found in the response, so
    a genuine zero can be told apart from "not reported".
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    seen: bool = False


def count(value: object) -> int:
    """Return ``value`` if it is a non-negative ``int`` (not ``bool``), else 0."""
    return value if type(value) is int and value >= 0 else 0


def read_openai_usage(u: dict[str, Any], usage: Usage) -> None:
    """Store an OpenAI usage object (Chat Completions or Responses API keys)."""
    if "prompt_tokens" in u or "completion_tokens" in u:
        usage.prompt_tokens = count(u.get("prompt_tokens"))
        usage.completion_tokens = count(u.get("completion_tokens"))
    else:
        usage.prompt_tokens = count(u.get("input_tokens"))
        usage.completion_tokens = count(u.get("output_tokens"))
    usage.seen = True


def read_anthropic_usage(u: dict[str, Any], usage: Usage) -> None:
    """Store an Anthropic usage object (``input_tokens``/``output_tokens``)."""
    usage.prompt_tokens = count(u.get("input_tokens"))
    usage.completion_tokens = count(u.get("output_tokens"))
    usage.seen = True


def check_family(family: str) -> None:
    if family not in _FAMILIES:
        raise ValueError(f"unknown API family {family!r}; expected one of {_FAMILIES}")


def loads(data: bytes) -> Any:
    """Parse a JSON payload as an engine may emit it, or None.

    Engines do emit what strict JSON forbids: ``NaN`` and ``Infinity`` in
    logprobs, lone surrogate escapes in generated text. Such a payload still
    carries a model name and usage, so it is read by the standard library's
    lenient parser when orjson refuses it (the edits are byte splices either way).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def rewrite_json_body(
    body: bytes, model: str | None, family: str, id_tag: Callable[[str], str] | None = None,
) -> tuple[bytes, Usage]:
    """Rewrite the top-level ``model`` of a complete JSON response and read its usage.

    When ``model`` is not ``None`` and the body is a JSON object whose
    top-level ``model`` is a string different from ``model``, that value is
    replaced. When ``id_tag`` is not ``None`` and the body is a Responses API
    object (top-level ``"object": "response"``), its ``id`` and
    ``previous_response_id`` become ``id_tag(value)`` (see :mod:`sidecar.payload.response_ids`).
    Every other byte is kept. In every other case (nothing to change, not a
    JSON object, invalid JSON, body longer than :data:`MAX_JSON_REWRITE`)
    returns ``body`` itself.

    Usage is read from the top-level ``usage`` object: ``prompt_tokens`` /
    ``completion_tokens`` or ``input_tokens`` / ``output_tokens`` for
    ``"openai"``, ``input_tokens`` / ``output_tokens`` for ``"anthropic"``.
    Bodies that are too large or not parsable yield an empty :class:`Usage`.

    Raises ``ValueError`` for an unknown ``family``.
    """
    check_family(family)
    usage = Usage()
    if len(body) > MAX_JSON_REWRITE:
        return body, usage
    obj = loads(body)
    if type(obj) is not dict:
        return body, usage
    u = obj.get("usage")
    if type(u) is dict:
        if family == "openai":
            read_openai_usage(u, usage)
        else:
            read_anthropic_usage(u, usage)
    current = obj.get("model")
    rename = model is not None and type(current) is str and current != model
    tag = id_tag is not None and obj.get("object") == "response"
    if not (rename or tag):
        return body, usage
    try:
        edits = object_edits(body, orjson.dumps(model), True, None, False) if rename else []
        if tag and id_tag is not None:
            edits = sorted([*edits, *id_edits(body, ID_KEYS, None, id_tag)])
    except SCAN_ERRORS:
        return body, usage
    return (splice(body, edits) if edits else body), usage

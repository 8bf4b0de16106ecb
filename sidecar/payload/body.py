"""Reading and rewriting the ``model`` of a request body (JSON or multipart)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl

import orjson

from ..errors import Kind
from .jsonedit import WS, string_end, value_end

MAX_MODEL_NAME = 256
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# orjson reads 1024 levels of nesting but writes only 255, and the router
# re-encodes parsed bodies (cache keys, rewrites): deeper bodies are refused.
MAX_JSON_DEPTH = 255


class BodyError(Exception):
    """The request body cannot be used; ``kind`` names the error reply and
    ``param`` the request field it is about (None: the body as a whole)."""

    def __init__(self, kind: Kind, message: str, param: str | None = "model"):
        self.kind: Kind = kind
        self.param = param
        super().__init__(message)


def model_name_problem(name: object) -> tuple[Kind, str] | None:
    """What keeps ``name`` from being a model name (the error kind and what
    is wrong), or None: the one rule for request bodies, the config and the
    names engines list."""
    if not isinstance(name, str):
        return "missing_model", "must be a string"
    if _CONTROL.search(name) is not None:
        return "invalid_model", "must not contain control characters (C0, DEL, C1, U+2028, U+2029)"
    if not name.strip():
        return "missing_model", "must not be empty"
    if len(name) > MAX_MODEL_NAME:
        return "invalid_model", f"is longer than {MAX_MODEL_NAME} characters"
    return None


def check_model_name(model: Any) -> str:
    problem = model_name_problem(model)
    if problem is not None:
        raise BodyError(problem[0], f"The 'model' field {problem[1]}.")
    return model  # type: ignore[no-any-return]


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        if not body.strip():
            raise BodyError("invalid_json", "The request body is empty; a JSON object is required.",
                            param=None) from None
        raise BodyError("invalid_json", "The request body is not valid JSON.", param=None) from None
    if not isinstance(data, dict):
        raise BodyError("invalid_json", "The request body must be a JSON object.", param=None)
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:
        try:
            orjson.dumps(data)
        except orjson.JSONEncodeError:
            raise BodyError("invalid_json", f"The request body nests deeper than {MAX_JSON_DEPTH} levels.",
                            param=None) from None
    return data


def top_level_spans(body: bytes, keys: set[str]) -> dict[str, list[tuple[int, int]]]:
    """Byte spans of the values of the wanted top-level keys (every occurrence).

    Works on a body that already parsed as a JSON object.
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    pos = body.index(b"{") + 1
    n = len(body)
    while pos < n:
        while pos < n and body[pos] in WS or (pos < n and body[pos] == 0x2C):
            pos += 1
        if pos >= n or body[pos] == 0x7D:
            break
        key_end = string_end(body, pos)
        key = orjson.loads(body[pos:key_end])
        pos = body.index(b":", key_end) + 1
        while body[pos] in WS:
            pos += 1
        end = value_end(body, pos)
        if key in keys:
            spans.setdefault(key, []).append((pos, end))
        pos = end
    return spans


_SHORT_VALUE = 4096  # encoded bytes of an old value located by scanning it
# A \\u escape of an ASCII letter, digit or underscore: the only way to spell
# a key's characters other than as themselves.
_KEY_ESCAPE = re.compile(rb"\\u00(?:3[0-9]|[4-7][0-9a-fA-F])")
# An integer literal past 64 bits, which the parser reads as a float.
_BIG_INTEGER = re.compile(rb"[0-9]{19}")


def _literal_spans(body: bytes, values: dict[str, object], parsed: dict[str, Any]) -> dict[str, tuple[int, int]] | None:
    """Where the present keys' values are, found with native searches only: a
    lone literal ``"key"`` in a body where no escape spells a key's characters
    can only be the top-level key, and a short value ends within a few
    searches. None when that cannot settle it (a key spelled twice or with
    escapes, a long value)."""
    if _KEY_ESCAPE.search(body):
        return None
    spans: dict[str, tuple[int, int]] = {}
    for key in values:
        if key not in parsed:
            continue  # inserted first
        old = parsed[key]
        string = isinstance(old, str)
        if string:
            # At most 6 bytes per character encoded (a \\u escape): no need to encode a short one.
            if len(old) > _SHORT_STRING and len(orjson.dumps(old)) > _SHORT_VALUE:
                return None
        elif not isinstance(old, (bool, int, float)) and old is not None and len(orjson.dumps(old)) > _SHORT_VALUE:
            return None
        needle, member, string_member = _member(key)
        if body.count(needle) != 1:
            return None
        # A string is found with its key, in one native search; another value from where the key's match ends.
        found = (string_member if string else member).search(body)
        if found is None:  # not followed by ':' -> not a key
            return None
        spans[key] = found.span(1) if string else (found.end(), value_end(body, found.end()))
    return spans


_SHORT_STRING = (_SHORT_VALUE - 2) // 6  # characters of a string value that surely encodes within _SHORT_VALUE
_STRING = rb'("[^"\\]*(?:\\.[^"\\]*)*")'  # a JSON string (group 1)
# By key (the router's own few keys): the key as JSON; the key and its colon
# (the match ends where the value starts); the same followed by a string value.
_MEMBERS: dict[str, tuple[bytes, re.Pattern[bytes], re.Pattern[bytes]]] = {}


def _member(key: str) -> tuple[bytes, re.Pattern[bytes], re.Pattern[bytes]]:
    found = _MEMBERS.get(key)
    if found is None:
        needle = orjson.dumps(key)
        colon = re.escape(needle) + rb"[ \t\r\n]*:[ \t\r\n]*"
        found = needle, re.compile(colon), re.compile(colon + _STRING)
        if len(_MEMBERS) < 64:
            _MEMBERS[key] = found
    return found


def set_top_level(body: bytes, values: dict[str, object], parsed: dict[str, Any] | None = None) -> bytes:
    """Set top-level keys of a JSON object body.

    Usually every other byte stays as it was: existing keys get the new value
    in place, missing keys are inserted first, so nothing the client sent is
    re-encoded. When native searches cannot place the edit (a key spelled
    twice or with escapes, a long or nested old value), the parsed object is
    encoded again with the new values: the same content as the engine reads it
    (the last of duplicate keys wins), in bounded native work whatever the
    body's size, never a scan over every member in Python (but for a body
    that also carries an integer past 64 bits, which encoding would round).
    """
    data = parsed if parsed is not None else parse_json(body)
    found = _literal_spans(body, values, data)
    if found is not None:
        if len(found) == len(values) == 1:  # the usual edit: one present key, its value replaced in place
            ((key, (start, end)),) = found.items()
            return body[:start] + orjson.dumps(values[key]) + body[end:]
        spans = {k: [span] for k, span in found.items()}
    elif not _BIG_INTEGER.search(body):
        return orjson.dumps({**data, **values})
    else:
        # Encoding again would round an integer past 64 bits: scan for the key
        # instead (bounded: the body passed sidecar.payload.json_budget).
        spans = top_level_spans(body, set(values))
    edits = [(s, e, orjson.dumps(values[k])) for k, lst in spans.items() for s, e in lst]
    missing = [k for k in values if k not in spans]
    if missing:
        at = body.index(b"{") + 1
        text = b",".join(orjson.dumps(k) + b":" + orjson.dumps(values[k]) for k in missing)
        rest = body[at:].lstrip()
        edits.append((at, at, text + (b"," if rest[:1] != b"}" else b"")))
    out = []
    last = 0
    for s, e, v in sorted(edits):
        out.append(body[last:s])
        out.append(v)
        last = e
    out.append(body[last:])
    return b"".join(out)


def named_models(path: str, body: bytes, content_type: str) -> list[str]:
    """Every model a request outside the ingress table names: every ``model``
    query parameter, a JSON object's top-level ``model``, every ``model`` of a
    urlencoded form and a multipart form's ``model`` field.

    A body an engine could read while the router cannot (JSON that orjson
    refuses, a form parsers read differently) raises BodyError: what the router
    cannot read, it cannot judge.
    """
    from .formdata import form_model_field

    names = _query_values(path, "model")
    media = content_type.partition(";")[0].strip().lower()
    if body.lstrip()[:1] == b"{":
        data = parse_json(body)
        if isinstance(data.get("model"), str):
            names.append(data["model"])
    elif media == "application/x-www-form-urlencoded":
        names += [v for k, v in parse_qsl(body.decode("latin-1"), keep_blank_values=True) if k == "model"]
    elif media == "multipart/form-data":  # the one multipart type engines read as a form
        field = form_model_field(body, content_type)
        if field is not None:
            names.append(field.value.decode("utf-8", "replace"))
    return names


def named_models_or_error(path: str, body: bytes, content_type: str) -> list[str] | BodyError:
    """:func:`named_models`, or the BodyError that says why the body cannot be judged."""
    try:
        return named_models(path, body, content_type)
    except BodyError as exc:
        return exc


def _query_values(path: str, key: str) -> list[str]:
    q = path.find("?")
    return [v for k, v in parse_qsl(path[q + 1:], keep_blank_values=True) if k == key] if q >= 0 else []


def query_model(path: str) -> str | None:
    """The ``model`` query parameter; a second copy is refused, since engines
    disagree on which one counts (Starlette the last, aiohttp the first)."""
    values = _query_values(path, "model")
    if len(values) > 1:
        raise BodyError("invalid_request", "The 'model' query parameter appears more than once.")
    return values[0] if values else None


def replace_query_model(path: str, model: str) -> str:
    from urllib.parse import quote, urlencode

    base, _, query = path.partition("?")
    pairs = [(k, model if k == "model" else v) for k, v in parse_qsl(query, keep_blank_values=True)]
    return base + "?" + urlencode(pairs, quote_via=quote)

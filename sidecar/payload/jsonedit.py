"""Scanning and editing JSON text in place.

The router changes one value in a body it did not write (a request's
``model``, a response's ``model``, an injected ``usage``) and must keep every
other byte: key order, spacing, escapes and numbers as the sender wrote them.
These functions work on text that a JSON parser has already accepted, so they
can rely on it being well formed. An edit is ``(start, end, replacement)``: the
bytes ``[start, end)`` give way to ``replacement``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import orjson

__all__ = ["MODEL_KEY", "SCAN_ERRORS", "USAGE_KEY", "WS", "object_edits", "id_edits", "splice", "splice_lines", "string_end", "value_end"]

WS = b" \t\r\n"
_LITERAL_END = re.compile(rb"[,}\]\s]")


def string_end(body: bytes, start: int) -> int:
    """Index just past the JSON string that opens at ``start``."""
    j = start
    while True:
        j = body.find(b'"', j + 1)
        if j < 0:
            raise ValueError("unterminated string")
        k = j - 1
        while body[k] == 0x5C:  # backslash
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j + 1


def value_end(body: bytes, start: int) -> int:
    c = body[start]
    if c == 0x22:
        return string_end(body, start)
    if c not in (0x7B, 0x5B):  # { [
        m = _LITERAL_END.search(body, start)
        return m.start() if m else len(body)
    depth = 0
    pos = start
    while True:
        m = _NESTED_TOKEN.search(body, pos)
        if m is None:
            raise ValueError("unbalanced brackets")
        t = body[m.start()]
        if t == 0x22:
            pos = string_end(body, m.start())
            continue
        depth += 1 if t in (0x7B, 0x5B) else -1
        pos = m.end()
        if depth == 0:
            return pos


_NESTED_TOKEN = re.compile(rb'["{}\[\]]')

# A \\u escape of an ASCII letter: the only way to spell a key's letters
# other than as themselves.
_LETTER_ESCAPE = re.compile(rb"\\u00[4-7]")

MODEL_KEY = b'"model"'
USAGE_KEY = b'"usage"'

# Scanning JSON that has already parsed can only fail on a bug; such an
# event or body is then released unchanged.
SCAN_ERRORS = (ValueError, IndexError, TypeError)

# A replacement of ``data[start:end]`` by the bytes given.
Edit = tuple[int, int, bytes]
# ``(key start, key end, value start, value end)`` of an object member.
Member = tuple[int, int, int, int]
# ``(data offset, content offset, length)`` of one SSE data line's value.
Segment = tuple[int, int, int]


def _skip_ws(data: bytes, pos: int) -> int:
    while data[pos] in WS:
        pos += 1
    return pos


def _members(data: bytes, pos: int) -> list[Member]:
    """``(key start, key end, value start, value end)`` of every member of the
    object that opens at ``data[pos]``, in order."""
    out: list[Member] = []
    pos += 1
    while True:
        c = data[pos]
        if c in WS or c == 0x2C:  # ","
            pos += 1
            continue
        if c == 0x7D:  # "}"
            return out
        key_end = string_end(data, pos)
        start = _skip_ws(data, _skip_ws(data, key_end) + 1)
        end = value_end(data, start)
        out.append((pos, key_end, start, end))
        pos = end


def _is_key(data: bytes, start: int, end: int, literal: bytes) -> bool:
    """Whether the key ``data[start:end]`` is ``literal``, in any spelling."""
    key = data[start:end]
    return key == literal or (b"\\" in key and orjson.loads(key) == orjson.loads(literal))


def _past_comma(data: bytes, pos: int) -> int:
    """Where the next member's line content starts after the comma that
    follows ``pos``: spaces and tabs after the comma go with it, a line break
    stays."""
    pos = _skip_ws(data, pos) + 1
    while data[pos] == 32 or data[pos] == 9:
        pos += 1
    return pos


def _cut_lone_member(data: bytes, start: int, end: int) -> Edit:
    """The edit that removes the member spanning ``[start, end)`` and one comma
    next to it: the one after it, or else (the last member) the one before it,
    from the end of the previous value."""
    if data[_skip_ws(data, end)] == 0x2C:
        return start, _past_comma(data, end), b""
    before = start - 1
    while data[before] in WS:
        before -= 1
    if data[before] == 0x2C:
        before -= 1
        while data[before] in WS:
            before -= 1
        return before + 1, end, b""
    return start, end, b""


def _cut_members(data: bytes, members: list[Member], cut: list[int]) -> list[Edit]:
    """Edits that remove the members at the (ascending) indexes ``cut``: each run
    of neighbours goes with the comma after it, or, at the end of the object,
    from the end of the last kept value."""
    edits = []
    i = 0
    while i < len(cut):
        first = last = cut[i]
        while i + 1 < len(cut) and cut[i + 1] == last + 1:
            i += 1
            last = cut[i]
        if last + 1 < len(members):
            edits.append((members[first][0], _past_comma(data, members[last][3]), b""))
        elif first > 0:
            edits.append((members[first - 1][3], members[last][3], b""))
        else:
            edits.append((members[first][0], members[last][3], b""))
        i += 1
    return edits


def object_edits(
    data: bytes, value: bytes | None, top: bool, parent: bytes | None, cut_usage: bool
) -> list[Edit]:
    """The edits to the JSON object ``data``, in order.

    ``value`` (encoded JSON) replaces every string ``model`` at the top level
    (``top``) or inside the top-level object named by the key literal
    ``parent``; ``cut_usage`` removes the top-level ``usage`` member. The
    caller has checked on the parsed object that each target exists.

    Common case, without a scan: a key whose text occurs only once in
    ``data``, and no letter in ``data`` is spelled as a ``\\u`` escape, so
    that occurrence can only be the key the caller found. Its value is the
    next string (or ``null``) after it.
    """
    b = data.find(b"\\")
    if not (top and parent) and (b < 0 or _LETTER_ESCAPE.search(data, b) is None):
        edits: list[Edit] | None = []
        if value is not None:
            i = data.find(MODEL_KEY)
            if i < 0 or data.find(MODEL_KEY, i + 7) >= 0:
                edits = None
            else:
                start = data.find(b'"', i + 7)
                end = data.find(b'"', start + 1) + 1
                if data[end - 2] == 0x5C:  # the quote is escaped: scan the string
                    end = string_end(data, start)
                edits = [(start, end, value)]
        if cut_usage and edits is not None:
            i = data.find(USAGE_KEY)
            if i < 0 or data.find(USAGE_KEY, i + 7) >= 0:
                edits = None
            else:
                start = _skip_ws(data, _skip_ws(data, i + 7) + 1)  # past the colon
                cut = _cut_lone_member(data, i, value_end(data, start))
                if edits and cut[0] < edits[0][0]:
                    edits.insert(0, cut)
                else:
                    edits.append(cut)
        if edits is not None:
            return edits

    members = _members(data, data.index(b"{"))
    edits = []
    cut_at: list[int] = []
    for i, (ks, ke, vs, ve) in enumerate(members):
        if value is not None:
            if top and data[vs] == 0x22 and _is_key(data, ks, ke, MODEL_KEY):
                edits.append((vs, ve, value))
            elif parent is not None and data[vs] == 0x7B and _is_key(data, ks, ke, parent):
                for ks2, ke2, vs2, ve2 in _members(data, vs):
                    if data[vs2] == 0x22 and _is_key(data, ks2, ke2, MODEL_KEY):
                        edits.append((vs2, ve2, value))
        if cut_usage and _is_key(data, ks, ke, USAGE_KEY):
            cut_at.append(i)
    if cut_at:
        edits += _cut_members(data, members, cut_at)
    edits.sort()
    return edits


def id_edits(
    data: bytes, keys: tuple[bytes, ...], parent: bytes | None, tag: Callable[[str], str],
) -> list[Edit]:
    """Edits that replace every string value of the key literals ``keys`` by
    ``tag(value)`` (values holding an escape are left alone): at the top level
    of the object ``data``, or inside its top-level object named by the key
    literal ``parent``. ``tag`` returns text needing no escape."""
    members = _members(data, data.index(b"{"))
    if parent is not None:
        inner = [m for m in members if data[m[2]] == 0x7B and _is_key(data, m[0], m[1], parent)]
        members = [m2 for m in inner for m2 in _members(data, m[2])]
    return [
        (vs + 1, ve - 1, tag(data[vs + 1 : ve - 1].decode("utf-8")).encode())
        for ks, ke, vs, ve in members
        if data[vs] == 0x22 and b"\\" not in data[vs + 1 : ve - 1] and any(_is_key(data, ks, ke, k) for k in keys)
    ]


def splice(data: bytes, edits: Sequence[Edit], base: int = 0) -> bytes:
    """``data`` with ``edits`` applied; their positions are relative to ``base``."""
    if len(edits) == 1:
        start, end, rep = edits[0]
        return data[: base + start] + rep + data[base + end :]
    out: list[bytes] = []
    last = 0
    for start, end, rep in edits:
        out.append(data[last : base + start])
        out.append(rep)
        last = base + end
    out.append(data[last:])
    return b"".join(out)


def splice_lines(content: bytes, segments: Sequence[Segment], edits: Iterable[Edit]) -> bytes:
    """Apply ``edits`` made to an event's joined data to the event itself.

    ``segments`` holds ``(data offset, content offset, length)`` of each data
    line's value. The ``"\\n"`` that joins two values stays a line break: a
    removal that spans it takes from each line what it covers, and a
    replacement (a JSON string, which never holds a raw newline) lies within
    one line.
    """
    out: list[bytes] = []
    last = 0
    k = 0
    for start, end, rep in edits:
        while segments[k][0] + segments[k][2] < start:
            k += 1
        while True:
            off, at, n = segments[k]
            s = start if start > off else off
            e = end if end < off + n else off + n
            if s < e or rep:
                out.append(content[last : at + s - off])
                out.append(rep)
                last = at + e - off
                rep = b""
            if end <= off + n or k + 1 == len(segments):
                break
            k += 1
    out.append(content[last:])
    return b"".join(out)

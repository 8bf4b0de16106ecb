"""Rewriting a streamed (``text/event-stream``) response as it arrives, in
chunks with arbitrary boundaries: the model name the upstream reports, a
Responses API object's ids, the usage event the router added, and the token
usage read on the way (:mod:`sidecar.payload.rewrite` has the families'
shapes and the usage readers). Everything here is pure computation: no I/O,
no logging.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from .jsonedit import (
    MODEL_KEY,
    SCAN_ERRORS,
    USAGE_KEY,
    Edit,
    Segment,
    id_edits,
    object_edits,
    splice,
    splice_lines,
)
from .rewrite import ID_KEYS, Usage, check_family, count, loads, read_anthropic_usage, read_openai_usage

__all__ = ["MAX_SSE_LINE", "SSERewriter"]

MAX_SSE_LINE = 16 * 1024 * 1024
"""Default for :class:`SSERewriter` ``max_line``: an SSE event whose content
exceeds this many bytes is forwarded unmodified instead of being buffered."""

# A blank line (end of an SSE event) starts at the second byte of the first
# occurrence of one of these pairs; "\r\n" on its own is a single terminator.
_BLANK_LINE = re.compile(rb"\n[\r\n]|\r\r")

# Line-terminator styles seen so far in a stream; each selects a scanner
# that is exact for all styles up to and including it.
_LF_ONLY = 0
_CRLF = 1
_LONE_CR = 2

_RESPONSE = b'"response"'
_MESSAGE = b'"message"'
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')  # a chunk that ends a choice
# The members of a Chat Completions chunk; an injected usage chunk's other members are
# the engine's own (llama.cpp's timings) and move to the chunk before it.
_CHUNK_KEYS = frozenset({"id", "object", "created", "model", "system_fingerprint", "choices", "usage",
                         "service_tier", "obfuscation"})


class SSERewriter:
    """Incremental rewriter for one ``text/event-stream`` response.

    Feed the response body chunk by chunk with :meth:`feed` and call
    :meth:`finish` at end of stream. The concatenation of everything returned
    does not depend on where the chunk boundaries fall.

    Parsing follows the WHATWG event-stream format: lines end in ``\\n``,
    ``\\r\\n`` or ``\\r``; an event ends at a blank line; ``data:`` takes an
    optional single space; several ``data`` lines join with ``\\n``. Only
    complete events are released. An event is re-serialised only when its
    data is JSON that needs a change; then its data lines are replaced by a
    single ``data: <compact json>`` line (at the position of the last data
    line, ending like it, so no line terminators become adjacent that were
    not before) and every other line, including comments, ``event:``,
    ``id:`` and ``retry:`` lines and the terminating blank line, is kept
    byte for byte. Every other event, e.g. ``data:
    [DONE]``, non-JSON data or events without anything to rewrite, is
    released byte-identical.

    ``model``: the model name to put into responses, or ``None`` to leave
    model names alone. For ``"openai"`` the top-level ``model`` of every chunk
    is rewritten, and ``response.model`` of Responses API events
    (``"type": "response.*"``); for ``"anthropic"`` ``message.model`` of
    ``message_start`` events.

    ``strip_injected_usage`` (``"openai"`` only) is for streams in which the
    proxy itself requested ``stream_options.include_usage``: usage is still
    read, but the final ``"choices": []`` chunk that carries it is dropped
    (the whole event) and a ``usage`` member (``null``, or the counts engines
    such as vLLM with ``continuous_usage_stats`` put on every chunk) is removed
    from the other chunks. Members of the dropped chunk that are not part of
    a standard chunk (llama.cpp's ``timings``, which it puts on the last
    chunk) move to the chunk that ended the choices, where the engine puts
    them when usage is not asked for: that chunk is held back until the
    next event shows whether the usage chunk follows.

    ``usage`` holds the token usage seen so far: OpenAI takes the last
    non-null ``usage`` object of a chunk (or ``response.usage`` of a
    Responses API event); Anthropic takes ``message.usage`` of
    ``message_start`` and the cumulative ``usage.output_tokens`` of the last
    ``message_delta``. Only data that contains the relevant key literally
    (``"usage"``, ``"model"``, ``"message_start"``, ``"message_delta"``)
    is parsed.

    ``id_tag`` (``"openai"`` only): what ``response.id`` and
    ``response.previous_response_id`` of Responses API events become (see
    :mod:`sidecar.payload.response_ids`).

    ``max_line`` (default :data:`MAX_SSE_LINE`) bounds memory: an event
    whose content (everything before its blank line) is longer than this is
    forwarded unmodified, without being rewritten or read, as soon as that
    length is exceeded; processing resumes with the next event. At most about
    ``max_line`` plus one chunk is held at any time.
    """

    __slots__ = (
        "model",
        "family",
        "strip_injected_usage",
        "id_tag",
        "max_line",
        "usage",
        "_openai",
        "_buf",
        "_scan",
        "_passthrough",
        "_prev",
        "_lf_pending",
        "_lf_emit",
        "_mode",
        "_cr_tail",
        "_value",
        "_value_of",
        "_held",
        "_extras",
        "_finishing",
    )

    def __init__(
        self,
        model: str | None,
        family: str,
        *,
        strip_injected_usage: bool = False,
        id_tag: Callable[[str], str] | None = None,
        max_line: int | None = None,
    ) -> None:
        check_family(family)
        self.model = model
        self.family = family
        self.strip_injected_usage = strip_injected_usage and family == "openai"
        self.id_tag = id_tag if family == "openai" else None
        self.max_line = MAX_SSE_LINE if max_line is None else max_line
        self.usage = Usage()
        self._openai = family == "openai"
        self._start()
        self._value = b""
        self._value_of: str | None = None  # the model ``_value`` encodes
        self._held: bytes | None = None  # a finishing chunk held back, without its blank line
        self._extras: dict[str, Any] | None = None  # the engine's own members of the usage chunk just dropped
        self._finishing = False  # the event just read ends a choice

    def _start(self) -> None:
        """The scanner's state before a stream's first byte (and again after its end)."""
        self._buf = bytearray()
        self._scan = 0
        self._passthrough = False
        self._prev = b""
        self._lf_pending = False
        self._lf_emit = True
        self._mode = _LF_ONLY
        self._cr_tail = False

    @property
    def buffered(self) -> int:
        """Number of bytes currently held back (part of an incomplete event)."""
        return len(self._buf)

    @property
    def mid_event(self) -> bool:
        """Whether part of an oversized event has been released without its end."""
        return self._passthrough

    def feed(self, chunk: bytes) -> bytes:
        """Consume the next piece of the stream and return what can be released now.

        Every event completed by ``chunk`` is returned (rewritten where
        needed); an incomplete trailing event stays buffered, unless it has
        grown beyond ``max_line``, in which case it is released and the rest of
        it is forwarded as it arrives.
        """
        if not chunk:
            return b""
        mode = self._terminators(chunk)
        out: list[bytes | bytearray] = []
        if self._lf_pending:
            # The previous event ended in "\r" at a chunk boundary; a "\n"
            # here completes that same line terminator.
            self._lf_pending = False
            if chunk[0] == 10:
                if self._lf_emit:
                    out.append(b"\n")
                chunk = chunk[1:]
                if not chunk:
                    return b"".join(out)
        if self._passthrough:
            chunk = self._end_passthrough(chunk, out)
            if not chunk:
                return b"".join(out)
        data: bytes | bytearray
        buf = self._buf
        if buf:
            buf += chunk
            data = buf
            search = self._scan
        else:
            data = chunk
            search = 0
        pos, raw_from = self._events(data, search, mode, out)
        self._keep(data, pos, raw_from, out)
        if len(out) == 1:
            piece = out[0]
            return piece if type(piece) is bytes else bytes(piece)
        return b"".join(out)

    def _terminators(self, chunk: bytes) -> int:
        """The stream's line-terminator style once ``chunk`` is seen (it only widens)."""
        mode = self._mode
        if mode != _LONE_CR and (self._cr_tail or 13 in chunk):
            lone = chunk.count(13) - chunk.count(b"\r\n")
            if self._cr_tail and chunk[0] != 10:
                lone += 1
            tail = chunk[-1] == 13
            if tail:
                lone -= 1
            self._cr_tail = tail
            mode = self._mode = _LONE_CR if lone else _CRLF
        return mode

    def _end_passthrough(self, chunk: bytes, out: list[bytes | bytearray]) -> bytes:
        """Forward the rest of an oversized event; what follows its end ("" while it goes on)."""
        data = self._prev + chunk
        m = _BLANK_LINE.search(data)
        if m is None:
            self._prev = chunk[-1:]
            out.append(chunk)
            return b""
        end = self._blank_end(data, m.start() + 1, True)
        out.append(data[1:end])
        self._passthrough = False
        self._prev = b""
        return data[end:]

    def _events(self, data: bytes | bytearray, search: int, mode: int,
                out: list[bytes | bytearray]) -> tuple[int, int]:
        """Release every complete event of ``data`` (from ``search`` on, no blank
        line starts earlier) into ``out``: unchanged bytes as slices, rewritten
        events in their place. Returns where the first incomplete event starts
        and where the bytes not yet in ``out`` start."""
        n = len(data)
        pos = 0
        raw_from = 0
        max_line = self.max_line
        while pos < n:
            c = data[pos]
            if c == 10 or c == 13:
                b = pos
            elif mode == _LF_ONLY:
                i = data.find(10, search if search > pos else pos)
                while i != -1 and i + 1 < n and data[i + 1] != 10:
                    i = data.find(10, i + 1)
                if i == -1 or i + 1 == n:
                    break
                b = i + 1
            elif mode == _CRLF:
                i = data.find(10, search if search > pos else pos)
                while i != -1 and i + 1 < n and data[i + 1] != 10 and data[i + 1] != 13:
                    i = data.find(10, i + 1)
                if i == -1 or i + 1 == n:
                    break
                b = i + 1
            else:
                m = _BLANK_LINE.search(data, search if search > pos else pos)
                if m is None:
                    break
                b = m.start() + 1
            if b == pos:
                pos = self._blank_end(data, b, True)
                continue
            if b - pos > max_line:
                if self._held is not None:
                    out.append(data[raw_from:pos])
                    out.append(self.take_held())
                    raw_from = pos
                pos = self._blank_end(data, b, True)
                continue
            content = data[pos:b]
            if type(content) is not bytes:  # a slice of the buffer
                content = bytes(content)
            result = self._event(content)
            end = self._blank_end(data, b, result is not None)
            if result is not content:
                if raw_from < pos:
                    out.append(data[raw_from:pos])
                if result is not None:
                    out.append(result)
                    out.append(data[b:end])
                raw_from = end
            pos = end
        return pos, raw_from

    def _keep(self, data: bytes | bytearray, pos: int, raw_from: int, out: list[bytes | bytearray]) -> None:
        """After :meth:`_events`: buffer the incomplete event that starts at
        ``pos``, or release it when it has outgrown ``max_line``."""
        n = len(data)
        if n - pos > self.max_line:
            if self._held is not None:
                out.append(data[raw_from:pos])
                out.append(self.take_held())
                raw_from = pos
            self._passthrough = True
            self._prev = bytes(data[n - 1 :])
            out.append(data[raw_from:])
            self._buf = bytearray()
            self._scan = 0
            return
        if raw_from < pos:
            out.append(data[raw_from:pos])
        buf = self._buf
        if data is buf:
            if pos == n:
                self._buf = bytearray()
            elif pos:
                del buf[:pos]
        elif pos < n:
            self._buf = bytearray(data[pos:])
        self._scan = len(self._buf) - 1

    def finish(self) -> bytes:
        """Release whatever is still buffered at end of stream and reset.

        A buffered remainder that ends with a line terminator (an event
        missing only its blank line) is processed like a complete event; any
        other remainder is released as is.
        """
        rest = bytes(self._buf)
        self._start()
        if rest and (rest[-1] == 10 or rest[-1] == 13):
            result = self._event(rest)
            rest = b"" if result is None else result
        return self.take_held() + rest

    def take_held(self) -> bytes:
        """The finishing chunk held back (with its blank line), now; empty when none is."""
        held, self._held, self._extras = self._held, None, None
        return b"" if held is None else held + _terminator(held)

    def _blank_end(self, data: bytes | bytearray, b: int, emit: bool) -> int:
        """Return the end of the blank line starting at ``b``.

        A ``"\\r"`` that is the last available byte may be the first half of
        ``"\\r\\n"``; the decision is deferred to the next :meth:`feed`, which
        forwards (``emit``) or swallows a leading ``"\\n"``.
        """
        if data[b] == 10:
            return b + 1
        if b + 1 < len(data):
            return b + 2 if data[b + 1] == 10 else b + 1
        self._lf_pending = True
        self._lf_emit = emit
        return b + 1

    def _event(self, content: bytes) -> bytes | None:
        """Process one event's lines (without its blank line).

        Returns ``content`` itself when unchanged, the edited event, or
        ``None`` when the event is to be dropped.
        """
        last = len(content) - 1
        if content.startswith(b"data:") and content.find(10) == last and content.find(13) in (-1, last - 1):
            segments = None
            base = 6 if content[5] == 32 else 5
            data = content[base : -2 if content[-2] == 13 else -1]
        else:
            base = 0
            split = self._split(content)
            if split is None:
                return content
            segments, data = split

        if self.strip_injected_usage:
            return self._settle(content, self._edit(content, segments, data, base))
        return self._edit(content, segments, data, base)

    def _edit(self, content: bytes, segments: list[Segment] | None, data: bytes, base: int) -> bytes | None:
        """One event's edits: ``content``, the edited event, or None to drop it."""
        if self._openai:
            if (
                (self.model is None or data.find(MODEL_KEY) < 0) and data.find(USAGE_KEY) < 0
                and (self.id_tag is None or data.find(_RESPONSE) < 0)
                and (not self.strip_injected_usage or _FINISHED.search(data) is None)
            ):
                return content
        elif data.find(b'"message_start"') < 0 and data.find(b'"message_delta"') < 0:
            return content
        obj = loads(data)
        if type(obj) is not dict:
            return content
        try:
            edits = self._openai_edits(obj, data) if self._openai else self._anthropic_edits(obj, data)
        except SCAN_ERRORS:
            return content
        if edits is None:
            return None
        if not edits:
            return content
        if segments is None:
            if len(edits) == 1:
                start, end, rep = edits[0]
                return content[: base + start] + rep + content[base + end :]
            return splice(content, edits, base)
        return splice_lines(content, segments, edits)

    def _settle(self, content: bytes, result: bytes | None) -> bytes | None:
        """Hold a finishing chunk back until the next event: when that is the
        dropped usage chunk, the engine's own members of it join the held chunk,
        which takes its place. Called with each event's edit result."""
        finishing, self._finishing = self._finishing, False
        held, extras = self._held, self._extras
        self._held = self._extras = None
        if finishing and result is not None:
            self._held = result  # in this event's place goes the one held before it, if any
            return held
        if held is None:
            return result
        if result is None:  # the injected usage chunk
            return _with_members(held, extras) if extras else held
        return held + _terminator(held) + result

    @staticmethod
    def _split(content: bytes) -> tuple[list[Segment], bytes] | None:
        """Find an event's data lines and join their values.

        Returns ``(segments, data)``: ``(data offset, content offset, length)``
        of each data line's value, and the values joined with ``"\\n"``; or
        None when the event has no data field.
        """
        values = []
        segments = []
        at = 0
        off = 0
        for line in content.splitlines(True):
            start = at
            at += len(line)
            if not line.startswith(b"data"):
                continue
            ll = len(line)
            last = line[-1]
            if last == 10:
                ll -= 2 if ll > 1 and line[-2] == 13 else 1
            elif last == 13:
                ll -= 1
            if ll == 4:
                vs = 4
            elif line[4] == 58:
                vs = 6 if ll > 5 and line[5] == 32 else 5
            else:
                continue
            values.append(line[vs:ll])
            segments.append((off, start + vs, ll - vs))
            off += ll - vs + 1
        if not segments:
            return None
        return segments, (values[0] if len(values) == 1 else b"\n".join(values))

    def _openai_edits(self, obj: dict[str, Any], data: bytes) -> list[Edit] | None:
        """Apply OpenAI rules to a parsed chunk: read its usage and return the
        edits to its data (empty: unchanged), or ``None`` to drop it."""
        cut_usage = False
        if "usage" in obj:
            u = obj["usage"]
            if type(u) is dict:
                read_openai_usage(u, self.usage)
                if self.strip_injected_usage:
                    if obj.get("choices") == []:
                        self._extras = {k: v for k, v in obj.items() if k not in _CHUNK_KEYS}
                        return None  # the usage chunk the router asked for
                    cut_usage = True  # usage on a content or finish chunk (vLLM continuous_usage_stats)
            elif u is None and self.strip_injected_usage:
                cut_usage = True
        if self.strip_injected_usage:
            choices = obj.get("choices")
            self._finishing = type(choices) is list and any(
                type(c) is dict and c.get("finish_reason") is not None for c in choices)
        model = self.model
        top = False
        parent = None
        if model is not None:
            current = obj.get("model")
            top = type(current) is str and current != model
        resp = obj.get("response")
        tag: list[Edit] | None = None
        if type(resp) is dict:
            kind = obj.get("type")
            if type(kind) is str and kind.startswith("response."):
                if self.id_tag is not None:
                    tag = id_edits(data, ID_KEYS, _RESPONSE, self.id_tag)
                if model is not None:
                    current = resp.get("model")
                    if type(current) is str and current != model:
                        parent = _RESPONSE
                u = resp.get("usage")
                if type(u) is dict:
                    read_openai_usage(u, self.usage)
        if top or parent:
            value = self._value if self._value_of is model else self._encoded_model()
            edits = object_edits(data, value, top, parent, cut_usage)
        else:
            edits = object_edits(data, None, False, None, True) if cut_usage else []
        return sorted([*edits, *tag]) if tag else edits

    def _encoded_model(self) -> bytes:
        """``model`` as a JSON string, encoded once."""
        self._value = orjson.dumps(self.model)
        self._value_of = self.model
        return self._value

    def _anthropic_edits(self, obj: dict[str, Any], data: bytes) -> Sequence[Edit]:
        """Apply Anthropic rules to a parsed event: read its usage and return
        the edits to its data (empty: unchanged)."""
        kind = obj.get("type")
        if kind == "message_start":
            msg = obj.get("message")
            if type(msg) is not dict:
                return ()
            u = msg.get("usage")
            if type(u) is dict:
                read_anthropic_usage(u, self.usage)
            model = self.model
            current = msg.get("model")
            if model is not None and type(current) is str and current != model:
                return object_edits(data, self._encoded_model(), False, _MESSAGE, False)
        elif kind == "message_delta":
            u = obj.get("usage")
            if type(u) is dict:
                if "output_tokens" in u:
                    self.usage.completion_tokens = count(u["output_tokens"])
                self.usage.seen = True
        return ()


def _terminator(event: bytes) -> bytes:
    """The line terminator an event's lines end with: its blank line is one more."""
    if event.endswith(b"\r\n"):
        return b"\r\n"
    return event[-1:] if event[-1:] in (b"\n", b"\r") else b"\n"


def _with_members(event: bytes, members: dict[str, Any]) -> bytes:
    """A one-line ``data: {...}`` event with ``members`` added to its object (other shapes unchanged)."""
    end = event.rfind(b"}")
    if not event.startswith(b"data:") or end < 0 or event.count(b"\n", 0, len(event) - 1) or b"\r" in event[:-2]:
        return event
    added = b"".join(b"," + orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in members.items())
    return event[:end] + added + event[end:]

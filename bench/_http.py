"""Shared pieces of the benchmark clients: the chat request and an HTTP/1.1 response parser.

The request body and the API keys match ``bench/chat.lua`` (the wrk script), so
every load generator in ``bench/`` sends the same bytes.
"""

from __future__ import annotations

import math

KEY_PREFIX = "sk-bench-"
PATH = "/v1/chat/completions"


def key(i: int) -> str:
    """The ``i``-th API key of the benchmark config."""
    return f"{KEY_PREFIX}{i:04d}"


def chat_body(model: str, stream: bool = False, include_usage: bool = False) -> bytes:
    """A ~200 B chat completion request body (the same text as ``chat.lua``).

    ``include_usage``: a stream that asks for its own usage event
    (``stream_options.include_usage``).
    """
    body = (
        '{"model":"' + model + '","messages":[{"role":"system","content":"You are a helpful assistant."},'
        '{"role":"user","content":"Say hello in three words, please."}],"max_tokens":64,"temperature":0.2'
    )
    if stream:
        body += ',"stream":true'
        if include_usage:
            body += ',"stream_options":{"include_usage":true}'
    return (body + "}").encode()


def chat_requests(
    host: str, model: str, keys: int, *, stream: bool = False, events: int = 50, interval_ms: int = 1,
    include_usage: bool = False,
) -> list[bytes]:
    """One complete HTTP/1.1 keep-alive request per API key, in key order."""
    body = chat_body(model, stream, include_usage)
    extra = b""
    if stream:
        extra = f"x-demo-interval-ms: {interval_ms}\r\nx-demo-events: {events}\r\n".encode()
    out = []
    for i in range(max(keys, 1)):
        head = (
            f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key(i)}\r\nContent-Length: {len(body)}\r\n"
        ).encode()
        out.append(head + extra + b"\r\n" + body)
    return out


class ParseError(Exception):
    pass


class ResponseParser:
    """Incremental parser for HTTP/1.1 responses on one keep-alive connection.

    ``feed(data)`` returns the status codes of the responses completed by
    ``data``. Bodies with ``content-length`` and ``transfer-encoding: chunked``
    are understood; ``on_body`` (when set) is called with each piece of body
    bytes as it arrives, before the response completes.
    """

    __slots__ = ("buf", "state", "need", "status", "on_body", "keep_alive")

    _HEAD, _FIXED, _SIZE, _DATA, _TRAILER = range(5)

    def __init__(self, on_body=None) -> None:
        self.buf = bytearray()
        self.state = self._HEAD
        self.need = 0
        self.status = 0
        self.on_body = on_body
        self.keep_alive = True

    def feed(self, data: bytes) -> list[int]:
        self.buf += data
        done: list[int] = []
        buf = self.buf
        while True:
            if self.state == self._HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return done
                head = bytes(buf[:end]).lower()
                del buf[: end + 4]
                try:
                    self.status = int(head[9:12])
                except ValueError:
                    raise ParseError(f"bad status line: {head[:40]!r}") from None
                self.keep_alive = b"\r\nconnection: close" not in head
                if b"\r\ntransfer-encoding: chunked" in head:
                    self.state = self._SIZE
                    continue
                pos = head.find(b"\r\ncontent-length:")
                if pos < 0:
                    self.need = 0
                else:
                    eol = head.find(b"\r\n", pos + 2)
                    self.need = int(head[pos + 17 : eol if eol > 0 else len(head)])
                self.state = self._FIXED
            elif self.state == self._FIXED:
                if len(buf) < self.need:
                    if buf and self.on_body is not None:
                        self.on_body(bytes(buf))
                        self.need -= len(buf)
                        del buf[:]
                    return done
                if self.need and self.on_body is not None:
                    self.on_body(bytes(buf[: self.need]))
                del buf[: self.need]
                self.state = self._HEAD
                done.append(self.status)
            elif self.state == self._SIZE:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return done
                try:
                    size = int(bytes(buf[:eol]).split(b";")[0], 16)
                except ValueError:
                    raise ParseError(f"bad chunk size: {bytes(buf[:eol])[:40]!r}") from None
                del buf[: eol + 2]
                if size == 0:
                    self.state = self._TRAILER
                else:
                    self.need = size
                    self.state = self._DATA
            elif self.state == self._DATA:
                if len(buf) < self.need + 2:
                    return done
                if self.on_body is not None:
                    self.on_body(bytes(buf[: self.need]))
                del buf[: self.need + 2]
                self.state = self._SIZE
            else:  # trailers, then the blank line
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return done
                del buf[: eol + 2]
                if eol == 0:
                    self.state = self._HEAD
                    done.append(self.status)


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(math.ceil(p / 100.0 * len(sorted_values)) - 1, 0)
    return sorted_values[min(rank, len(sorted_values) - 1)]

"""How much JSON the router reads on its event loop.

Parsing is native (orjson), but building a Python object per value is not
free: a 30 MiB body of three million small members takes seconds to parse,
and 8 MiB of three million empty arrays nearly one; one worker's event loop
would serve nobody meanwhile. So before a body is parsed, what its parse
would build is bounded: at most ``MAX_MEMBERS`` object members (a key and a
value each, at any depth) and ``MAX_VALUES`` values of any kind.

- A body of no more bytes than either bound is within: each member takes
  a ``:``, and each value past the first a ``,``, ``[`` or ``{``.
- A body up to ``INLINE_BYTES`` whose structural bytes (``:`` for members;
  ``,``, ``[`` and ``{`` for values) are few enough, counted anywhere in it,
  is within at once: those are upper bounds, settled in native byte counts.
- Any other body that opens like JSON is counted exactly off the event loop:
  the same bytes outside strings, found by a vectorised scan (numpy) in a
  helper process in Linux's idle scheduling class. The scan reads strings as
  the JSON grammar does (a quote ends a string unless an odd run of
  backslashes escapes it), so up to a parser's first error it agrees with
  the parser whatever the text holds; it builds no object per value, and
  costs a fraction of a parse (about 0.2 s against 2.2 s for 30 MiB).
- A body over the bound is refused, and its refusal is held so that a
  worker answers such bodies one at a time, ``REFUSED_BYTES_PER_SECOND`` at
  most (for at most ``HOLD_PATIENCE_S`` each; Envoy is asked to wait that
  long, or, where it cannot be asked, as under Envoy Gateway, within half
  its message timeout). Cheap refusals would otherwise let one client push
  bodies through Envoy and the sidecar as fast as the loopback carries
  them, and moving those bytes, not judging them, is then what slows
  everyone else: each MiB costs the worker's event loop about 3 ms of
  copies (gRPC's message, the body read out of it, the hand-over to the
  helper), so 4 MiB/s keeps refused bodies to about 1% of its time.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

MAX_MEMBERS = 100_000
MAX_VALUES = 500_000
INLINE_BYTES = 1024 * 1024
REFUSED_BYTES_PER_SECOND = 4 * 1024 * 1024
HOLD_PATIENCE_S = 30.0  # the longest a refusal is held, its wait for its turn included
_SCAN_CHUNK = 4 * 1024 * 1024  # bytes scanned per numpy pass: bounds the helper's arrays
_LEADING_WS = re.compile(rb"[ \t\r\n]*")


class Size(NamedTuple):
    """What parsing a JSON text builds: its object members and its values.
    ``values`` counts every value once and an empty container twice (it is
    ``1 +`` the commas and opening brackets outside strings)."""

    members: int
    values: int


def upper_bound(body: bytes) -> Size:
    """A :class:`Size` no smaller than the body's, from native byte counts."""
    return Size(body.count(b":"), 1 + body.count(b",") + body.count(b"[") + body.count(b"{"))


def measure(body: bytes) -> Size:
    """The :class:`Size` of a JSON text, read as a JSON parser reads its
    strings (past a parser's first error the figure is the scan's, which is
    as good a refusal). Runs in the helper process."""
    import numpy as np

    # Escapes pair off left to right: drop escaped backslashes, then escaped
    # quotes; every quote left opens or closes a string.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    members = values = 0
    inside = 0
    for start in range(0, len(text), _SCAN_CHUNK):
        chunk = np.frombuffer(text, np.uint8, min(_SCAN_CHUNK, len(text) - start), start)
        in_string = np.bitwise_xor.accumulate(chunk == 0x22, dtype=np.uint8)  # 1 after an opening quote
        if inside:
            in_string ^= 1
        outside = in_string == 0
        members += int(np.count_nonzero((chunk == 0x3A) & outside))
        values += int(np.count_nonzero(((chunk == 0x2C) | (chunk == 0x5B) | (chunk == 0x7B)) & outside))
        inside = int(in_string[-1])
    return Size(members, values + 1)


def lowest_priority() -> None:
    """The helper's CPU priority: Linux's idle class where it exists (a
    request waking on this core preempts a count at once, where a nice 19
    task may hold the core for the rest of its slice), nice 19 elsewhere."""
    os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


class Budget:
    """One worker's judge of body sizes, with its helper process started on
    first need."""

    def __init__(self, max_members: int = MAX_MEMBERS, max_values: int = MAX_VALUES,
                 hold: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.max_members = max_members
        self.max_values = max_values
        self._small = min(max_members, max_values - 1)  # bytes that cannot hold too much (module docstring)
        self._hold = hold
        self._refusals = asyncio.Lock()
        self._pool: ProcessPoolExecutor | None = None

    async def excess(self, body: bytes) -> str | None:
        """What the body holds too much of (``"more than 100000 JSON object
        members"``), or None when the router may parse it."""
        if len(body) <= self._small:
            return None
        start = _LEADING_WS.match(body).end()  # type: ignore[union-attr]
        if body[start:start + 1] not in (b"{", b"["):
            return None  # not JSON (a form, say): the JSON parser never sees it
        if len(body) <= INLINE_BYTES and self._problem(upper_bound(body)) is None:
            return None
        if self._pool is None:
            # At the lowest CPU priority: a count yields the cores to the requests being served.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=lowest_priority)
        return self._problem(await asyncio.get_running_loop().run_in_executor(self._pool, measure, body))

    async def hold(self, size: int, patience: float = HOLD_PATIENCE_S) -> None:
        """Hold the refusal of a body of ``size`` bytes: one at a time per
        worker, ``size / REFUSED_BYTES_PER_SECOND`` each, its wait for its
        turn included, never past ``patience`` seconds."""
        try:
            async with asyncio.timeout(patience), self._refusals:
                await self._hold(size / REFUSED_BYTES_PER_SECOND)
        except TimeoutError:
            pass

    def _problem(self, size: Size) -> str | None:
        if size.members > self.max_members:
            return f"more than {self.max_members} JSON object members"
        if size.values > self.max_values:
            return f"more than {self.max_values} JSON values"
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

"""How much JSON the router reads on its event loop.

Parsing is native (orjson), but building a Python object per member is not
free: a 30 MiB body of three million small members takes seconds to parse,
and one worker's event loop would serve nobody meanwhile. So a body's object
members (at every depth) are bounded before it is parsed:

- a body up to ``INLINE_BYTES`` with at most ``MAX_MEMBERS`` colons (every
  member has one; strings may hold more) is parsed at once: a native count
  of one byte settles it;
- any other JSON body is counted exactly in a helper process (in Linux's
  idle scheduling class: it runs only on a core nothing else wants), off
  the event loop, and refused past ``MAX_MEMBERS``. Only a copy of its bytes
  crosses over, so a big body costs the loop a few copies, whatever it holds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import orjson

MAX_MEMBERS = 100_000
INLINE_BYTES = 1024 * 1024
_LEADING_WS = re.compile(rb"[ \t\r\n]*")


def upper_bound(body: bytes) -> int:
    return body.count(b":")


def count_members(body: bytes) -> int:
    """The object members of a JSON text at every depth (0 for text that is
    not JSON: the decision refuses it as such). Runs in the helper process."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0
    total = 0
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            total += len(node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return total


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

    def __init__(self, max_members: int = MAX_MEMBERS) -> None:
        self.max_members = max_members
        self._pool: ProcessPoolExecutor | None = None

    async def within(self, body: bytes) -> bool:
        """Whether the body has at most ``max_members`` object members."""
        start = _LEADING_WS.match(body).end()  # type: ignore[union-attr]
        if body[start:start + 1] not in (b"{", b"["):
            return True  # not JSON (a form, say): the JSON parser never sees it
        if len(body) <= INLINE_BYTES and upper_bound(body) <= self.max_members:
            return True
        if self._pool is None:
            # At the lowest CPU priority: a count yields the cores to the requests
            # being served (and so holds back whoever sends such bodies).
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=lowest_priority)
        members = await asyncio.get_running_loop().run_in_executor(self._pool, count_members, body)
        return members <= self.max_members

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

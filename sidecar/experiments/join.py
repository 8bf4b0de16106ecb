"""Which arm served a request: the join feedback is made on.

Written at the decision (:meth:`JoinStore.record`, in memory, no I/O on the
request path; with a ``redis`` section the shared copy is written by a task
beside the request, which the client never waits for), so feedback sent the
moment the answer arrives finds its request, long before Envoy flushes the
access log. Each entry also holds the feedback given so far, one value per
metric name, so a later value replaces the earlier one.

Bounded: entries live ``feedback.ttl_s``; the memory store keeps at most
``feedback.max_requests`` (least recently used out first); Redis expires them.
``model_router_feedback_join_entries`` and
``model_router_feedback_join_evictions_total{reason}`` show the size and the loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from ..metrics import REGISTRY
from ..stores import shared_store

if TYPE_CHECKING:
    from ..config.schema import Config

log = logging.getLogger("model_router.feedback")

JOIN_ENTRIES = Gauge(
    "model_router_feedback_join_entries", "Requests the memory join store can still take feedback on.",
    registry=REGISTRY,
)
JOIN_EVICTIONS = Counter(
    "model_router_feedback_join_evictions_total",
    "Requests dropped from the memory join store before their TTL (capacity) or at it (expired).",
    ["reason"], registry=REGISTRY,
)
_CAPACITY, _EXPIRED = JOIN_EVICTIONS.labels("capacity"), JOIN_EVICTIONS.labels("expired")  # looked up once


class Unavailable(Exception):
    """The shared store did not answer: the request may well be known, so this is not a 404."""


@dataclass(frozen=True, slots=True)
class Served:
    """Who made a request, and the arm that served it."""

    owner: str  # the key's id, or a digest of an unlisted key ("" without a key)
    experiment: str
    variant: str


@dataclass(frozen=True, slots=True)
class Given:
    """What storing a value did: the value it replaced (None: the first), and its revision (1, 2, ...)."""

    previous: float | None
    revision: int


@dataclass(slots=True)
class _Entry:
    served: Served
    expires: float
    feedback: dict[str, tuple[float, int]] = field(default_factory=dict)  # name -> (value, revision)


class MemoryJoin:
    """An LRU of requests with a TTL."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request_id: str, served: Served, ttl_s: float, limit: int, now: float) -> None:
        self._entries[request_id] = _Entry(served, now + ttl_s)
        self._entries.move_to_end(request_id)
        while len(self._entries) > limit:
            _, old = self._entries.popitem(last=False)
            (_EXPIRED if old.expires <= now else _CAPACITY).inc()

    def get(self, request_id: str, now: float) -> _Entry | None:
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        if entry.expires <= now:
            del self._entries[request_id]
            _EXPIRED.inc()
            return None
        self._entries.move_to_end(request_id)
        return entry

    def expire(self, now: float, budget: int = 64) -> None:
        """Drop up to ``budget`` expired entries from the old end (called per record: bounded work)."""
        for _ in range(budget):
            if not self._entries:
                return
            rid, oldest = next(iter(self._entries.items()))
            if oldest.expires > now:
                return
            del self._entries[rid]
            _EXPIRED.inc()


class JoinStore:
    """The memory store, or Redis when the config has a ``redis`` section. Never raises."""

    def __init__(self) -> None:
        self.memory = MemoryJoin()
        self._writes: dict[str, asyncio.Task[None]] = {}
        JOIN_ENTRIES.set_function(lambda: len(self.memory))

    def record(self, config: Config, request_id: str, served: Served) -> None:
        """At the decision: synchronous in memory; a Redis write is started beside it."""
        settings = config.feedback
        if config.redis is None:
            now = time.monotonic()
            self.memory.expire(now)
            self.memory.put(request_id, served, settings.ttl_s, settings.max_requests, now)
            return
        task = asyncio.get_running_loop().create_task(self._redis_record(config, request_id, served))
        self._writes[request_id] = task
        task.add_done_callback(lambda _t: self._writes.pop(request_id, None))

    async def _redis_record(self, config: Config, request_id: str, served: Served) -> None:
        assert config.redis is not None
        key = shared_store.key(config.redis, "feedback", request_id)
        try:
            pipe = shared_store.client(config.redis).pipeline(transaction=True)
            pipe.hset(key, mapping={"owner": served.owner, "experiment": served.experiment, "variant": served.variant})
            pipe.expire(key, config.feedback.ttl_s)
            await asyncio.wait_for(pipe.execute(), config.redis.timeout_ms / 1000 * 2)
        except Exception as exc:
            self._failed("record", exc)

    async def find(self, config: Config, request_id: str) -> Served | None:
        """The arm that served the request, or None (unknown or expired). Raises :class:`Unavailable`."""
        if config.redis is None:
            entry = self.memory.get(request_id, time.monotonic())
            return None if entry is None else entry.served
        pending = self._writes.get(request_id)
        if pending is not None:
            await asyncio.wait({pending})  # this process decided it a moment ago
        key = shared_store.key(config.redis, "feedback", request_id)
        try:
            raw = await asyncio.wait_for(shared_store.client(config.redis).hmget(key, "owner", "experiment", "variant"),
                                         config.redis.timeout_ms / 1000 * 2)
        except Exception as exc:
            self._failed("find", exc)
            raise Unavailable from None
        fields = [x.decode("utf-8", "replace") for x in raw if isinstance(x, bytes)]
        if len(fields) != 3:
            return None
        owner, experiment, variant = fields
        return Served(owner, experiment, variant)

    async def give(self, config: Config, request_id: str, name: str, value: float) -> Given | None:
        """Set the request's value for ``name``; None when the entry is gone. Raises :class:`Unavailable`."""
        if config.redis is None:
            entry = self.memory.get(request_id, time.monotonic())
            if entry is None:
                return None
            old = entry.feedback.get(name)
            revision = 1 if old is None else old[1] + 1
            entry.feedback[name] = (value, revision)
            return Given(None if old is None else old[0], revision)
        key = shared_store.key(config.redis, "feedback", request_id)
        try:
            pipe = shared_store.client(config.redis).pipeline(transaction=True)  # read and replace in one step
            pipe.hget(key, "fb:" + name)
            pipe.hset(key, "fb:" + name, repr(value))
            pipe.hincrby(key, "rev:" + name, 1)
            pipe.expire(key, config.feedback.ttl_s, nx=True)  # an entry that expired meanwhile does not linger
            previous, _, revision, _ = await asyncio.wait_for(pipe.execute(), config.redis.timeout_ms / 1000 * 2)
        except Exception as exc:
            self._failed("give", exc)
            raise Unavailable from None
        return Given(None if previous is None else float(previous), int(revision))

    @staticmethod
    def _failed(op: str, exc: BaseException) -> None:
        shared_store.REDIS_ERRORS.labels("feedback").inc()
        log.warning("feedback join %s failed: %s", op, type(exc).__name__)

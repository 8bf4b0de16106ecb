"""The response cache's stores: what an entry is, where it lives, and the
metrics of both. The key and the decision to cache are pure routing
(:mod:`sidecar.routing.cache_key`); everything here is I/O.

Two stores: an in-process LRU bounded by a byte budget and a TTL (the
default, one per sidecar process), and Redis (``cache.store: redis``, the
config's top-level ``redis`` section) so replicas share entries. A store
never fails a request: a Redis error or timeout reads as a miss, drops the
store, and is counted (``model_router_cache_errors_total`` and
``model_router_redis_errors_total{feature="cache"}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from ..metrics import REGISTRY
from . import shared_store

if TYPE_CHECKING:
    from ..config.schema import Config

log = logging.getLogger("model_router.cache")

_ARM = ["experiment", "variant"]  # both empty outside experiments
HITS = Counter("model_router_cache_hits_total", "Requests answered from the response cache.", _ARM, registry=REGISTRY)
MISSES = Counter(
    "model_router_cache_misses_total", "Cacheable requests the cache had no answer for (sent upstream).", _ARM,
    registry=REGISTRY,
)
STORES = Counter("model_router_cache_stores_total", "Answers written to the response cache.", _ARM, registry=REGISTRY)
ERRORS = Counter(
    "model_router_cache_errors_total",
    "Cache reads (op=get) or writes (op=put) that failed; the request went on uncached.",
    [*_ARM, "op"], registry=REGISTRY,
)
EVICTIONS = Counter(
    "model_router_cache_evictions_total",
    "Entries the in-memory store dropped: over its byte budget (size) or past their TTL (expired).",
    ["reason"], registry=REGISTRY,
)
MEMORY_BYTES = Gauge(
    "model_router_cache_memory_bytes", "Bytes the in-memory store holds (this process).", registry=REGISTRY,
)

# Response headers that make an answer unfit for anyone else.
_PRIVATE_DIRECTIVES = ("no-store", "private")
_ENTRY_OVERHEAD = 200  # bytes an entry costs besides its body and key


@dataclass(frozen=True, slots=True)
class Entry:
    """A stored answer: the backend's status, content type and body."""

    status: int
    content_type: str
    body: bytes

    def encode(self) -> bytes:
        return b"%d\n%s\n" % (self.status, self.content_type.encode("latin-1")) + self.body

    @classmethod
    def decode(cls, raw: bytes) -> Entry | None:
        status, _, rest = raw.partition(b"\n")
        ctype, sep, body = rest.partition(b"\n")
        if not sep or not status.isdigit():
            return None
        return cls(int(status), ctype.decode("latin-1"), body)


def storable(headers: Mapping[str, str]) -> bool:
    """Whether a response's headers let it be stored: a 2xx JSON answer that
    sets no cookie and does not forbid storing."""
    if not headers.get(":status", "").startswith("2") or "set-cookie" in headers:
        return False
    if "json" not in headers.get("content-type", "").lower():
        return False
    if headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return False
    directives = headers.get("cache-control", "").lower()
    return not any(d in directives for d in _PRIVATE_DIRECTIVES)


class MemoryStore:
    """An LRU of entries within a byte budget, each with its own expiry."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[float, Entry]] = OrderedDict()
        MEMORY_BYTES.set_function(lambda: self.bytes)

    @staticmethod
    def _size(key: str, entry: Entry) -> int:
        return len(key) + len(entry.body) + len(entry.content_type) + _ENTRY_OVERHEAD

    def get(self, key: str, now: float) -> Entry | None:
        found = self._items.get(key)
        if found is None:
            return None
        expires, entry = found
        if expires <= now:
            self._drop(key, "expired")
            return None
        self._items.move_to_end(key)
        return entry

    def put(self, key: str, entry: Entry, ttl_s: float, now: float) -> None:
        size = self._size(key, entry)
        if size > self.max_bytes:
            return
        if key in self._items:
            self._drop(key, None)
        self._items[key] = (now + ttl_s, entry)
        self.bytes += size
        self.trim()

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.trim()

    def trim(self) -> None:
        while self.bytes > self.max_bytes and self._items:
            self._drop(next(iter(self._items)), "size")

    def _drop(self, key: str, reason: str | None) -> None:
        _, entry = self._items.pop(key)
        self.bytes -= self._size(key, entry)
        if reason is not None:
            EVICTIONS.labels(reason).inc()

    def __len__(self) -> int:
        return len(self._items)


class ResponseCache:
    """The store the config names. ``get`` and ``put`` never raise."""

    def __init__(self) -> None:
        self.memory: MemoryStore | None = None

    def _memory(self, config: Config) -> MemoryStore:
        budget = config.cache.max_bytes if config.cache is not None else 0
        if self.memory is None:
            self.memory = MemoryStore(budget)
        elif self.memory.max_bytes != budget:
            self.memory.resize(budget)  # a reload changed the budget
        return self.memory

    async def get(self, config: Config, key: str, experiment: str, variant: str) -> Entry | None:
        found: Entry | None
        if config.cache is not None and config.cache.store == "redis" and config.redis is not None:
            settings = config.redis
            try:
                # Never past half of Envoy's wait for this answer: a slow Redis is a miss, not a 504.
                wait = min(settings.timeout_ms * 2, config.server.message_timeout_ms / 2) / 1000
                raw = await asyncio.wait_for(
                    shared_store.client(settings).get(shared_store.key(settings, "cache", key)), wait,
                )
            except Exception as exc:  # any failure of the store reads as a miss
                self._failed("get", experiment, variant, exc)
                return None
            found = Entry.decode(raw) if isinstance(raw, bytes) else None
        else:
            found = self._memory(config).get(key, time.monotonic())
        (HITS if found is not None else MISSES).labels(experiment, variant).inc()
        return found

    async def put(self, config: Config, key: str, entry: Entry, ttl_s: int, experiment: str, variant: str) -> None:
        if config.cache is not None and config.cache.store == "redis" and config.redis is not None:
            settings = config.redis
            try:
                await asyncio.wait_for(
                    shared_store.client(settings).set(shared_store.key(settings, "cache", key), entry.encode(), ex=ttl_s),
                    settings.timeout_ms / 1000 * 2,
                )
            except Exception as exc:
                self._failed("put", experiment, variant, exc)
                return
        else:
            self._memory(config).put(key, entry, ttl_s, time.monotonic())
        STORES.labels(experiment, variant).inc()

    @staticmethod
    def _failed(op: str, experiment: str, variant: str, exc: BaseException) -> None:
        ERRORS.labels(experiment, variant, op).inc()
        shared_store.REDIS_ERRORS.labels("cache").inc()
        log.warning("cache %s failed, served uncached: %s", op, type(exc).__name__)


def prime(config: Config) -> None:
    """Create the cache's label sets at zero for every arm the config declares."""
    if config.cache is None:
        return
    arms = [("", "")] + [(e.name, v.id) for e in config.model_experiments for v in e.variants]
    for experiment, variant in arms:
        for family in (HITS, MISSES, STORES):
            family.labels(experiment, variant)
        for op in ("get", "put"):
            ERRORS.labels(experiment, variant, op)
    for reason in ("size", "expired"):
        EVICTIONS.labels(reason)
    if config.cache.store == "redis":
        shared_store.REDIS_ERRORS.labels("cache")

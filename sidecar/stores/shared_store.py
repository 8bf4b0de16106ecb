"""The Redis connection that features shared by replicas use (cache, limits,
response affinity).

One client per process, built from the config's ``redis`` section. Every call
has a short timeout: a feature that reaches Redis treats an error or a timeout
as "no shared state" (serve uncached, enforce locally, fall back) and counts it
in ``model_router_redis_errors_total{feature}``; it never fails the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter

from ..metrics import REGISTRY

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..config.schema import RedisSettings

REDIS_ERRORS = Counter(
    "model_router_redis_errors_total",
    "Redis calls that failed or timed out; the feature carried on without shared state.",
    ["feature"],
    registry=REGISTRY,
)

_clients: dict[tuple[str, int], Redis] = {}


def client(settings: RedisSettings) -> Redis:
    """The process's client for ``settings.url`` (a pool, created on first use).

    Must be called from the event loop that will use it.
    """
    from redis.asyncio import Redis

    key = (settings.url, settings.timeout_ms)
    found = _clients.get(key)
    if found is None:
        timeout = settings.timeout_ms / 1000
        found = Redis.from_url(
            settings.url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
            health_check_interval=0,
            max_connections=settings.max_connections,
        )
        _clients[key] = found
    return found


def key(settings: RedisSettings, *parts: str) -> str:
    """A namespaced key: ``<prefix><part>:<part>...``."""
    return settings.key_prefix + ":".join(parts)


async def close_all() -> None:
    for c in list(_clients.values()):
        await c.aclose()
    _clients.clear()

"""The shared Redis connection against a real ``redis-server``."""

from __future__ import annotations

import asyncio

from sidecar.config.schema import RedisSettings
from sidecar.stores import shared_store


def test_client_round_trip_and_timeout(redis_server):
    async def go() -> tuple[bytes | None, bool]:
        settings = RedisSettings(url=redis_server.url)
        c = shared_store.client(settings)
        assert shared_store.client(settings) is c  # one pool per process
        await c.set(shared_store.key(settings, "t", "1"), b"v", ex=5)
        got = await c.get("model-router:t:1")
        dead = RedisSettings(url="redis://127.0.0.1:1/0", timeout_ms=20)
        try:
            await shared_store.client(dead).get("x")
            failed = False
        except Exception:
            failed = True
        await shared_store.close_all()
        return got, failed

    got, failed = asyncio.run(go())
    assert got == b"v"
    assert failed

"""The shared Redis connection against a real ``redis-server``."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.config.schema import ConfigError, RedisSettings, parse
from sidecar.stores import shared_store


def test_redis_url_is_checked():
    base = "backends: [{name: a, url: 'http://127.0.0.1:1'}]\nredis: {url: %s}\n"
    assert parse(base % "redis://127.0.0.1:6379/0").config.redis.url.startswith("redis://")
    with pytest.raises(ConfigError, match=r"redis\.url"):
        parse(base % "http://127.0.0.1:6379")


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

"""The shared Redis settings (tests/integration/test_shared_store.py runs the connection against a real
``redis-server``)."""

from __future__ import annotations

import pytest

from sidecar.config.schema import ConfigError, parse


def test_redis_url_is_checked():
    base = "backends: [{name: a, url: 'http://127.0.0.1:1'}]\nredis: {url: %s}\n"
    assert parse(base % "redis://127.0.0.1:6379/0").config.redis.url.startswith("redis://")
    with pytest.raises(ConfigError, match=r"redis\.url"):
        parse(base % "http://127.0.0.1:6379")

"""Token-budget counters against a real redis-server: replicas agree through
it, and a Redis outage leaves the local counts in charge."""

from __future__ import annotations

import asyncio

from sidecar import shared_store, snapshot
from sidecar.budgets import Budgets
from sidecar.config import parse

CONFIG = """
redis: {url: "%s", key_prefix: "budgets-test:", timeout_ms: 200}
backends: [{name: a, url: "http://127.0.0.1:1", models: [m]}]
limits: [{model: m, tokens: 100, token_window: 60s}]
"""
RULE = "*/m"
NOW = 6000.0  # window 100


def errors() -> float:
    return shared_store.REDIS_ERRORS.labels("budgets")._value.get()


def test_two_replicas_agree_and_an_outage_keeps_local_counts(redis_server):
    snap = snapshot.build(parse(CONFIG % redis_server.url).config)

    async def go() -> None:
        one, two = Budgets(lambda: snap), Budgets(lambda: snap)
        one.charge([RULE], 30, NOW)
        two.charge([RULE], 12, NOW + 1)
        assert one.spent[RULE] == (100, 30) and two.spent[RULE] == (100, 12)  # before any sync: their own
        await one.sync(NOW + 2)
        await two.sync(NOW + 2)
        await one.sync(NOW + 2)
        assert one.spent[RULE] == two.spent[RULE] == (100, 42)
        # The next window reads as empty.
        await one.sync(NOW + 60)
        assert one.spent[RULE] == (101, 0)

        redis_server.kill()
        before = errors()
        two.charge([RULE], 5, NOW + 3)
        await two.sync(NOW + 4)
        assert errors() > before
        assert two.spent[RULE] == (100, 47)  # enforced locally meanwhile
        redis_server.start()
        await shared_store.close_all()
        await two.sync(NOW + 5)  # the queued charge reaches Redis, which restarted empty
        # Redis holds the one count (settlements make counts fall too): what it lost is lost.
        assert two.spent[RULE] == (100, 5)
        three = Budgets(lambda: snap)
        await three.sync(NOW + 5)
        assert three.spent[RULE] == (100, 5)
        await shared_store.close_all()

    asyncio.run(go())

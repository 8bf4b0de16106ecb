"""Token-budget counters against a real redis-server: replicas agree through
it, and a Redis outage leaves the local counts in charge."""

from __future__ import annotations

import asyncio
import itertools

from sidecar.accounting.budgets import Budgets
from sidecar.accounting.metering import Billed, Entry, billed
from sidecar.config.schema import parse
from sidecar.routing import limits as lim
from sidecar.routing import snapshot
from sidecar.stores import shared_store

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


LOCAL = """
backends: [{name: a, url: "http://127.0.0.1:1", models: [m]}]
limits: [{model: m, tokens: 100, token_window: 60s}]
"""


def entry(decision: dict, status: int = 200, prompt=None, completion=None, **flags) -> Entry:
    return Entry(decision=decision, status=status, start=NOW, headers_s=0.01, total_s=0.02,
                 prompt_tokens=prompt, completion_tokens=completion, upstream_failed=False,
                 client_gone=flags.pop("client_gone", False), **flags)


def test_a_reservation_holds_until_its_entry_settles_it_to_the_usage_or_the_estimate():
    snap = snapshot.build(parse(LOCAL).config)
    budgets = Budgets(lambda: snap)
    rules = lim.applicable(snap, "m", None)
    admitted = lim.plan(rules, "m", None, budgets.spent, NOW, cost=60)
    assert isinstance(admitted, lim.LimitPlan)
    budgets.reserve(admitted)
    assert budgets.spent[RULE] == (100, 60)
    # A concurrent request sees the reservation; one more is still admitted, the next is not.
    second = lim.plan(rules, "m", None, budgets.spent, NOW, cost=60)
    assert isinstance(second, lim.LimitPlan)
    budgets.reserve(second)
    assert isinstance(lim.plan(rules, "m", None, budgets.spent, NOW, cost=60), lim.BudgetState)
    meta = {"kind": "routed", "limit_model": "m", "estimate": "10,50", **admitted.metadata()}
    budgets.observe(entry(meta, prompt=3, completion=4))  # reported usage replaces the reservation
    assert budgets.spent[RULE] == (100, 67)
    meta2 = {"kind": "routed", "limit_model": "m", "estimate": "10,50", **second.metadata()}
    budgets.observe(entry(meta2, client_gone=True))  # cut before its usage: the estimate
    assert budgets.spent[RULE] == (100, 67)
    third = lim.plan(rules, "m", None, budgets.spent, NOW, cost=60)
    assert isinstance(third, lim.LimitPlan)
    budgets.reserve(third)
    budgets.observe(entry({"kind": "routed", "limit_model": "m", "estimate": "10,50", **third.metadata()}, status=503))
    assert budgets.spent[RULE] == (100, 67)  # an upstream error without usage: released
    # An absurd cap cut short is charged at most what it reserved (here the whole budget).
    greedy = lim.plan(rules, "m", None, budgets.spent, NOW, cost=10**9)
    assert isinstance(greedy, lim.LimitPlan) and greedy.reserve == 100
    budgets.reserve(greedy)
    budgets.observe(entry({"kind": "routed", "limit_model": "m", "estimate": f"3,{10**9}", **greedy.metadata()},
                          client_gone=True))
    assert budgets.spent[RULE] == (100, 167)


def test_billed_estimates_only_requests_that_ran_without_usage():
    d = {"kind": "routed", "estimate": "10,50"}
    assert billed(entry(d, prompt=1, completion=2)) == Billed(1, 2, False)
    assert billed(entry(d, client_gone=True)) == Billed(10, 50, True)
    assert billed(entry(d, status=0, client_gone=True)) == Billed(10, 50, True)
    assert billed(entry(d, cut=True)) == Billed(10, 50, True)
    assert billed(entry(d, cut=True, streamed=7)) == Billed(10, 7, True)
    assert billed(entry(d, cut=True, streamed=70)) == Billed(10, 50, True)
    assert billed(entry({**d, "background": True})) == Billed(10, 50, True)
    assert billed(entry(d)) == Billed(None, None, False)  # an engine that reports no usage
    assert billed(entry(d, status=502, client_gone=True)) == Billed(None, None, False)
    assert billed(entry({**d, "kind": "follow_up"}, prompt=1, completion=2)) == Billed(None, None, False)
    assert billed(entry({**d, "estimate": "a,b"}, client_gone=True)) == Billed(None, None, False)


def test_a_reservation_in_redis_is_checked_and_made_in_one_step(redis_server):
    snap = snapshot.build(parse(CONFIG.replace("budgets-test:", "reserve-test:") % redis_server.url).config)

    async def go() -> None:
        one, two = Budgets(lambda: snap), Budgets(lambda: snap)
        rules = lim.applicable(snap, "m", None)
        first = lim.plan(rules, "m", None, one.spent, NOW, cost=70)
        assert isinstance(first, lim.LimitPlan)
        one.reserve(first)
        assert await one.reserve_shared(first) is None
        # The other replica has not synced: its own check admits, Redis refuses.
        late = lim.plan(rules, "m", None, two.spent, NOW, cost=70)
        assert isinstance(late, lim.LimitPlan)
        two.reserve(late)
        assert await two.reserve_shared(late) is None  # 70 < 100: still admitted (one reservation over)
        last = lim.plan(rules, "m", None, two.spent, NOW, cost=70)
        assert isinstance(last, lim.LimitPlan)
        two.reserve(last)
        spent = await two.reserve_shared(last)
        assert spent is not None and spent.spent == 140 and spent.remaining == 0
        assert two.spent[RULE] == (100, 140)  # its own refused reservation undone, Redis's count kept
        await shared_store.close_all()

    asyncio.run(go())


def test_a_request_decided_before_or_after_another_settles_sees_its_reservation_then_the_same_count():
    """A finished request holds its reservation until its access-log entry
    settles it; a request decided in between sees the reservation, one decided
    after sees the usage. Either way the count that follows is the same."""
    snap = snapshot.build(parse(LOCAL).config)
    rules = lim.applicable(snap, "m", None)

    def admit(budgets: Budgets, cost: int) -> tuple[int, dict]:
        plan = lim.plan(rules, "m", None, budgets.spent, NOW, cost=cost)
        assert isinstance(plan, lim.LimitPlan)
        budgets.reserve(plan)
        remaining = int(plan.metadata()["x_ratelimit_remaining_tokens"])
        return remaining, {"kind": "routed", "limit_model": "m", "estimate": f"{cost - 5},5", **plan.metadata()}

    seen: dict[str, tuple[int, int]] = {}
    for order in ("settled first", "decided first"):
        budgets = Budgets(lambda: snap)
        _, earlier = admit(budgets, 25)  # reserves 25, uses 6
        if order == "settled first":
            budgets.observe(entry(earlier, prompt=2, completion=4))
            remaining, later = admit(budgets, 25)
        else:
            remaining, later = admit(budgets, 25)
            budgets.observe(entry(earlier, prompt=2, completion=4))
        budgets.observe(entry(later, prompt=2, completion=4))
        seen[order] = (remaining, budgets.spent[RULE][1])
    assert seen["settled first"] == (100 - 6, 12)
    assert seen["decided first"] == (100 - 25, 12)  # the earlier request's reservation, not yet its usage


def test_settlements_give_the_same_count_in_every_order_of_events():
    """Reservations and settlements of several requests, every interleaving in
    which a request is admitted before its entry arrives: the count ends at the
    sum of what they used, whatever came first."""
    snap = snapshot.build(parse(LOCAL).config)
    rules = lim.applicable(snap, "m", None)
    used = {"a": (3, 4), "b": (None, None), "c": (9, 0)}  # b: an upstream error without usage (released)
    costs = {"a": 30, "b": 20, "c": 25}
    events = [(name, step) for name in used for step in ("reserve", "settle")]
    orders = [o for o in itertools.permutations(events)
              if all(o.index((n, "reserve")) < o.index((n, "settle")) for n in used)]
    assert len(orders) == 90  # 6! / 2**3
    for order in orders:
        budgets = Budgets(lambda: snap)
        meta: dict[str, dict] = {}
        expected = 0  # what the running requests hold plus what the settled ones used
        for name, step in order:
            prompt, completion = used[name]
            if step == "reserve":
                plan = lim.plan(rules, "m", None, budgets.spent, NOW, cost=costs[name])
                assert isinstance(plan, lim.LimitPlan)
                budgets.reserve(plan)
                meta[name] = {"kind": "routed", "limit_model": "m", "estimate": f"{costs[name]},0", **plan.metadata()}
                expected += costs[name]
            else:
                budgets.observe(entry(meta[name], status=200 if prompt is not None else 503,
                                      prompt=prompt, completion=completion))
                expected += (prompt or 0) + (completion or 0) - costs[name]
            assert budgets.spent[RULE] == (100, expected), order
        assert expected == 16

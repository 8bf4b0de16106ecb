"""Token budgets' counters, filled from the access log and read by the
decision.

Each request a budget covers is charged its prompt + completion tokens when
its access-log entry arrives (:mod:`sidecar.metering`), in the window it
started in. The decision reads :attr:`Budgets.spent`, a plain mapping, so
the request path does no I/O. With a ``redis:`` section the charges go to
Redis (``INCRBY`` on one key per rule and window, expiring after the
window) and every replica reads the totals back on each sync, so they
enforce one budget; between syncs a replica adds its own charges locally. A
Redis error leaves the local counts in charge and the charges queued for
the next sync.

A budget is checked before a request runs, and charged once it has run:
requests already admitted when the budget runs out may take it past its
limit by what they use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from . import metrics, shared_store
from .limit_rules import Rule
from .routing.limits import BUDGET_SEPARATOR, window_of
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .metering import Entry

log = logging.getLogger("model_router.budgets")

SYNC_INTERVAL_S = 0.25  # how stale another replica's charges may be, at most about this plus a flush


class Budgets:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot
        self.spent: dict[str, tuple[int, int]] = {}  # rule id -> (window, tokens)
        self._pending: dict[tuple[str, int], int] = {}  # (rule id, window) -> tokens not yet in Redis
        self._task: asyncio.Task | None = None

    def _rules(self) -> dict[str, Rule]:
        return {r.id: r for rs in self.snapshot().limits.values() for r in rs if r.tokens is not None}

    def observe(self, e: Entry) -> None:
        """An access-log entry (a metering observer): a refusal by a limit is
        counted; a budgeted request's tokens are charged."""
        d = e.decision
        model = d.get("limit_model")
        if not model:
            return
        if e.status == 429 and (e.rate_limited or d.get("limit_refused")):
            kind = "requests" if e.rate_limited else str(d["limit_refused"])
            metrics.LIMIT_REFUSALS.labels(model, d.get("key_id") or "", kind).inc()
            return
        budgets = d.get("budgets")
        if budgets and d.get("kind") in ("routed", "answered"):
            tokens = (e.prompt_tokens or 0) + (e.completion_tokens or 0)
            self.charge(str(budgets).split(BUDGET_SEPARATOR), tokens, e.start)

    def charge(self, rule_ids: Iterable[str], tokens: int, start: float) -> None:
        """A request's tokens, against each budget it was admitted under."""
        if tokens <= 0:
            return
        rules = self._rules()
        shared = self.snapshot().config.redis is not None
        for rid in rule_ids:
            rule = rules.get(rid)
            if rule is None:
                continue  # the rule left the config since the decision
            window = window_of(rule, start)
            seen = self.spent.get(rid)
            if seen is None or seen[0] < window:
                self.spent[rid] = (window, tokens)
            elif seen[0] == window:
                self.spent[rid] = (window, seen[1] + tokens)
            if shared:
                self._pending[rid, window] = self._pending.get((rid, window), 0) + tokens

    async def sync(self, now: float) -> None:
        """Send the queued charges to Redis and read every budget's total back."""
        snap = self.snapshot()
        settings = snap.config.redis
        if settings is None:
            self._pending.clear()
            return
        rules = self._rules()
        if not rules and not self._pending:
            return
        pending = {k: v for k, v in self._pending.items() if k[0] in rules}
        self._pending = {}
        current = [(r, window_of(r, now)) for r in rules.values()]
        try:
            pipe = shared_store.client(settings).pipeline(transaction=False)
            for (rid, window), tokens in pending.items():
                k = shared_store.key(settings, "budget", rid, str(window))
                pipe.incrby(k, tokens)
                pipe.expire(k, 2 * rules[rid].window_s + 60)
            for r, window in current:
                pipe.get(shared_store.key(settings, "budget", r.id, str(window)))
            results = await pipe.execute()
        except Exception as exc:  # any failure: enforce locally, retry the charges next time
            shared_store.REDIS_ERRORS.labels("budgets").inc()
            log.debug("budgets: redis sync failed: %s", exc)
            for k, v in pending.items():
                self._pending[k] = self._pending.get(k, 0) + v
            return
        totals = results[2 * len(pending):]
        for (r, window), total in zip(current, totals):
            # Charges made since this sync began are in _pending and not yet in Redis.
            shared = int(total or 0) + self._pending.get((r.id, window), 0)
            seen = self.spent.get(r.id)
            if seen is not None and seen[0] == window:
                shared = max(shared, seen[1])  # within a window a count only grows (Redis may have lost it)
            self.spent[r.id] = (window, shared)

    async def run(self, clock: Callable[[], float]) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            try:
                await self.sync(clock())
            except Exception:
                log.exception("budgets: sync")

    def start(self, clock: Callable[[], float]) -> None:
        self._task = asyncio.create_task(self.run(clock))

    async def stop(self, now: float) -> None:
        """Stop syncing; the charges still queued go to Redis first."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            await self.sync(now)

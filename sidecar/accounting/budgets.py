"""Token budgets' counters: reserved by the decision, settled from the
access log.

A request a budget covers reserves its estimate (``routing.limits.estimate``)
on every budget it falls under as it is admitted, in the same step as the
check that admits it; its access-log entry (:mod:`sidecar.accounting.metering`) later
replaces the reservation with what it used, or with the estimate when its
usage never arrived (``metering.billed``). A budget therefore holds, at any
time, what finished requests used plus what running requests may use, and
concurrent requests cannot take it past its limit by more than one
reservation.

The decision reads :attr:`Budgets.spent`, a plain mapping, so the request
path's decision does no I/O. With a ``redis:`` section the reservation is
also made in Redis, atomically with the check (:data:`_RESERVE`), so every
replica enforces one budget; settlements go to Redis at each sync
(``INCRBY``, positive or negative), and every replica reads the totals back.
A Redis error leaves the local counts in charge and the amounts queued for
the next sync.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import metrics
from ..config.limits import Rule
from ..routing.limits import BudgetState, LimitPlan, window_of
from ..routing.snapshot import Snapshot
from ..stores import shared_store
from .entries import Reads
from .metering import Entry, billed

if TYPE_CHECKING:
    from ..config.schema import RedisSettings

# The decision's keys ``observe`` reads (``billed`` reads kind, background, estimate).
_READS = Reads(("kind", "limit_model", "limit_refused", "key_id", "budgets", "reserved", "background", "estimate",
                "response_id"))

log = logging.getLogger("model_router.budgets")

SYNC_INTERVAL_S = 0.25  # how stale another replica's charges may be, at most about this plus a flush

# KEYS: one budget counter per rule (this window); ARGV: the amount, then each
# rule's limit, then each key's time to live. Refuses (the 1-based index of
# the spent budget, and its count) or adds the amount to every counter.
_RESERVE = """
local n = #KEYS
for i = 1, n do
  local v = tonumber(redis.call('GET', KEYS[i]) or '0')
  if v >= tonumber(ARGV[i + 1]) then return {i, v} end
end
for i = 1, n do
  redis.call('INCRBY', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[n + i + 1])
end
return {0, 0}
"""


MAX_OPEN = 100_000  # background creates awaiting their retrieve, per process (oldest dropped)
BACKGROUND_TTL_S = 2 * 86400  # how long Redis keeps a background create for its retrieve


@dataclass(frozen=True, slots=True)
class Open:
    """A background create charged its estimate, until a retrieve reports its usage."""

    rule_ids: tuple[str, ...]
    charged: int
    at: float  # the time whose windows hold the charge

    def dumps(self) -> str:
        return json.dumps([list(self.rule_ids), self.charged, self.at])

    @staticmethod
    def loads(raw: bytes | str) -> Open | None:
        try:
            ids, charged, at = json.loads(raw)
            return Open(tuple(str(i) for i in ids), int(charged), float(at))
        except (ValueError, TypeError):
            return None


class Budgets:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot
        self.spent: dict[str, tuple[int, int]] = {}  # rule id -> (window, tokens)
        self._pending: dict[tuple[str, int], int] = {}  # (rule id, window) -> tokens not yet in Redis
        self._task: asyncio.Task[None] | None = None
        self._open: dict[str, Open] = {}  # background creates charged their estimate, by engine response id
        self._opened: list[tuple[str, Open]] = []  # not yet in Redis
        self._claimed: list[tuple[str, int]] = []  # retrieves that reported usage: (engine id, tokens), not yet claimed

    def _rules(self) -> dict[str, Rule]:
        return {r.id: r for rs in self.snapshot().limits.values() for r in rs if r.tokens is not None}

    def reads(self) -> Reads:
        return _READS

    def observe(self, e: Entry) -> None:
        """An access-log entry (a metering observer): a refusal by a limit is
        counted; a budgeted request's reservation is settled to what it used."""
        d = e.decision
        if d.kind == "follow_up":
            self._retrieved(e)
            return
        model = d.limit_model
        if not model:
            return
        if e.status == 429 and (e.rate_limited or d.limit_refused):
            kind = "requests" if e.rate_limited else str(d.limit_refused)
            metrics.LIMIT_REFUSALS.labels(model, d.key_id or "", kind).inc()
            if not e.rate_limited:
                return  # the sidecar refused it: nothing was reserved
        budgets = d.budgets
        if not budgets:
            return
        reserved = d.reserved
        held = reserved or (0, e.start)
        tokens = billed(e) if d.kind in ("routed", "answered") else None
        used = tokens.total if tokens is not None else 0
        if tokens is not None and tokens.estimated and reserved is not None:
            used = min(used, reserved[0])  # an estimate never charges more than was reserved
        rule_ids = list(budgets)
        self.charge(rule_ids, used - held[0], held[1])
        if tokens is not None and tokens.estimated and d.background is True and e.response_id:
            self._background(e.response_id, rule_ids, used, held[1])

    def _background(self, response_id: str, rule_ids: list[str], charged: int, at: float) -> None:
        """A background create charged its estimate: its first retrieve that
        reports usage settles it (once per response id)."""
        open_ = Open(tuple(rule_ids), charged, at)
        if self.snapshot().config.redis is not None:
            self._opened.append((response_id, open_))  # Redis holds it, so any replica can settle it
            return
        self._open[response_id] = open_
        while len(self._open) > MAX_OPEN:
            del self._open[next(iter(self._open))]

    def _retrieved(self, e: Entry) -> None:
        """A follow-up: when it returned a response's usage, the create's
        estimate is settled to it, once (the first such retrieve claims it)."""
        rid = e.decision.response_id
        if rid is None or e.prompt_tokens is None and e.completion_tokens is None:
            return
        used = (e.prompt_tokens or 0) + (e.completion_tokens or 0)
        if self.snapshot().config.redis is not None:
            self._claimed.append((rid, used))  # the first claim in Redis (GETDEL) settles it
            return
        found = self._open.pop(rid, None)
        if found is not None:
            self.charge(found.rule_ids, used - found.charged, found.at)

    def reserve(self, limits: LimitPlan) -> None:
        """Hold a request's reservation on its budgets, locally (the decision
        that admitted it ran in this same step)."""
        self.charge(limits.budgets, limits.reserve, limits.now, shared=False)

    async def reserve_shared(self, limits: LimitPlan) -> BudgetState | None:
        """The reservation in Redis, checked and made in one step: None when
        made (or Redis failed: then it is queued like a charge), else the
        budget another replica has spent (the local reservation is undone)."""
        settings = self.snapshot().config.redis
        rules = self._rules()
        held = [rules[rid] for rid in limits.budgets if rid in rules]
        if settings is None or not held or limits.reserve <= 0:
            return None
        keys = [shared_store.key(settings, "budget", r.id, str(window_of(r, limits.now))) for r in held]
        args = [limits.reserve, *(r.tokens or 0 for r in held), *(2 * r.window_s + 60 for r in held)]
        try:
            spent_at, total = await shared_store.client(settings).eval(_RESERVE, len(keys), *keys, *args)
        except Exception as exc:  # enforce locally; the reservation reaches Redis with the next sync
            shared_store.REDIS_ERRORS.labels("budgets").inc()
            log.debug("budgets: redis reservation failed: %s", exc)
            self._queue(limits.budgets, limits.reserve, limits.now)
            return None
        if not spent_at:
            return None
        self.charge(limits.budgets, -limits.reserve, limits.now, shared=False)
        rule = held[int(spent_at) - 1]
        window = window_of(rule, limits.now)
        self.spent[rule.id] = (window, max(int(total), self.spent.get(rule.id, (window, 0))[1]))
        return BudgetState(rule, int(total), (window + 1) * rule.window_s)

    def _queue(self, rule_ids: Iterable[str], tokens: int, at: float) -> None:
        rules = self._rules()
        for rid in rule_ids:
            if rid in rules:
                key = (rid, window_of(rules[rid], at))
                self._pending[key] = self._pending.get(key, 0) + tokens

    def charge(self, rule_ids: Iterable[str], tokens: int, start: float, shared: bool = True) -> None:
        """Tokens (a reservation, or a settlement's difference, which may be
        negative) against each budget, in the window of ``start``; with
        ``shared``, also queued for Redis."""
        if tokens == 0:
            return
        rules = self._rules()
        redis = self.snapshot().config.redis is not None
        for rid in rule_ids:
            rule = rules.get(rid)
            if rule is None:
                continue  # the rule left the config since the decision
            window = window_of(rule, start)
            seen = self.spent.get(rid)
            if seen is None or seen[0] < window:
                self.spent[rid] = (window, max(0, tokens))
            elif seen[0] == window:
                self.spent[rid] = (window, max(0, seen[1] + tokens))
            if shared and redis:
                self._pending[rid, window] = self._pending.get((rid, window), 0) + tokens

    async def sync(self, now: float) -> None:
        """Send the queued charges to Redis and read every budget's total back."""
        snap = self.snapshot()
        settings = snap.config.redis
        if settings is None:
            self._pending.clear()
            return
        await self._settle_background(settings)
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
            for held, v in pending.items():
                self._pending[held] = self._pending.get(held, 0) + v
            return
        totals = results[2 * len(pending):]
        for (r, window), total in zip(current, totals):
            # Charges made since this sync began are in _pending and not yet in Redis.
            # (A count may fall: settlements give back what reservations held.)
            self.spent[r.id] = (window, max(0, int(total or 0) + self._pending.get((r.id, window), 0)))

    async def _settle_background(self, settings: RedisSettings) -> None:
        """Background creates into Redis, then the retrieves' claims on them
        (in that order, in one pipeline): a claim that finds its create
        settles it here, and no other replica can find it again."""
        opened, claimed = self._opened, self._claimed
        if not opened and not claimed:
            return
        self._opened, self._claimed = [], []
        try:
            pipe = shared_store.client(settings).pipeline(transaction=False)
            for rid, open_ in opened:
                pipe.set(shared_store.key(settings, "background", rid), open_.dumps(), ex=BACKGROUND_TTL_S)
            for rid, _ in claimed:
                pipe.getdel(shared_store.key(settings, "background", rid))
            results = await pipe.execute()
        except Exception as exc:  # retried at the next sync
            shared_store.REDIS_ERRORS.labels("budgets").inc()
            log.debug("budgets: redis background settlement failed: %s", exc)
            # Kept for the next sync, the newest of them while Redis stays away.
            self._opened = (opened + self._opened)[-MAX_OPEN:]
            self._claimed = (claimed + self._claimed)[-MAX_OPEN:]
            return
        for (_, used), raw in zip(claimed, results[len(opened):]):
            found = Open.loads(raw) if raw is not None else None
            if found is not None:
                self.charge(found.rule_ids, used - found.charged, found.at)

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

"""Backend selection: filters, then rankers, then one picker.

One selection answers one attempt: the backends that serve a model and that
the request may use, narrowed by filters (health, saturation, passive
hold-out), ordered by at most one ranker (the ``x-backend`` preference, or a
suffix's throughput or cost), and settled by the configured picker. The same
admission rule (:func:`admissible`) also answers ``/admin/backends``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..snapshot import BackendInfo, Snapshot


class BackendView(Protocol):
    """What the monitor knows about a backend (``monitor.BackendState``)."""

    healthy: bool
    held_out_until: float
    throughput_tps: float | None
    waiting: float | None
    scraped_at: float | None


@dataclass(frozen=True, slots=True)
class Load:
    """What the monitor currently knows about a backend, already freshness-checked."""

    throughput: float | None = None
    waiting: float | None = None


def fresh_load(state: BackendView | None, now: float, freshness_s: float) -> Load:
    if state is None or state.scraped_at is None or now - state.scraped_at > freshness_s:
        return Load()
    return Load(state.throughput_tps, state.waiting)


def admissible(
    state: BackendView | None, now: float, max_waiting: int | None, freshness_s: float | None = None,
    holdout: bool = True,
) -> bool:
    """The one admission rule: healthy, not held out after a failure (unless
    ``holdout`` is False), and not saturated. Saturated means more than
    ``max_waiting`` queued requests by a scrape at most ``freshness_s`` old (any
    age when None); an unknown queue never blocks, and neither does a backend
    the monitor does not know."""
    if state is None:
        return True
    if not state.healthy or (holdout and state.held_out_until > now):
        return False
    if max_waiting is None or state.waiting is None or state.scraped_at is None:
        return True
    if freshness_s is not None and now - state.scraped_at > freshness_s:
        return True
    return state.waiting <= max_waiting


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one selection is asked."""

    model: str  # the id to dispatch
    candidates: Sequence[BackendInfo]  # serving it, inside the request's allow-list
    ranker: str | None = None  # "throughput" | "cost" (a suffix's), None on fallback hops
    preferred: str | None = None  # x-backend: the first attempt only
    body: Mapping[str, object] | None = None  # for the cost estimate


@dataclass(frozen=True, slots=True)
class Selection:
    backend: BackendInfo
    ranked: bool  # the attempt's ranker decided (False: nothing to rank by, or x-backend won)


@dataclass(frozen=True, slots=True)
class Context:
    snap: Snapshot
    states: Mapping[str, BackendView]
    now: float  # the monitor's clock
    pick: int  # round-robin counter
    rand: float  # uniform in [0, 1)


def select(ctx: Context, attempt: Attempt) -> Selection | None:
    """The pipeline; None when no backend is admitted."""
    candidates = _admitted(ctx, list(attempt.candidates))
    if not candidates:
        return None
    preferred = next((b for b in candidates if b.name == attempt.preferred), None) if attempt.preferred else None
    if preferred is not None:
        return Selection(preferred, ranked=False)
    ranked = False
    if attempt.ranker is not None:
        candidates, ranked = RANKERS[attempt.ranker](ctx, attempt, candidates)
    return Selection(_pick(ctx, candidates), ranked)


def _admitted(ctx: Context, candidates: list[BackendInfo]) -> list[BackendInfo]:
    """Health and saturation; the passive hold-out too, unless it would hold
    out every candidate: one bad answer from a lone backend does not refuse
    all of its traffic."""
    mon = ctx.snap.config.monitor
    for holdout in (True, False):
        admitted = [
            b for b in candidates
            if admissible(ctx.states.get(b.name), ctx.now, mon.max_waiting, mon.freshness_s, holdout)
        ]
        if admitted:
            break
    return admitted


Ranker = Callable[[Context, Attempt, list[BackendInfo]], tuple[list[BackendInfo], bool]]


def by_throughput(ctx: Context, attempt: Attempt, candidates: list[BackendInfo]) -> tuple[list[BackendInfo], bool]:
    """``:nitro``: the highest fresh generation throughput."""
    freshness = ctx.snap.config.monitor.freshness_s
    rated = [(tps, b) for b in candidates
             if (tps := fresh_load(ctx.states.get(b.name), ctx.now, freshness).throughput) is not None]
    if not rated:
        return candidates, False
    best = max(t for t, _ in rated)
    return [b for t, b in rated if t == best], True


def by_cost(ctx: Context, attempt: Attempt, candidates: list[BackendInfo]) -> tuple[list[BackendInfo], bool]:
    """``:floor``: the lowest estimated price of this request."""
    cfg = ctx.snap.config
    meta = ctx.snap.meta(attempt.model)
    prompt, out = estimate_tokens(attempt.body or {}, cfg.proxy.variant_suffixes.default_output_tokens)
    priced = []
    for b in candidates:
        price = meta.price_on(b.name) if meta is not None else None
        if price is not None:
            priced.append(((prompt * price.input + out * price.output, price.output), b))
    if not priced:
        return candidates, False
    best = min(k for k, _ in priced)
    return [b for k, b in priced if k == best], True


RANKERS: dict[str, Ranker] = {"throughput": by_throughput, "cost": by_cost}


def estimate_tokens(body: Mapping[str, object], default_output: int) -> tuple[int, int]:
    """(prompt, output) token estimates for pricing a request before it runs."""
    chars = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict):
            content = m.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    prompt = max(1, chars // 4)
    out = body.get("max_completion_tokens", body.get("max_tokens"))
    if not isinstance(out, int) or isinstance(out, bool) or out <= 0:
        out = default_output
    return prompt, out


def _pick(ctx: Context, candidates: list[BackendInfo]) -> BackendInfo:
    if len(candidates) == 1:
        return candidates[0]
    strategy = ctx.snap.config.proxy.selection
    if strategy == "random":
        return candidates[min(int(ctx.rand * len(candidates)), len(candidates) - 1)]
    if strategy == "weighted":
        x = ctx.rand * sum(b.weight for b in candidates)
        for b in candidates:
            x -= b.weight
            if x < 0:
                return b
        return candidates[-1]
    return candidates[ctx.pick % len(candidates)]

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

from .snapshot import BackendInfo, Snapshot
from .trace import AttemptTrace


class BackendView(Protocol):
    """What the monitor knows about a backend (``monitor.BackendState``)."""

    # Read-only, so the monitor's frozen ``BackendState`` satisfies it.
    @property
    def healthy(self) -> bool: ...
    @property
    def held_out_until(self) -> float: ...
    @property
    def throughput_tps(self) -> float | None: ...
    @property
    def waiting(self) -> float | None: ...
    @property
    def scraped_at(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Load:
    """What the monitor currently knows about a backend, already freshness-checked."""

    throughput: float | None = None
    waiting: float | None = None


def fresh(scraped_at: float | None, now: float, freshness_s: float | None) -> bool:
    """Whether a backend's latest scrape is at most ``freshness_s`` old (any age when None).
    The one freshness rule: routing, the monitor's published state and its reports use it."""
    return scraped_at is not None and (freshness_s is None or now - scraped_at <= freshness_s)


def fresh_load(state: BackendView | None, now: float, freshness_s: float) -> Load:
    if state is None or not fresh(state.scraped_at, now, freshness_s):
        return Load()
    return Load(state.throughput_tps, state.waiting)


def _healthy(state: BackendView, now: float, max_waiting: int | None, freshness_s: float | None) -> bool:
    """Healthy by the last active probe."""
    return state.healthy


def _not_held_out(state: BackendView, now: float, max_waiting: int | None, freshness_s: float | None) -> bool:
    """Not held out after a failed answer (passive health)."""
    return state.held_out_until <= now


def _not_saturated(state: BackendView, now: float, max_waiting: int | None, freshness_s: float | None) -> bool:
    """Not more than ``max_waiting`` queued requests by a scrape at most
    ``freshness_s`` old (any age when None); an unknown queue never blocks."""
    if max_waiting is None or state.waiting is None or state.scraped_at is None:
        return True
    if not fresh(state.scraped_at, now, freshness_s):
        return True
    return state.waiting <= max_waiting


Filter = Callable[[BackendView, float, int | None, float | None], bool]
HOLDOUT = "holdout"
FILTERS: tuple[tuple[str, Filter], ...] = (("health", _healthy), (HOLDOUT, _not_held_out), ("saturation", _not_saturated))


def admissible(
    state: BackendView | None, now: float, max_waiting: int | None, freshness_s: float | None = None,
    holdout: bool = True,
) -> bool:
    """The one admission rule: every filter passes (the hold-out only when
    ``holdout``). A backend the monitor does not know is admitted."""
    if state is None:
        return True
    for name, passes in FILTERS:
        if not passes(state, now, max_waiting, freshness_s) and (holdout or name != HOLDOUT):
            return False
    return True


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


def select(ctx: Context, attempt: Attempt, rec: AttemptTrace | None = None) -> Selection | None:
    """The pipeline; None when no backend is admitted. ``rec`` records each step's verdicts."""
    candidates = _admitted(ctx, list(attempt.candidates), rec)
    if not candidates:
        return None
    preferred = next((b for b in candidates if b.name == attempt.preferred), None) if attempt.preferred else None
    if rec is not None and attempt.preferred:
        rec.steps["preferred"] = {"backend": attempt.preferred, "won": preferred is not None}
    if preferred is not None:
        return _chosen(rec, preferred, Selection(preferred, ranked=False))
    ranked = False
    if attempt.ranker is not None:
        candidates, ranked = _rank(ctx, attempt, candidates, rec)
    picked = _pick(ctx, candidates)
    if rec is not None:
        rec.steps["picker"] = {"strategy": ctx.snap.config.proxy.selection, "among": [b.name for b in candidates]}
    return _chosen(rec, picked, Selection(picked, ranked))


def lone_admitted(snap: Snapshot, states: Mapping[str, BackendView], now: float, backend: BackendInfo) -> bool:
    """:func:`select` over one candidate with no ranker: it is picked when
    admitted, the hold-out aside (``_admitted`` sets the hold-out aside when
    it would exclude every candidate, and the lone one is every candidate)."""
    mon = snap.config.monitor
    return admissible(states.get(backend.name), now, mon.max_waiting, mon.freshness_s, holdout=False)


def _chosen(rec: AttemptTrace | None, backend: BackendInfo, selection: Selection) -> Selection:
    if rec is not None:
        rec.chosen = backend.name
        rec.verdict(backend.name, "chosen")
        for name in rec.candidates:
            rec.verdict(name, "admitted, not picked")
    return selection


def _admitted(ctx: Context, candidates: list[BackendInfo], rec: AttemptTrace | None) -> list[BackendInfo]:
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
    if rec is not None:
        for b in candidates:
            _record_filters(ctx, rec, b, holdout)
    return admitted


def _record_filters(ctx: Context, rec: AttemptTrace, b: BackendInfo, holdout: bool) -> None:
    state = ctx.states.get(b.name)
    entry = rec.candidate(b.name)
    if state is None:  # admissible() admits a backend the monitor does not know
        entry["filters"] = {name: "pass" for name, _ in FILTERS}
        entry["monitor"] = None
        return
    mon = ctx.snap.config.monitor
    verdicts = {}
    for name, passes in FILTERS:
        if passes(state, ctx.now, mon.max_waiting, mon.freshness_s):
            verdicts[name] = "pass"
        elif name == HOLDOUT and not holdout:
            verdicts[name] = "ignored: it would exclude every candidate"
        else:
            verdicts[name] = "fail"
            entry.setdefault("reason", name)
            rec.verdict(b.name, f"excluded by the {name} filter")
    entry["filters"] = verdicts
    entry["monitor"] = {
        "healthy": state.healthy, "held_out_s": max(0.0, state.held_out_until - ctx.now),
        "waiting": state.waiting, "max_waiting": mon.max_waiting,
        "scrape_age_s": None if state.scraped_at is None else ctx.now - state.scraped_at,
    }


Key = tuple[float, ...]  # a ranker's measurement; equal keys tie


@dataclass(frozen=True, slots=True)
class Ranker:
    """Measures each candidate (None: no statement about it) and keeps those
    tied at the best measurement; ``facts`` says what a measurement rests on."""

    name: str
    measure: Callable[[Context, Attempt, list[BackendInfo]], list[Key | None]]
    best: Callable[[list[Key]], Key]
    facts: Callable[[Context, Attempt, BackendInfo, Key | None], dict[str, object]]


def _rank(
    ctx: Context, attempt: Attempt, candidates: list[BackendInfo], rec: AttemptTrace | None,
) -> tuple[list[BackendInfo], bool]:
    ranker = RANKERS[attempt.ranker or ""]
    keys = ranker.measure(ctx, attempt, candidates)
    rated = [(k, b) for k, b in zip(keys, candidates) if k is not None]
    best = ranker.best([k for k, _ in rated]) if rated else None
    if rec is not None:
        rec.steps["ranker"] = {"name": ranker.name, "applied": best is not None}
        for k, b in zip(keys, candidates):
            facts = ranker.facts(ctx, attempt, b, k)
            rec.candidate(b.name)["ranker"] = facts
            if best is not None and k != best:
                reason = str(facts["missing"]) if k is None else f"lower {ranker.name}"
                rec.candidate(b.name)["reason"] = reason
                rec.verdict(b.name, f"excluded by the {ranker.name} ranker: {reason}")
    if best is None:
        return candidates, False
    return [b for k, b in rated if k == best], True


def _throughputs(ctx: Context, attempt: Attempt, candidates: list[BackendInfo]) -> list[Key | None]:
    """``:nitro``: the fresh generation throughput."""
    freshness = ctx.snap.config.monitor.freshness_s
    out: list[Key | None] = []
    for b in candidates:
        tps = fresh_load(ctx.states.get(b.name), ctx.now, freshness).throughput
        out.append(None if tps is None else (tps,))
    return out


def _throughput_facts(ctx: Context, attempt: Attempt, b: BackendInfo, key: Key | None) -> dict[str, object]:
    freshness = ctx.snap.config.monitor.freshness_s
    state = ctx.states.get(b.name)
    facts: dict[str, object] = {
        "throughput_tps": None if key is None else key[0],
        "scrape_age_s": None if state is None or state.scraped_at is None else ctx.now - state.scraped_at,
        "freshness_s": freshness,
    }
    if key is None:
        facts["missing"] = (
            "no monitor data" if state is None else "never scraped" if state.scraped_at is None
            else "stale" if not fresh(state.scraped_at, ctx.now, freshness) else "no throughput figure"
        )
    return facts


def _costs(ctx: Context, attempt: Attempt, candidates: list[BackendInfo]) -> list[Key | None]:
    """``:floor``: the estimated price of this request, then the output price."""
    meta = ctx.snap.meta(attempt.model)
    prompt, out = estimate_tokens(attempt.body or {}, ctx.snap.config.proxy.variant_suffixes.default_output_tokens)
    keys: list[Key | None] = []
    for b in candidates:
        price = meta.price_on(b.name) if meta is not None else None
        keys.append(None if price is None else (prompt * price.input + out * price.output, price.output))
    return keys


def _cost_facts(ctx: Context, attempt: Attempt, b: BackendInfo, key: Key | None) -> dict[str, object]:
    prompt, out = estimate_tokens(attempt.body or {}, ctx.snap.config.proxy.variant_suffixes.default_output_tokens)
    facts: dict[str, object] = {
        "estimated_cost_usd": None if key is None else key[0] / 1e6,
        "output_price": None if key is None else key[1],
        "prompt_tokens": prompt,
        "output_tokens": out,
    }
    if key is None:
        facts["missing"] = "no price"
    return facts


RANKERS: dict[str, Ranker] = {
    "throughput": Ranker("throughput", _throughputs, max, _throughput_facts),
    "cost": Ranker("cost", _costs, min, _cost_facts),
}


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

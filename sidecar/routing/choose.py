"""The selection stage: the first attempt's backend, then the hops of the
model's fallback chain when it has none admissible, and the hops a failed
attempt moves to; with the limits each is charged to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import Reply
from . import attempts, limits, selection
from .attempts import Hop
from .context import Parsed, Request
from .memo import PerSnapshot
from .reservation import reserved_by
from .route import Fallback, ResponsePlan
from .snapshot import BackendInfo, Snapshot
from .suffixes import SUFFIXES, Suffix, supported
from .trace import AttemptTrace

Edits = dict[str, Any]  # top-level body fields to set


@dataclass(slots=True)
class Target:
    """What the experiment stage leaves for selection."""

    model: str  # the model to dispatch first
    allowed: frozenset[str] | None  # backends the request may use (key allow-list, arm pin)
    may_fall_back: bool  # walk the model's fallback chain when it has no admissible backend
    continues: tuple[str, str] | None = None  # (owner backend, engine's id) of previous_response_id


def limits_of(snap: Snapshot, req: Request, client_model: str, cost: int) -> limits.LimitPlan | Reply | None:
    """The limits on the client-facing model's canonical id (a metadata alias
    counts as its model; for an experiment, every arm's): the descriptor for
    Envoy's request rates, and the token budgets' verdict."""
    if not snap.limits and req.trace is None:
        return None  # no limits configured: one check
    key_id = req.caller.key.id if req.caller.key is not None else None
    model = snap.resolve(client_model)[0]
    rules = limits.applicable(snap, model, key_id)
    if not rules:
        if req.trace is not None and snap.limits:
            req.trace.stage("limits", f"none: no limit names '{model}'")
        return None
    verdict = limits.plan(rules, model, key_id, req.spent, req.now, cost)
    if req.trace is not None:
        req.trace.stage(
            "limits", f"refused: the token budget {verdict.rule.id} is spent" if isinstance(verdict, limits.BudgetState)
            else f"under {', '.join(r.id for r in rules)}", rules=[r.id for r in rules],
        )
    if isinstance(verdict, limits.BudgetState):
        return limits.refusal(verdict, client_model, req.ingress.family, req.now)
    return verdict


_served: PerSnapshot[tuple[str, tuple[BackendInfo, ...]]] = PerSnapshot()


def _candidates(
    snap: Snapshot, name: str, allowed: frozenset[str] | None, rec: AttemptTrace | None,
) -> tuple[str, tuple[BackendInfo, ...]]:
    """Metadata alias dispatch, then the backends that serve the model and that
    the request may use: (the id to dispatch, those backends)."""
    if rec is None:
        found = _served.find(snap, (name, allowed))
        return found if found is not None else _served.keep((name, allowed), _serving(snap, name, allowed, None))
    return _serving(snap, name, allowed, rec)


def _serving(
    snap: Snapshot, name: str, allowed: frozenset[str] | None, rec: AttemptTrace | None,
) -> tuple[str, tuple[BackendInfo, ...]]:
    model, serving = snap.resolve(name)
    out = []
    for n in serving:
        b = snap.backends[n]
        if not b.internal and (allowed is None or n in allowed):
            out.append(b)
        elif rec is not None:
            rec.candidate(n)["reason"] = "internal" if b.internal else "not allowed"
            rec.verdict(n, "not a candidate: " + ("internal" if b.internal else "outside the allowed backends"))
    if rec is not None:
        rec.model = model
    return model, tuple(out)


def select(
    snap: Snapshot, req: Request, parsed: Parsed, target: Target, requested: str, word: str | None,
    plan: ResponsePlan,
) -> tuple[str, BackendInfo, Edits, tuple[Hop, ...]] | Reply:
    """The first attempt, then the hops of the fallback chain: (model, backend,
    body edits, the hops to move to if that attempt fails upstream)."""
    family = req.ingress.family
    trace = req.trace
    rec = trace.attempt(target.model, "first") if trace is not None else None
    model, candidates_ = _candidates(snap, target.model, target.allowed, rec)
    candidates: Sequence[BackendInfo] = candidates_
    if not candidates and target.continues is not None:
        # The response it continues is held where this model (or this caller) cannot go.
        return errors.previous_response_not_found(_previous_id(parsed))
    sent = parsed.model  # what refusals name: never what an alias stands for
    if not candidates:
        if any(not snap.backends[n].internal for n in snap.resolve(target.model)[1]):
            return errors.model_not_permitted(sent, family)
        return errors.model_not_found(sent, family)
    suffix = SUFFIXES[word] if word is not None else None
    data = parsed.json or {}
    edits: Edits = {}
    if suffix is not None:
        checked = _suffix_checks(snap, model, candidates, suffix, data, sent, word or "", family, rec)
        if isinstance(checked, Reply):
            return checked
        candidates, edits = checked
        plan.suffix, plan.rewrite_model = word, requested
    ranker = suffix.ranker if suffix is not None else None
    first, ctx = _first(snap, req, model, candidates, ranker, data, rec)
    online = suffix is not None and suffix.online
    may_fall_back = target.may_fall_back and not online
    chain = [h for h in fallback_hops(snap, target.model, model) if _permitted(req, h)] if may_fall_back else []
    if first is not None:
        plan.suffix_applied = first.ranked or ranker is None
        plan.drop_effort = "reasoning_effort" in edits
        if not chain:
            return model, first.backend, edits, ()
        ctx = ctx or _context(req, snap)
        return model, first.backend, edits, _retry_hops(snap, req, ctx, target, (target.model, first.backend), chain, parsed)
    if may_fall_back:
        ctx = ctx or _context(req, snap)
        hop = _fall_back(snap, req, ctx, target, chain, data)
        if hop is not None:
            at, hop_model, backend = hop
            # A hop dispatches another model: it inherits no suffix.
            plan.suffix_applied = suffix is None
            plan.fallback = Fallback(target.model, hop_model, "no_admissible_backend", hop_model not in snap.reserved)
            return hop_model, backend, {}, _retry_hops(snap, req, ctx, target, (chain[at], backend), chain[at + 1:], parsed)
    elif trace is not None:
        trace.stage("fallback", "not tried: :online requests do not fall back" if online
                    else "not tried: the experiment's fallback is within_variant")
    return errors.error("no_backend", f"No healthy backend can serve the model '{sent}' right now.", family)


def _first(
    snap: Snapshot, req: Request, model: str, candidates: Sequence[BackendInfo], ranker: str | None, data: Edits,
    rec: AttemptTrace | None,
) -> tuple[selection.Selection | None, selection.Context | None]:
    """The first attempt's selection, and its context (None when it needed none)."""
    if ranker is None and rec is None and len(candidates) == 1:
        # One candidate, nothing to rank: the selection is whether it is admitted.
        lone = candidates[0]
        admitted = selection.lone_admitted(snap, req.states, req.mono, lone)
        return (selection.Selection(lone, False) if admitted else None), None
    ctx = _context(req, snap)
    attempt = selection.Attempt(model, candidates, ranker, req.headers.get("x-backend"), data)
    return selection.select(ctx, attempt, rec), ctx


def _context(req: Request, snap: Snapshot) -> selection.Context:
    return selection.Context(snap, req.states, req.mono, req.pick, req.rand)


def _fall_back(
    snap: Snapshot, req: Request, ctx: selection.Context, target: Target, hops: list[str], data: Edits,
) -> tuple[int, str, BackendInfo] | None:
    """The first hop of the chain with an admissible backend: (its place in
    the chain, its model, the backend)."""
    trace = req.trace
    served = None
    for n, hop in enumerate(hops):
        rec = trace.attempt(hop, f"fallback hop {n + 1}") if trace is not None else None
        chosen = _hop_selection(snap, ctx, target, hop, data, rec)
        if chosen is not None:
            served = n, chosen[0], chosen[1]
            break
    if trace is not None:
        trace.stage("fallback", f"hop '{served[1]}' served" if served else (
            "every hop failed" if hops else "no fallback chain"), chain=hops)
    return served


def _hop_selection(
    snap: Snapshot, ctx: selection.Context, target: Target, hop: str, data: Edits, rec: AttemptTrace | None,
    among: frozenset[str] | None = None,
) -> tuple[str, BackendInfo] | None:
    """One hop's selection: inside the request's allow-list (and ``among``),
    no ranker, no preference: (the id it dispatches as, the backend) or None."""
    hop_model, served = _candidates(snap, hop, target.allowed, rec)
    candidates: Sequence[BackendInfo] = served
    if among is not None:
        candidates = [b for b in candidates if b.name in among]
    chosen = selection.select(ctx, selection.Attempt(hop_model, candidates, body=data), rec) if candidates else None
    return None if chosen is None else (hop_model, chosen.backend)


def _retry_hops(
    snap: Snapshot, req: Request, ctx: selection.Context, target: Target, dispatched: tuple[str, BackendInfo],
    chain: list[str], parsed: Parsed,
) -> tuple[Hop, ...]:
    """Where the request moves if the attempt ``dispatched`` (model, backend)
    fails upstream: up to ``fallback_attempts`` of the following hops, each on
    the backend its own selection picks now (hops with none admissible are
    skipped), among the backends the bootstrap has clusters for. JSON bodies
    only: the hop's filter rewrites ``model`` there."""
    if parsed.json is None or not chain or dispatched[1].name not in attempts.hop_backends(snap, dispatched[0]):
        return ()
    out: list[Hop] = []
    for hop in chain:
        if len(out) == snap.config.fallback_attempts:
            break
        chosen = _hop_selection(snap, ctx, target, hop, parsed.json, None, attempts.hop_backends(snap, hop))
        charged = _hop_limits(snap, req, chosen[0]) if chosen is not None else None
        if chosen is not None and charged is not None:
            out.append(Hop(hop, chosen[0], chosen[1].name, *charged))
    if req.trace is not None and out:
        req.trace.stage("retry_hops", "on an upstream failure: " + ", ".join(
            f"'{h.upstream_model}' on {h.backend}" for h in out),
            hops=[{"model": h.upstream_model, "backend": h.backend} for h in out])
    return tuple(out)


def _permitted(req: Request, model: str) -> bool:
    """A hop the key may use: one its allowed_models names (the key gate's rule)."""
    key = req.caller.key
    return key is None or key.allowed_models is None or model in key.allowed_models


def _hop_limits(snap: Snapshot, req: Request, model: str) -> tuple[str, tuple[str, ...]] | None:
    """What a hop after a failed attempt is charged to: (its limited model or
    "", its token budgets), or None when one of them is spent (the hop is skipped)."""
    # A retry is settled from its own entry; it reserves nothing up front.
    limited = limits_of(snap, req, model, 0)
    if isinstance(limited, Reply):
        return None
    return ("", ()) if limited is None else (limited.model, limited.budgets)


def fallback_hops(snap: Snapshot, origin: str, dispatched: str) -> list[str]:
    """The chain of ``origin`` (or of the id it dispatches as). A chain whose
    origin is not reserved skips reserved hops, so ordinary routing never
    reaches a hidden arm's model."""
    chains = snap.config.fallback_chains
    if not chains:
        return []

    def compute() -> list[str]:
        chain = chains.get(origin) or chains.get(dispatched) or []
        if origin in snap.reserved or dispatched in snap.reserved:
            return list(chain)
        return [hop for hop in chain if reserved_by(snap, hop) is None]

    return list(attempts.memo(snap, ("chain", origin, dispatched), compute))


def _suffix_checks(
    snap: Snapshot, model: str, candidates: Sequence[BackendInfo], suffix: Suffix, data: Edits, requested: str,
    word: str, family: str, rec: AttemptTrace | None,
) -> tuple[Sequence[BackendInfo], Edits] | Reply:
    """Refusals a suffix can cause before anything is chosen, and its edits."""
    if not supported(snap, model, suffix):
        return _unsupported(requested, word, family)
    if suffix.thinking:
        return candidates, ({} if "reasoning_effort" in data else {"reasoning_effort": "high"})
    if suffix.online:
        # The router runs the search loop itself: buffered only, and only on
        # backends it may add a tool to.
        if data.get("stream") is True:
            return _unsupported(requested, word, family)
        usable = [b for b in candidates if not b.config.commercial and b.family == "openai"]
        if rec is not None:
            for b in candidates:
                if b not in usable:
                    rec.candidate(b.name)["reason"] = "online"
                    rec.verdict(b.name, "not a candidate: :online needs a non-commercial OpenAI-family backend")
        candidates = usable
        if not candidates:
            return _unsupported(requested, word, family)
    return candidates, {}


def _previous_id(parsed: Parsed) -> str:
    return str((parsed.json or {}).get("previous_response_id"))


def _unsupported(requested: str, word: str, family: str) -> Reply:
    return errors.error(
        "unsupported_model_variant",
        f"The model '{requested}' is not available: the ':{word}' variant is not supported for this model.",
        family, param="model",
    )

"""The routing decision: request + config snapshot -> route or refusal.

Pure: no I/O, no clocks, no global state. The request path is a sequence of
named stages: parse -> aliases and suffix -> key gate -> reservation ->
experiment -> selection (over the fallback chain) -> plan -> cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import errors
from ..decision import KIND
from ..errors import Reply
from ..payload.body import BodyError, replace_query_model, set_top_level
from ..payload.formdata import replace_field
from ..payload.response_ids import Owner
from . import affinity, attempts, limits, selection, shadow
from .assignment import is_blank
from .attempts import Hop
from .cache_key import plan_cache
from .context import Parsed, Request, parse, sticky_value
from .front import Front, front
from .memo import PerSnapshot
from .reservation import reserved_by
from .route import Fallback, ResponsePlan, Route, upstream_auth
from .snapshot import BackendInfo, ExperimentInfo, Snapshot
from .suffixes import SUFFIXES, Suffix, supported
from .trace import AttemptTrace, Trace

Edits = dict[str, Any]  # top-level body fields to set


@dataclass(slots=True)
class _Target:
    """What the experiment stage leaves for selection."""

    model: str  # the model to dispatch first
    allowed: frozenset[str] | None  # backends the request may use (key allow-list, arm pin)
    may_fall_back: bool  # walk the model's fallback chain when it has no admissible backend
    continues: tuple[str, str] | None = None  # (owner backend, engine's id) of previous_response_id


def decide(snap: Snapshot, req: Request) -> Route | Reply:
    """The decision; with ``req.trace`` set, every stage records what it saw and concluded."""
    family = req.ingress.family
    trace = req.trace
    try:
        parsed = parse(req)
    except BodyError as exc:
        if trace is not None:
            trace.stage("parse", f"refused: {exc}")
        return errors.error(exc.kind, str(exc), family, param=exc.param)
    if trace is not None:
        trace.stage("parse", f"the request names model '{parsed.model}'", model=parsed.model,
                    ingress=req.ingress.path, family=family)
    first = front(snap, req, parsed.model)
    if first.refusal is not None:
        return first.refusal
    requested, client_model, word = first.requested, first.client_model, first.word
    continues = _continues(snap, req, parsed)
    if isinstance(continues, Reply):
        return continues
    cost = limits.estimate(req.body, parsed.json)
    limited = _limits(snap, req, client_model, sum(cost))
    if isinstance(limited, Reply):
        return limited
    plan = ResponsePlan(family=family, kind="routed" if req.ingress.counted else "count_tokens", estimate=cost,
                        background=req.ingress.response_ids and (parsed.json or {}).get("background") is True)
    target = _experiment(snap, req, parsed, first, plan)
    if isinstance(target, Reply):
        return _attributed(target, plan)
    if continues is not None:
        owner = continues[0]
        target.allowed = frozenset((owner,)) if target.allowed is None else target.allowed & {owner}
        target.continues = continues
    chosen = _select(snap, req, parsed, target, requested, word, plan)
    if isinstance(chosen, Reply):
        return _attributed(chosen, plan)
    upstream, backend, edits, hops = chosen
    if plan.fallback is not None:
        # A hop serves the request: its model's limits apply, not the origin's.
        limited = _limits(snap, req, plan.fallback.served, sum(cost))
        if isinstance(limited, Reply):
            return _attributed(limited, plan)
    if continues is not None:
        edits["previous_response_id"] = continues[1]
    route = _build(snap, req, parsed, client_model, plan, upstream, backend, edits)
    if plan.id_tag is not None:
        # The id handed back names the backend chosen here; a hop elsewhere
        # would store the response where the id does not point.
        hops = tuple(h for h in hops if h.backend == backend.name)
    if hops:
        route.hops = hops
        plan.chain_origin, plan.hop_path = target.model, _hop_path(route, req)
    route.limits = limited
    _own_name(route)
    _cache(snap, req, parsed, route, edits, target)
    _shadow(snap, req, route)
    return route


def _shadow(snap: Snapshot, req: Request, route: Route) -> None:
    """The shadow stage: whether Envoy also copies this request to its
    experiment's shadow arm (a share of the experiment's routed requests)."""
    plan = route.plan
    if plan is None or plan.kind != "routed" or plan.experiment is None:
        return
    info = snap.experiments.get(route.client_model)
    if info is None or not info.config.shadows:
        return
    arm = info.config.shadows[0]
    if req.ingress.body != "json":
        if req.trace is not None:
            req.trace.stage("shadow", f"not copied: the arm's model is written into a JSON body, and this is a "
                            f"{req.ingress.body} request", copied=False, arm=arm.id)
        return
    cluster = shadow.draw(info.config, req.shadow_rand)
    if cluster is not None:
        route.shadow = (cluster, arm.id)
    if req.trace is not None:
        verdict = (f"copied to the shadow arm '{arm.id}' ({arm.model})" if cluster is not None
                   else f"not copied (the shadow arm '{arm.id}' gets a share of {arm.shadow.share})")
        req.trace.stage("shadow", verdict, copied=cluster is not None, arm=arm.id)


def _own_name(route: Route) -> None:
    """An engine that answers with its own model name whatever was asked
    (llama.cpp, TGI) gets the name the request was sent as written back, so a
    response names what it would on an engine that echoes the request."""
    plan = route.plan
    engine = route.backend.config.engine
    if plan is not None and plan.rewrite_model is None and plan.kind == "routed" and engine is not None \
            and not engine.echoes_model:
        plan.rewrite_model = route.upstream_model


def _cache(snap: Snapshot, req: Request, parsed: Parsed, route: Route, edits: Edits, target: _Target) -> None:
    """The response cache's stage: the key of a cacheable request (the body
    as the backend gets it: ``edits`` holds every field the route changed)."""
    cfg = snap.config.cache
    if cfg is None:
        return
    data = {**parsed.json, **edits} if parsed.json is not None else None
    plan = route.plan
    assert plan is not None
    if plan.id_tag is not None or target.continues is not None:
        # A stored response is state on its backend: a replay would hand a
        # second caller the first one's response id.
        if req.trace is not None:
            req.trace.stage("cache", "not cached: a stored Responses API response", cached=False)
        return
    info = snap.experiments.get(route.client_model) if plan.experiment is not None else None
    sticky = info.config.sticky_key if info is not None else ""
    plan.cache, verdict = plan_cache(
        cfg, req, route, data, _sorted(target.allowed), sticky[7:] if sticky.startswith("header:") else None,
    )
    if req.trace is not None:
        req.trace.stage("cache", verdict, cached=plan.cache is not None)


def _limits(snap: Snapshot, req: Request, client_model: str, cost: int) -> limits.LimitPlan | Reply | None:
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


def _continues(snap: Snapshot, req: Request, parsed: Parsed) -> tuple[str, str] | Reply | None:
    """A create that continues a stored response goes where that response is."""
    if not req.ingress.continues or parsed.json is None:
        return None
    found = affinity.continued(snap, req.caller, parsed.json)
    if req.trace is not None and found is not None:
        req.trace.stage("continues", "refused: previous_response_id names no response this caller can reach"
                        if isinstance(found, Reply) else f"previous_response_id is held by backend '{found[0]}'",
                        backend=None if isinstance(found, Reply) else found[0])
    return found


def _attributed(reply: Reply, plan: ResponsePlan) -> Reply:
    """A refusal after an arm was chosen still counts on that arm (and stays a refusal)."""
    return replace(reply, meta=reply.meta | plan.decision().without(KIND))


def _experiment(snap: Snapshot, req: Request, parsed: Parsed, first: Front, plan: ResponsePlan) -> _Target | Reply:
    """The experiment picks an arm; its pin narrows the key's backend allow-list."""
    client_model, allowed, info = first.client_model, first.allowed, first.info
    if info is None:
        if req.trace is not None:
            req.trace.stage("experiment", f"none: '{client_model}' is not an experiment's client model"
                            if req.ingress.experiments else "none: this endpoint dispatches the name literally",
                            experiment=None, backends=_sorted(allowed))
        return _Target(client_model, allowed, may_fall_back=True)
    exp = info.config
    sticky = sticky_value(exp, req, parsed)
    caller = None
    if sticky is not None and not is_blank(sticky):
        caller = info.race.caller_key(info.prefix, sticky, exp.sticky_ttl, req.now)[0]
    if req.trace is not None:
        index = _traced_arm(req.trace, info, sticky, req)
    elif caller is None:
        index = info.race.pick(info.prefix, sticky, exp.sticky_ttl, req.now, req.random_bytes)
    else:
        index = info.race.pick_key(caller)
    variant = exp.variants[index]
    plan.experiment, plan.variant = exp.name, variant.id
    plan.assignment = "random" if caller is None else "sticky"
    plan.caller = None if caller is None else caller[:8].hex()
    plan.attribute = exp.response_headers
    plan.rewrite_model = client_model if exp.response_model == "client" else None
    plan.read_usage = req.ingress.usage
    if variant.backends is not None:
        allowed = _pinned(snap, info, index, allowed)
    if req.trace is not None:  # the experiment stage _traced_arm recorded
        req.trace.stages[-1].update(pin=variant.backends, backends=_sorted(allowed), fallback=exp.fallback)
    if variant.backends is not None and not allowed:
        return errors.model_not_permitted(parsed.model, req.ingress.family)
    return _Target(variant.model, allowed, may_fall_back=exp.fallback == "cross_variant")


_pins: PerSnapshot[frozenset[str]] = PerSnapshot()


def _pinned(snap: Snapshot, info: ExperimentInfo, index: int, allowed: frozenset[str] | None) -> frozenset[str]:
    """The backends an arm with a pin may use: its pin, inside the key's allow-list."""

    def compute() -> frozenset[str]:
        pin = frozenset(info.config.variants[index].backends or ())
        return pin if allowed is None else allowed & pin

    return _pins.get(snap, (info.index, index, allowed), compute)


def _traced_arm(trace: Trace, info: ExperimentInfo, sticky: str | None, req: Request) -> int:
    """The arm, with every arm's score for this caller (the race ``pick`` runs)."""
    exp = info.config
    a = info.race.assign(info.prefix, sticky, exp.sticky_ttl, req.now, req.random_bytes)
    winner = exp.variants[a.variant_index]
    how = "sticky" if a.sticky else "random"
    trace.stage(
        "experiment", f"{exp.name}: arm {winner.id} ({how}), model '{winner.model}'",
        experiment=exp.name, sticky_key=exp.sticky_key,
        sticky_value=sticky if exp.sticky_key != "api_key" else None, assignment=how,
        sticky_ttl=exp.sticky_ttl, window=a.window, unix_time=req.now, arm=winner.id, model=winner.model,
        scores=[
            {"variant_id": sc.variant_id, "model": v.model, "weight": sc.weight,
             "u": None if sc.weight == 0 else sc.u, "score": sc.score if sc.weight > 0 else None}
            for sc, v in zip(a.scores, exp.variants)
        ],
    )
    return a.variant_index


def _sorted(backends: frozenset[str] | None) -> list[str] | None:
    return None if backends is None else sorted(backends)


_served: PerSnapshot[tuple[str, tuple[BackendInfo, ...]]] = PerSnapshot()


def _candidates(
    snap: Snapshot, name: str, allowed: frozenset[str] | None, rec: AttemptTrace | None,
) -> tuple[str, tuple[BackendInfo, ...]]:
    """Metadata alias dispatch, then the backends that serve the model and that
    the request may use: (the id to dispatch, those backends)."""
    if rec is None:
        return _served.get(snap, (name, allowed), lambda: _serving(snap, name, allowed, None))
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


def _select(
    snap: Snapshot, req: Request, parsed: Parsed, target: _Target, requested: str, word: str | None,
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
    ctx = selection.Context(snap, req.states, req.mono, req.pick, req.rand)
    if ranker is None and rec is None and len(candidates) == 1:
        # One candidate, nothing to rank: the selection is whether it is admitted.
        lone = candidates[0]
        first = selection.Selection(lone, False) if selection.lone_admitted(ctx, lone) else None
    else:
        first = selection.select(
            ctx, selection.Attempt(model, candidates, ranker, req.headers.get("x-backend"), data), rec,
        )
    online = suffix is not None and suffix.online
    may_fall_back = target.may_fall_back and not online
    chain = [h for h in fallback_hops(snap, target.model, model) if _permitted(req, h)] if may_fall_back else []
    if first is not None:
        plan.suffix_applied = first.ranked or ranker is None
        plan.drop_effort = "reasoning_effort" in edits
        return model, first.backend, edits, _retry_hops(snap, req, ctx, target, (target.model, first.backend), chain, parsed)
    if may_fall_back:
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


def _fall_back(
    snap: Snapshot, req: Request, ctx: selection.Context, target: _Target, hops: list[str], data: Edits,
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
    snap: Snapshot, ctx: selection.Context, target: _Target, hop: str, data: Edits, rec: AttemptTrace | None,
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
    snap: Snapshot, req: Request, ctx: selection.Context, target: _Target, dispatched: tuple[str, BackendInfo],
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
    limited = _limits(snap, req, model, 0)
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


def _build(
    snap: Snapshot, req: Request, parsed: Parsed, client_model: str, plan: ResponsePlan,
    upstream: str, chosen: BackendInfo, edits: Edits,
) -> Route:
    """The request as the backend gets it: model, stream usage, path, credentials."""
    ingress = req.ingress
    new_body: bytes | None = None
    new_path: str | None = None
    if parsed.json is not None:
        data = parsed.json
        if data["model"] != upstream:
            edits["model"] = upstream
        if (
            plan.read_usage and data.get("stream") is True and ingress.family == "openai"
            and ingress.path in ("/v1/chat/completions", "/v1/completions")
        ):
            opts = data.get("stream_options")
            if not (isinstance(opts, dict) and opts.get("include_usage") is True):
                opts = dict(opts) if isinstance(opts, dict) else {}
                opts["include_usage"] = True
                edits["stream_options"] = opts
                plan.strip_injected_usage = True
        if edits:
            new_body = set_top_level(req.body, edits, data)
    elif parsed.form_field is not None:
        if parsed.model != upstream:
            new_body = replace_field(req.body, parsed.form_field, upstream)
    elif parsed.model != upstream:
        new_path = replace_query_model(req.path, upstream)

    query = req.path.partition("?")[2] if new_path is None else new_path.partition("?")[2]
    target = chosen.base_path + ingress.upstream_path + ("?" + query if query else "")
    if target != req.path:
        new_path = target
    if ingress.response_ids and (parsed.json or {}).get("store") is not False:
        key_id = req.caller.key.id if req.caller.key is not None else ""
        plan.id_tag = Owner(chosen.name, plan.rewrite_model or client_model, plan.rewrite_model is not None,
                            key_id).payload()
    set_headers, remove_headers = upstream_auth(snap, chosen)
    return Route(
        backend=chosen, client_model=client_model, upstream_model=upstream, body=new_body, path=new_path,
        set_headers=set_headers, remove_headers=remove_headers, plan=plan,
    )


def _previous_id(parsed: Parsed) -> str:
    return str((parsed.json or {}).get("previous_response_id"))


def _hop_path(route: Route, req: Request) -> str:
    """The request's path without its backend's base path: a hop puts its own in front."""
    path = route.path if route.path is not None else req.path
    base = route.backend.base_path
    return path[len(base):] if base and path.startswith(base) else path


def _unsupported(requested: str, word: str, family: str) -> Reply:
    return errors.error(
        "unsupported_model_variant",
        f"The model '{requested}' is not available: the ':{word}' variant is not supported for this model.",
        family, param="model",
    )

"""The routing decision: request + config snapshot -> route or refusal.

Pure: no I/O, no clocks; the only state kept is tables of what one config
snapshot determines (:mod:`.memo`). The request path is a sequence of named
stages: parse -> aliases and suffix -> key gate -> reservation (:mod:`.front`)
-> experiment -> selection over the fallback chain (:mod:`.choose`) -> plan ->
cache -> shadow.
"""

from __future__ import annotations

from dataclasses import replace

from .. import errors
from ..decision import KIND
from ..errors import Reply
from ..payload.body import BodyError, replace_query_model, set_top_level
from ..payload.formdata import replace_field
from ..payload.response_ids import Owner
from . import affinity, limits, shadow
from .assignment import is_blank
from .cache_key import plan_cache
from .choose import Edits, Target, limits_of, select
from .context import Parsed, Request, parse, sticky_value
from .front import Front, front
from .memo import PerSnapshot
from .route import ResponsePlan, Route, upstream_auth
from .snapshot import BackendInfo, ExperimentInfo, Snapshot
from .trace import Trace


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
    # A stage that is off costs its check here, no call.
    continues = _continues(snap, req, parsed) if req.ingress.continues and parsed.json is not None else None
    if isinstance(continues, Reply):
        return continues
    cost = limits.estimate(req.body, parsed.json)
    limited = limits_of(snap, req, client_model, sum(cost)) if snap.limits else None
    if isinstance(limited, Reply):
        return limited
    # (Positional, in field order, as below: keywords cost about 0.1 µs each on the request path.)
    plan = ResponsePlan(family, "routed" if req.ingress.counted else "count_tokens", cost,
                        req.ingress.response_ids and (parsed.json or {}).get("background") is True)
    target = _experiment(snap, req, parsed, first, plan)
    if isinstance(target, Reply):
        return _attributed(target, plan)
    if continues is not None:
        owner = continues[0]
        target.allowed = frozenset((owner,)) if target.allowed is None else target.allowed & {owner}
        target.continues = continues
    chosen = select(snap, req, parsed, target, requested, word, plan)
    if isinstance(chosen, Reply):
        return _attributed(chosen, plan)
    upstream, backend, edits, hops = chosen
    if plan.fallback is not None:
        # A hop serves the request: its model's limits apply, not the origin's.
        limited = limits_of(snap, req, plan.fallback.served, sum(cost))
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
    if backend.names_itself:
        _own_name(route)
    if snap.config.cache is not None:
        _cache(snap, req, parsed, route, edits, target)
    if first.info is not None and first.info.config.shadows:
        _shadow(req, route, first.info)
    return route


def _shadow(req: Request, route: Route, info: ExperimentInfo) -> None:
    """The shadow stage, for an experiment with a shadow arm: whether Envoy
    also copies this request there (a share of the experiment's routed requests)."""
    plan = route.plan
    if plan is None or plan.kind != "routed" or plan.experiment is None:
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
    """For a backend that names itself: an engine that answers with its own
    model name whatever was asked (llama.cpp, TGI) gets the name the request
    was sent as written back, so a response names what it would on an engine
    that echoes the request."""
    plan = route.plan
    if plan is not None and plan.rewrite_model is None and plan.kind == "routed":
        plan.rewrite_model = route.upstream_model


def _cache(snap: Snapshot, req: Request, parsed: Parsed, route: Route, edits: Edits, target: Target) -> None:
    """The response cache's stage: the key of a cacheable request (the body
    as the backend gets it: ``edits`` holds every field the route changed)."""
    cfg = snap.config.cache
    assert cfg is not None
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


def _continues(snap: Snapshot, req: Request, parsed: Parsed) -> tuple[str, str] | Reply | None:
    """A create that continues a stored response goes where that response is
    (for an ingress that continues them, a JSON body)."""
    assert parsed.json is not None
    found = affinity.continued(snap, req.caller, parsed.json)
    if req.trace is not None and found is not None:
        req.trace.stage("continues", "refused: previous_response_id names no response this caller can reach"
                        if isinstance(found, Reply) else f"previous_response_id is held by backend '{found[0]}'",
                        backend=None if isinstance(found, Reply) else found[0])
    return found


def _attributed(reply: Reply, plan: ResponsePlan) -> Reply:
    """A refusal after an arm was chosen still counts on that arm (and stays a refusal)."""
    return replace(reply, meta=reply.meta | plan.decision().without(KIND))


def _experiment(snap: Snapshot, req: Request, parsed: Parsed, first: Front, plan: ResponsePlan) -> Target | Reply:
    """The experiment picks an arm; its pin narrows the key's backend allow-list."""
    client_model, allowed, info = first.client_model, first.allowed, first.info
    if info is None:
        if req.trace is not None:
            req.trace.stage("experiment", f"none: '{client_model}' is not an experiment's client model"
                            if req.ingress.experiments else "none: this endpoint dispatches the name literally",
                            experiment=None, backends=_sorted(allowed))
        return Target(client_model, allowed, True)
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
    return Target(variant.model, allowed, exp.fallback == "cross_variant")


_pins: PerSnapshot[frozenset[str]] = PerSnapshot()


def _pinned(snap: Snapshot, info: ExperimentInfo, index: int, allowed: frozenset[str] | None) -> frozenset[str]:
    """The backends an arm with a pin may use: its pin, inside the key's allow-list."""
    key = (info.index, index, allowed)
    found = _pins.find(snap, key)
    if found is None:
        pin = frozenset(info.config.variants[index].backends or ())
        found = _pins.keep(key, pin if allowed is None else allowed & pin)
    return found


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
    # backend, client_model, upstream_model, body, path, set_headers, remove_headers, plan
    return Route(chosen, client_model, upstream, new_body, new_path, set_headers, remove_headers, plan)


def _hop_path(route: Route, req: Request) -> str:
    """The request's path without its backend's base path: a hop puts its own in front."""
    path = route.path if route.path is not None else req.path
    base = route.backend.base_path
    return path[len(base):] if base and path.startswith(base) else path

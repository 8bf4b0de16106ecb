"""The routing decision: request + config snapshot -> route or refusal.

Pure: no I/O, no clocks, no global state. The request path is a sequence of
named stages: parse -> aliases and suffix -> key gate -> reservation ->
experiment -> selection (over the fallback chain) -> plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .. import errors
from ..assignment import is_blank
from ..body import BodyError, replace_field, replace_query_model, set_top_level
from ..errors import Reply
from ..snapshot import BackendInfo, Snapshot
from . import selection
from .context import Parsed, Request, parse, sticky_value
from .route import Fallback, ResponsePlan, Route, upstream_auth
from .suffixes import SUFFIXES, Suffix, split, supported

Edits = dict[str, Any]  # top-level body fields to set


@dataclass(slots=True)
class _Target:
    """What the experiment stage leaves for selection."""

    model: str  # the model to dispatch first
    allowed: set[str] | None  # backends the request may use (key allow-list, arm pin)
    may_fall_back: bool  # walk the model's fallback chain when it has no admissible backend


def decide(snap: Snapshot, req: Request) -> Route | Reply:
    family = req.ingress.family
    try:
        parsed = parse(req)
    except BodyError as exc:
        return errors.error(exc.kind, str(exc), family, param=exc.param)
    requested, client_model, word = _names(snap, req, parsed.model)
    refusal = _key_gate(req, client_model, requested) or _reservation(snap, client_model, parsed.model, family)
    if refusal is not None:
        return refusal
    plan = ResponsePlan(family=family, kind="routed" if req.ingress.counted else "count_tokens")
    target = _experiment(snap, req, parsed, client_model, requested, plan)
    if isinstance(target, Reply):
        return _attributed(target, plan)
    chosen = _select(snap, req, parsed, target, requested, word, plan)
    if isinstance(chosen, Reply):
        return _attributed(chosen, plan)
    return _build(snap, req, parsed, client_model, plan, *chosen)


def _attributed(reply: Reply, plan: ResponsePlan) -> Reply:
    """A refusal after an arm was chosen still counts on that arm."""
    return replace(reply, meta=tuple(plan.metadata().items()))


def _names(snap: Snapshot, req: Request, sent: str) -> tuple[str, str, str | None]:
    """model_aliases (on the ingresses that honour them), then a variant suffix
    (on those that read them; the exact name wins): (requested, base, suffix)."""
    requested = snap.aliases.get(sent, sent) if req.ingress.aliases else sent
    if req.ingress.suffixes and snap.config.proxy.variant_suffixes.enabled:
        base, word = split(snap, requested)
        return requested, base, word
    return requested, requested, None


def _key_gate(req: Request, client_model: str, requested: str) -> Reply | None:
    """The per-key model gate judges the client-facing (base) name."""
    key = req.caller.key
    if key is not None and key.allowed_models is not None and client_model not in key.allowed_models:
        return errors.model_not_permitted(requested, req.ingress.family)
    return None


def _reservation(snap: Snapshot, client_model: str, sent: str, family: str) -> Reply | None:
    """A reserved variant model named outside its experiment is answered
    exactly like a model the router does not have."""
    reserving = reserved_by(snap, client_model)
    return errors.model_not_found(sent, family, reserved_by=reserving) if reserving is not None else None


def _experiment(
    snap: Snapshot, req: Request, parsed: Parsed, client_model: str, requested: str, plan: ResponsePlan,
) -> _Target | Reply:
    """The experiment picks an arm; its pin narrows the key's backend allow-list."""
    key = req.caller.key
    allowed = set(key.allowed_backends) if key is not None and key.allowed_backends is not None else None
    info = snap.experiments.get(client_model) if req.ingress.experiments else None
    if info is None:
        return _Target(client_model, allowed, may_fall_back=True)
    exp = info.config
    sticky = sticky_value(exp, req, parsed)
    variant = exp.variants[info.race.pick(info.prefix, sticky, exp.sticky_ttl, req.now, req.random_bytes)]
    plan.experiment, plan.variant = exp.name, variant.id
    plan.assignment = "random" if is_blank(sticky) else "sticky"
    plan.attribute = exp.response_headers
    plan.rewrite_model = client_model if exp.response_model == "client" else None
    plan.read_usage = req.ingress.usage
    if variant.backends is not None:
        allowed = set(variant.backends) if allowed is None else allowed & set(variant.backends)
        if not allowed:
            return errors.model_not_permitted(requested, req.ingress.family)
    return _Target(variant.model, allowed, may_fall_back=exp.fallback == "cross_variant")


def _candidates(snap: Snapshot, name: str, allowed: set[str] | None) -> tuple[str, list[BackendInfo]]:
    """Metadata alias dispatch, then the backends that serve the model and that
    the request may use: (the id to dispatch, those backends)."""
    model, serving = snap.resolve(name)
    return model, [
        snap.backends[n] for n in serving if not snap.backends[n].internal and (allowed is None or n in allowed)
    ]


def _select(
    snap: Snapshot, req: Request, parsed: Parsed, target: _Target, requested: str, word: str | None,
    plan: ResponsePlan,
) -> tuple[str, BackendInfo, Edits] | Reply:
    """The first attempt, then the hops of the fallback chain: (model, backend, body edits)."""
    family = req.ingress.family
    model, candidates = _candidates(snap, target.model, target.allowed)
    if not candidates:
        if any(not snap.backends[n].internal for n in snap.resolve(target.model)[1]):
            return errors.model_not_permitted(requested, family)
        return errors.model_not_found(requested, family)
    suffix = SUFFIXES[word] if word is not None else None
    data = parsed.json or {}
    edits: Edits = {}
    if suffix is not None:
        checked = _suffix_checks(snap, model, candidates, suffix, data, requested, word or "", family)
        if isinstance(checked, Reply):
            return checked
        candidates, edits = checked
        plan.suffix, plan.rewrite_model = word, requested
    ctx = selection.Context(snap, req.states, req.mono, req.pick, req.rand)
    ranker = suffix.ranker if suffix is not None else None
    first = selection.select(ctx, selection.Attempt(model, candidates, ranker, req.headers.get("x-backend"), data))
    if first is not None:
        plan.suffix_applied = first.ranked or ranker is None
        return model, first.backend, edits
    if target.may_fall_back and not (suffix is not None and suffix.online):
        for hop in fallback_hops(snap, target.model, model):
            hop_model, hop_candidates = _candidates(snap, hop, target.allowed)
            chosen = selection.select(ctx, selection.Attempt(hop_model, hop_candidates, body=data)) if hop_candidates else None
            if chosen is not None:
                # A hop dispatches another model: it inherits no suffix.
                plan.suffix_applied = suffix is None
                plan.fallback = Fallback(target.model, hop_model, "no_admissible_backend", hop_model not in snap.reserved)
                return hop_model, chosen.backend, {}
    return errors.error("no_backend", f"No healthy backend can serve the model '{requested}' right now.", family)


def fallback_hops(snap: Snapshot, origin: str, dispatched: str) -> list[str]:
    """The chain of ``origin`` (or of the id it dispatches as). A chain whose
    origin is not reserved skips reserved hops, so ordinary routing never
    reaches a hidden arm's model."""
    chains = snap.config.fallback_chains
    chain = chains.get(origin) or chains.get(dispatched) or []
    if origin in snap.reserved or dispatched in snap.reserved:
        return list(chain)
    return [hop for hop in chain if reserved_by(snap, hop) is None]


def _suffix_checks(
    snap: Snapshot, model: str, candidates: list[BackendInfo], suffix: Suffix, data: Edits, requested: str,
    word: str, family: str,
) -> tuple[list[BackendInfo], Edits] | Reply:
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
        candidates = [b for b in candidates if not b.config.commercial and b.family == "openai"]
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
    set_headers, remove_headers = upstream_auth(snap, chosen)
    return Route(
        backend=chosen, client_model=client_model, upstream_model=upstream, body=new_body, path=new_path,
        set_headers=set_headers, remove_headers=remove_headers, plan=plan,
    )


def _unsupported(requested: str, word: str, family: str) -> Reply:
    return errors.error(
        "unsupported_model_variant",
        f"The model '{requested}' is not available: the ':{word}' variant is not supported for this model.",
        family, param="model",
    )


def reserved_by(snap: Snapshot, name: str) -> str | None:
    """The hidden experiment that reserves ``name`` under any reading the
    router or an engine may give it: as sent, through ``model_aliases``, or
    as the base of a suffixed name."""
    for candidate in (name, snap.aliases.get(name, name)):
        exp = snap.reserved.get(candidate) or snap.reserved.get(candidate.rpartition(":")[0])
        if exp is not None:
            return exp
    return None

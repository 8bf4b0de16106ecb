"""The routing decision: request context + config snapshot -> route or refusal.

Pure: no I/O, no clocks, no global state. The gRPC adapter supplies the time,
a round-robin counter and a random source, so every decision is reproducible
in a unit test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from . import errors, variants
from .assignment import is_blank
from .body import (
    BodyError, check_model_name, multipart_model, parse_json, query_model, replace_field, replace_query_model,
    set_top_level,
)
from .config import ApiKey
from .errors import Reply
from .ingress import Ingress
from .snapshot import BackendInfo, Snapshot


@dataclass(frozen=True)
class Caller:
    """Who is calling: the presented key (if any) and its config entry."""

    api_key: str | None
    key: ApiKey | None


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    if key and key.strip():
        return key.strip()
    return None


def authenticate(snap: Snapshot, headers: Mapping[str, str], family: str) -> Caller | Reply:
    """The key gate; with no ``api_keys`` section every caller is admitted."""
    key = presented_key(headers)
    if snap.keys is None:
        return Caller(key, None)
    if key is None:
        return errors.error("unauthorized", "An API key is required (Authorization: Bearer or x-api-key).", family)
    entry = snap.keys.get(key)
    if entry is None:
        return errors.error("unauthorized", "The API key is not valid.", family)
    return Caller(key, entry)


@dataclass(slots=True)
class Request:
    ingress: Ingress
    path: str
    headers: Mapping[str, str]
    body: bytes
    caller: Caller
    now: float = 0.0
    pick: int = 0  # round-robin counter
    rand: float = 0.0  # uniform in [0, 1)
    random_bytes: Callable[[int], bytes] = os.urandom
    states: Mapping[str, object] = field(default_factory=dict)  # backend -> monitor state
    mono: float = 0.0  # monotonic clock, the monitor's time base


Meta = dict[str, "str | bool"]


@dataclass(slots=True)
class ResponsePlan:
    """What a routed request's answer carries: its attribution, published to
    Envoy as dynamic metadata, and what (if anything) must change in it."""

    family: str
    kind: str = "routed"  # routed | count_tokens (counted for tokens only)
    rewrite_model: str | None = None  # top-level model to write into the response
    read_usage: bool = False  # the response's token usage is counted
    strip_injected_usage: bool = False
    experiment: str | None = None
    variant: str | None = None
    assignment: str | None = None  # "sticky" | "random"
    attribute: bool = False  # send x-continuum-experiment[-variant]
    suffix: str | None = None  # nitro | floor | thinking | online
    suffix_applied: bool = True

    @property
    def needs_response(self) -> bool:
        """Whether the response body itself must change (the only reason the
        sidecar sees a response)."""
        return self.rewrite_model is not None or self.strip_injected_usage

    def metadata(self) -> Meta:
        """The decision as Envoy dynamic metadata: read back by the access log
        (metrics, usage records), by the route's response headers (``x_*``
        keys) and by the response processor."""
        m: Meta = {"kind": self.kind, "family": self.family}
        if self.experiment is not None:
            m.update(experiment=self.experiment, variant=self.variant or "", assignment=self.assignment or "")
            if self.attribute:
                m.update(x_experiment=self.experiment, x_experiment_variant=self.variant or "")
        if self.suffix is not None:
            m.update(suffix=self.suffix, suffix_applied=self.suffix_applied, x_model_variant=self.suffix)
            if not self.suffix_applied:
                m["x_model_variant_applied"] = "false"
        if self.needs_response:
            m.update(rewrite_model=self.rewrite_model or "", strip_usage=self.strip_injected_usage)
        return m


@dataclass(slots=True)
class Route:
    backend: BackendInfo
    client_model: str
    upstream_model: str
    body: bytes | None = None  # replacement request body, None = unchanged
    path: str | None = None  # replacement :path, None = unchanged
    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    plan: ResponsePlan | None = None

    def metadata(self) -> Meta:
        m: Meta = self.plan.metadata() if self.plan is not None else {"kind": "passthrough"}
        m["backend"] = self.backend.name
        if self.client_model:
            m.update(client_model=self.client_model, upstream_model=self.upstream_model)
        return m


@dataclass
class _Parsed:
    model: str
    json: dict | None = None
    form_field: object | None = None
    edits: dict = field(default_factory=dict)


def _parse(req: Request) -> _Parsed:
    kind = req.ingress.body
    if kind == "json":
        data = parse_json(req.body)
        if "model" not in data:
            raise BodyError("missing_model", "The request body has no 'model' field.")
        return _Parsed(check_model_name(data["model"]), json=data)
    if kind == "multipart":
        model, f = multipart_model(req.body, req.headers.get("content-type", ""))
        return _Parsed(model, form_field=f)
    model = query_model(req.path)
    if model is None:
        raise BodyError("missing_model", "The 'model' query parameter is required.")
    return _Parsed(check_model_name(model))


def _sticky_value(exp, req: Request, parsed: _Parsed) -> str | None:
    key = exp.sticky_key
    if key == "api_key":
        return req.caller.api_key
    if key == "user":
        data = parsed.json or {}
        if req.ingress.family == "anthropic":
            meta = data.get("metadata")
            value = meta.get("user_id") if isinstance(meta, dict) else None
        else:
            value = data.get("user")
        return value if isinstance(value, str) else None
    if key == "none":
        return None
    return req.headers.get(exp.sticky_header)


def _pick(snap: Snapshot, candidates: list[BackendInfo], req: Request) -> BackendInfo:
    if len(candidates) == 1:
        return candidates[0]
    strategy = snap.config.proxy.selection
    if strategy == "random":
        return candidates[min(int(req.rand * len(candidates)), len(candidates) - 1)]
    if strategy == "weighted":
        total = sum(b.weight for b in candidates)
        x = req.rand * total
        for b in candidates:
            x -= b.weight
            if x < 0:
                return b
        return candidates[-1]
    return candidates[req.pick % len(candidates)]


def decide(snap: Snapshot, req: Request) -> Route | Reply:
    ingress = req.ingress
    family = ingress.family
    try:
        parsed = _parse(req)
    except BodyError as exc:
        return errors.error(exc.kind, str(exc), family, param=exc.param)

    # 1. model_aliases, on the ingresses that honour them; then a variant
    #    suffix, on the ingresses that read them (the exact name wins).
    requested = parsed.model
    if ingress.aliases:
        requested = snap.aliases.get(requested, requested)
    client_model, word = requested, None
    if ingress.suffixes and snap.config.proxy.variant_suffixes.enabled:
        client_model, word = variants.split(snap, requested)

    # 2. The per-key model gate judges the client-facing (base) name.
    key = req.caller.key
    if key is not None and key.allowed_models is not None and client_model not in key.allowed_models:
        return errors.model_not_permitted(requested, family)

    # A reserved variant model named outside its experiment is answered exactly
    # like a model the router does not have.
    reserving = reserved_by(snap, client_model)
    if reserving is not None:
        return errors.model_not_found(parsed.model, family, reserved_by=reserving)

    # 3. The experiment picks a variant.
    allowed: set[str] | None = set(key.allowed_backends) if key is not None and key.allowed_backends is not None else None
    upstream = client_model
    plan = ResponsePlan(family=family, kind="routed" if ingress.counted else "count_tokens")

    def attributed(reply: Reply) -> Reply:
        """A refusal after an arm was chosen still counts on that arm."""
        return replace(reply, meta=tuple(plan.metadata().items()))

    exp_info = snap.experiments.get(client_model) if ingress.experiments else None
    if exp_info is not None:
        exp = exp_info.config
        sticky = _sticky_value(exp, req, parsed)
        index = exp_info.race.pick(exp_info.prefix, sticky, exp.sticky_ttl, req.now, req.random_bytes)
        variant = exp.variants[index]
        upstream = variant.model
        if variant.backends is not None:
            pin = set(variant.backends)
            allowed = pin if allowed is None else allowed & pin
        plan.experiment, plan.variant = exp.name, variant.id
        plan.assignment = "random" if is_blank(sticky) else "sticky"
        plan.attribute = exp.response_headers
        plan.rewrite_model = client_model if exp.response_model == "client" else None
        plan.read_usage = ingress.usage
        if variant.backends is not None and not allowed:
            return attributed(errors.model_not_permitted(requested, family))

    # 4. Metadata alias dispatch, then the backends that may serve it.
    upstream, serving = snap.resolve(upstream)
    candidates = [
        snap.backends[name] for name in serving
        if not snap.backends[name].internal and (allowed is None or name in allowed)
    ]
    if not candidates:
        if serving and any(not snap.backends[n].internal for n in serving):
            return attributed(errors.model_not_permitted(requested, family))
        return attributed(errors.model_not_found(requested, family))

    # 5. Variant checks that can refuse, before anything is chosen.
    edits: dict = {}
    data = parsed.json or {}
    if word == "thinking":
        meta = snap.meta(upstream)
        if meta is None or not meta.supports_thinking:
            return attributed(_unsupported(requested, word, family))
        if "reasoning_effort" not in data:
            edits["reasoning_effort"] = "high"
    elif word == "online":
        # The router runs the search loop itself: buffered only, and only on
        # backends it may add a tool to.
        ws = snap.config.web_search
        if ws is None or not ws.enabled or data.get("stream") is True:
            return attributed(_unsupported(requested, word, family))
        candidates = [b for b in candidates if not b.config.commercial and b.family == "openai"]
        if not candidates:
            return attributed(_unsupported(requested, word, family))

    # 6. Health and saturation first; a preference only narrows what is left.
    mon = snap.config.monitor
    admitted = [
        b for b in candidates
        if variants.admissible(req.states.get(b.name), req.mono, mon.freshness_s, mon.max_waiting)
    ]
    if not admitted:
        # Every candidate is held out after a failure: rather than refuse all
        # traffic, use those that are otherwise healthy and unsaturated.
        admitted = [
            b for b in candidates
            if variants.admissible(req.states.get(b.name), req.mono, mon.freshness_s, mon.max_waiting, holdout=False)
        ]
    candidates = admitted
    if not candidates:
        return attributed(
            errors.error("no_backend", f"No healthy backend can serve the model '{requested}' right now.", family)
        )
    applied = True
    preferred = req.headers.get("x-backend")
    chosen = next((b for b in candidates if b.name == preferred), None) if preferred else None
    if chosen is not None:
        applied = word not in variants.RANKED
    else:
        if word in variants.RANKED:
            candidates, applied = variants.narrow(word, snap, upstream, candidates, req.states, req.mono, data)
        chosen = _pick(snap, candidates, req)
    if word is not None:
        plan.suffix, plan.suffix_applied, plan.rewrite_model = word, applied, requested

    # 7. Request rewrites.
    new_body: bytes | None = None
    new_path: str | None = None
    if parsed.json is not None:
        streaming = data.get("stream") is True
        if data["model"] != upstream:
            edits["model"] = upstream
        if (
            plan.read_usage and streaming and family == "openai"
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

    upstream_path = chosen.base_path + ingress.upstream_path
    query = req.path.partition("?")[2] if new_path is None else new_path.partition("?")[2]
    target = upstream_path + ("?" + query if query else "")
    if target != req.path:
        new_path = target

    set_headers, remove_headers = upstream_auth(snap, chosen)
    return Route(
        backend=chosen, client_model=client_model, upstream_model=upstream, body=new_body, path=new_path,
        set_headers=set_headers, remove_headers=remove_headers,
        plan=plan,
    )


def _unsupported(requested: str, word: str, family: str) -> Reply:
    return errors.error(
        "unsupported_model_variant",
        f"The model '{requested}' is not available: the ':{word}' variant is not supported for this model.",
        family, param="model",
    )


def upstream_auth(snap: Snapshot, backend: BackendInfo) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Credentials toward the backend; a router key never travels upstream."""
    if backend.api_key:
        if backend.family == "anthropic":
            return (("x-api-key", backend.api_key),), ("authorization",)
        return (("authorization", f"Bearer {backend.api_key}"),), ("x-api-key",)
    if snap.keys is not None:
        return (), ("authorization", "x-api-key")
    return (), ()


def reserved_by(snap: Snapshot, name: str) -> str | None:
    """The hidden experiment that reserves ``name`` under any reading the
    router or an engine may give it: as sent, through ``model_aliases``, or
    as the base of a suffixed name."""
    for candidate in (name, snap.aliases.get(name, name)):
        exp = snap.reserved.get(candidate) or snap.reserved.get(candidate.rpartition(":")[0])
        if exp is not None:
            return exp
    return None


def passthrough(snap: Snapshot, path: str, caller: Caller, family: str, models: list[str]) -> Route | Reply:
    """A path outside the ingress table: refused unless ``proxy.passthrough_backend``
    is set, and then sent there untouched, after the gates a model endpoint has.

    A key limited to some models or backends may not use it: the router
    cannot tell which model such a request reaches. A model the request names
    (``models``, read from its query and body) that an experiment reserves is
    refused exactly like an unknown model.
    """
    if snap.passthrough_backend is None:
        return errors.error(
            "unknown_endpoint", f"The path '{path.partition('?')[0]}' is not served by this router.", family
        )
    key = caller.key
    if key is not None and (key.allowed_models is not None or key.allowed_backends is not None):
        return errors.error("model_not_permitted", "This API key may only use the model endpoints.", family)
    for model in models:
        exp = reserved_by(snap, model)
        if exp is not None:
            return errors.model_not_found(model, family, reserved_by=exp)
    backend = snap.backends[snap.passthrough_backend]
    set_headers, remove_headers = upstream_auth(snap, backend)
    new_path = backend.base_path + path if backend.base_path else None
    return Route(backend, "", "", path=new_path, set_headers=set_headers, remove_headers=remove_headers)

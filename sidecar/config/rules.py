"""The config's cross-field rules: what one field cannot judge alone.

``check`` returns every error and warning with its field path; ``config.parse``
runs it after the models have validated each field.
"""

from __future__ import annotations

from . import address
from .schema import NAME_RE, Backend, Config, Experiment, ShadowArm


def check(config: Config) -> tuple[list[str], list[str]]:
    """Cross-field rules; returns (errors, warnings) with field paths."""
    errors: list[str] = []
    warnings: list[str] = []
    backends = _check_backends(config, errors)
    _check_failure_mode(config, errors)
    _check_request_timeout(config, errors)
    _check_passthrough(config, backends, errors)
    _check_keys(config, backends, errors)
    _check_names(config, backends, errors)
    exp_models = _check_experiment_names(config, errors)
    for i, e in enumerate(config.model_experiments):
        _check_variants(i, e, backends, exp_models, errors, warnings)
        _check_shadows(i, e, backends, exp_models, errors)
    reserved = _check_reserved(config, warnings)
    _check_chains(config, reserved, errors, warnings)
    _check_cache(config, errors)
    _check_limits(config, errors, warnings)
    return errors, warnings


def _check_backends(config: Config, errors: list[str]) -> dict[str, Backend]:
    backends = {}
    for i, b in enumerate(config.backends):
        if b.name in backends:
            errors.append(f"backends[{i}].name: duplicate backend name '{b.name}'")
        backends[b.name] = b
    return backends


def _check_failure_mode(config: Config, errors: list[str]) -> None:
    if config.server.failure_mode == "open":
        guarded = (["api_keys (key gates would be skipped)"] if config.api_keys is not None else []) + [
            f"model_experiments '{e.name}' hides its variant models (they would be reachable by name)"
            for e in config.model_experiments if e.hide_variant_models
        ]
        if guarded:
            errors.append("server.failure_mode: 'open' lets requests past the router when it cannot be reached, "
                          "which this config forbids: " + "; ".join(guarded))


def _check_request_timeout(config: Config, errors: list[str]) -> None:
    """Envoy's request timeout also covers the decision, and the :online loop
    answers within the decision: the timeout must leave it room."""
    bound = config.envoy.request_timeout_s
    if not bound or config.web_search is None or not config.proxy.variant_suffixes.enabled:
        return
    loop = config.web_search.deadline_s + 5
    if bound <= loop:
        errors.append(f"envoy.request_timeout_s: {bound} s would cut the ':online' loop short "
                      f"(web_search.deadline_s + 5 = {loop:g} s); raise it or set 0")


def _check_passthrough(config: Config, backends: dict[str, Backend], errors: list[str]) -> None:
    passthrough = config.proxy.passthrough_backend
    if passthrough is not None:
        b = backends.get(passthrough)
        if b is None:
            errors.append(f"proxy.passthrough_backend: unknown backend '{passthrough}'")
        elif not b.enabled:
            errors.append(f"proxy.passthrough_backend: backend '{passthrough}' is disabled")


def _check_keys(config: Config, backends: dict[str, Backend], errors: list[str]) -> None:
    if config.api_keys is not None:
        seen_keys: dict[str, int] = {}
        seen_ids: dict[str, int] = {}
        for i, k in enumerate(config.api_keys):
            if k.key in seen_keys:
                errors.append(f"api_keys[{i}].key: duplicate key (also api_keys[{seen_keys[k.key]}])")
            seen_keys.setdefault(k.key, i)
            if k.id in seen_ids:
                errors.append(f"api_keys[{i}].id: duplicate id '{k.id}'")
            seen_ids.setdefault(k.id, i)
            for j, name in enumerate(k.allowed_backends or []):
                if name not in backends:
                    errors.append(f"api_keys[{i}].allowed_backends[{j}]: unknown backend '{name}'")


def _check_names(config: Config, backends: dict[str, Backend], errors: list[str]) -> None:
    """Aliases and model metadata: no self-aliases, no name declared twice."""
    for alias, target in config.model_aliases.items():
        if alias == target:
            errors.append(f"model_aliases.{alias}: an alias cannot point at itself")

    meta_names: dict[str, str] = {}
    for i, m in enumerate(config.model_metadata):
        for j, name in enumerate([m.id, *m.aliases]):
            where = f"model_metadata[{i}].id" if j == 0 else f"model_metadata[{i}].aliases[{j - 1}]"
            if name in meta_names:
                errors.append(f"{where}: '{name}' is already declared by {meta_names[name]}")
            else:
                meta_names[name] = where
        for name in m.backend_pricing:
            if name not in backends:
                errors.append(f"model_metadata[{i}].backend_pricing.{name}: unknown backend '{name}'")


def _check_experiment_names(config: Config, errors: list[str]) -> dict[str, int]:
    """Unique experiment names and client models; returns client model -> index."""
    exp_names: dict[str, int] = {}
    exp_models: dict[str, int] = {}
    for i, e in enumerate(config.model_experiments):
        p = f"model_experiments[{i}]"
        if e.name in exp_names:
            errors.append(f"{p}.name: duplicate experiment name '{e.name}'")
        exp_names.setdefault(e.name, i)
        if e.model in exp_models:
            errors.append(f"{p}.model: client model '{e.model}' is already used by model_experiments[{exp_models[e.model]}]")
        exp_models.setdefault(e.model, i)
    return exp_models


def _check_variants(
    i: int, e: Experiment, backends: dict[str, Backend], exp_models: dict[str, int],
    errors: list[str], warnings: list[str],
) -> None:
    p = f"model_experiments[{i}]"
    if not e.variants:
        errors.append(f"{p}.variants: at least one variant is required")
    elif all(v.weight == 0 for v in e.variants):
        errors.append(f"{p}.variants: at least one variant needs a weight above 0")
    elif all(v.race_weight == 0 for v in e.variants):
        errors.append(f"{p}.variants: every variant with a weight above 0 is paused; one must stay in the race")
    ids: set[str] = set()
    for j, v in enumerate(e.variants):
        vp = f"{p}.variants[{j}]"
        if v.id in ids:
            errors.append(f"{vp}.id: duplicate variant id '{v.id}'")
        ids.add(v.id)
        if v.model in exp_models:
            errors.append(f"{vp}.model: '{v.model}' is the client model of another experiment; experiments cannot chain")
        if e.hide_variant_models and v.model == e.model:
            errors.append(f"{vp}.model: a hidden experiment cannot use its own client model '{e.model}' as a variant")
        if v.backends is not None:
            if not v.backends:
                errors.append(f"{vp}.backends: an empty pin admits no backend")
            pinned = []
            for k, name in enumerate(v.backends):
                b = backends.get(name)
                if b is None:
                    errors.append(f"{vp}.backends[{k}]: unknown backend '{name}'")
                elif b.internal:
                    errors.append(f"{vp}.backends[{k}]: backend '{name}' is internal and cannot be pinned")
                else:
                    pinned.append(b)
            if pinned and len(pinned) == len(v.backends) and all(b.models is not None for b in pinned):
                if not any(v.model in (b.models or ()) for b in pinned):
                    errors.append(f"{vp}.model: none of the pinned backends lists '{v.model}'")
    if e.sticky_key == "none" and e.sticky_ttl is not None:
        warnings.append(f"{p}.sticky_ttl: has no effect with sticky_key: none")


def _check_shadows(
    i: int, e: Experiment, backends: dict[str, Backend], exp_models: dict[str, int], errors: list[str],
) -> None:
    """A shadow arm: one per experiment (Envoy sends one copy per request), an
    id of its own, and exactly one backend its copies can go to."""
    p = f"model_experiments[{i}].variants"
    if len(e.shadows) > 1:
        errors.append(f"{p}: at most one shadow arm per experiment ('{e.shadows[1].id}' is a second)")
    live = {v.id for v in e.variants}
    for v in e.shadows:
        vp = f"{p}[id={v.id}]"  # the shadow arm, by id: its list position is the live arms' list
        if v.id in live:
            errors.append(f"{vp}.id: duplicate variant id '{v.id}'")
        if v.model in exp_models:
            errors.append(f"{vp}.model: '{v.model}' is the client model of another experiment; experiments cannot chain")
        if v.backends is not None:
            if len(v.backends) != 1:
                errors.append(f"{vp}.backends: a shadow arm's copies go to one backend; pin exactly one")
                continue
            b = backends.get(v.backends[0])
            if b is None:
                errors.append(f"{vp}.backends[0]: unknown backend '{v.backends[0]}'")
            elif b.internal:
                errors.append(f"{vp}.backends[0]: backend '{b.name}' is internal and cannot be pinned")
            elif b.models is not None and v.model not in b.models:
                errors.append(f"{vp}.model: the pinned backend '{b.name}' does not list '{v.model}'")
        elif not any(b.enabled and not b.internal and b.models is not None and v.model in b.models
                     for b in backends.values()):
            errors.append(f"{vp}.backends: no backend lists '{v.model}'; pin the backend its copies go to")
        _check_shadow_path(vp, e, v, backends, errors)


def _check_shadow_path(
    vp: str, e: Experiment, arm: ShadowArm, backends: dict[str, Backend], errors: list[str],
) -> None:
    """A copy keeps the live request's path, base path included: the shadow's
    backend must sit under the same base path as the live arms' backends."""
    def base(b: Backend) -> str:
        return "" if b.url == "demo://" else address.split_url(b.url)[3]

    pin = arm.backends[0] if arm.backends else None
    target = backends.get(pin) if pin else next(
        (b for b in backends.values() if b.enabled and not b.internal and b.models is not None and arm.model in b.models),
        None)
    if target is None:
        return
    live = {b.name: base(b) for v in e.variants for b in backends.values()
            if (b.name in v.backends if v.backends else b.models is not None and v.model in b.models)}
    other = sorted(name for name, path in live.items() if path != base(target))
    if other:
        errors.append(f"{vp}.backends: backend '{target.name}' has the base path '{base(target)}' but the live "
                      f"arms' backend '{other[0]}' has '{live[other[0]]}'; a copy keeps the live request's path")


def _check_reserved(config: Config, warnings: list[str]) -> dict[str, str]:
    """Reserved (hidden) variant models, and the warnings where they stay reachable."""
    reserved = {v.model: e.name for e in config.model_experiments if e.hide_variant_models
                for v in e.arms()}
    for alias, target in config.model_aliases.items():
        if target in reserved:
            warnings.append(
                f"model_aliases.{alias}: points at '{target}', a model reserved by experiment '{reserved[target]}'"
            )
    for i, e in enumerate(config.model_experiments):
        if e.hide_variant_models:
            continue
        for j, v in enumerate(e.variants):
            if v.model in reserved:
                warnings.append(
                    f"model_experiments[{i}].variants[{j}].model: '{v.model}' is reserved by experiment "
                    f"'{reserved[v.model]}' but stays reachable through this experiment, which does not hide its variants"
                )
    return reserved


def _check_cache(config: Config, errors: list[str]) -> None:
    cache = config.cache
    if cache is None:
        return
    if cache.store == "redis" and config.redis is None:
        errors.append("cache.store: 'redis' needs the top-level redis section (redis.url)")
    names = {e.name for e in config.model_experiments}
    for i, name in enumerate(cache.experiments or []):
        if name not in names:
            errors.append(f"cache.experiments[{i}]: unknown experiment '{name}'")


def _check_limits(config: Config, errors: list[str], warnings: list[str]) -> None:
    key_ids = {k.id for k in config.api_keys or ()}
    models = {m for b in config.backends for m in b.models or ()} | {e.model for e in config.model_experiments}
    models |= set(config.model_aliases.values()) | {n for m in config.model_metadata for n in (m.id, *m.aliases)}
    all_declared = all(b.models is not None for b in config.backends if b.enabled)
    if config.redis is None and config.server.workers > 1 and any(lim.tokens for lim in config.limits):
        warnings.append(f"limits: each of the {config.server.workers} workers counts token budgets on its own "
                        "without a redis: section, so a budget can be spent up to once per worker")
    aliases = {a: m.id for m in config.model_metadata for a in m.aliases}
    seen: dict[tuple[str, str | None], int] = {}
    for i, lim in enumerate(config.limits):
        p = f"limits[{i}]"
        if (lim.model, lim.key_id) in seen:
            errors.append(f"{p}: a second limit for model '{lim.model}'"
                          + (f" and key id '{lim.key_id}'" if lim.key_id else "")
                          + f" (also limits[{seen[lim.model, lim.key_id]}])")
        seen.setdefault((lim.model, lim.key_id), i)
        if lim.shared and config.redis is None:
            errors.append(f"{p}.shared: a shared request rate is counted in Redis; add a redis: section")
        if lim.key_id is not None and lim.key_id not in key_ids:
            errors.append(f"{p}.key_id: unknown key id '{lim.key_id}' (no api_keys entry has it)")
        canonical = aliases.get(lim.model)
        if canonical is not None:
            errors.append(f"{p}.model: '{lim.model}' is a model_metadata alias of '{canonical}'; limits count "
                          f"every name of a model against its id, so name '{canonical}'")
        if all_declared and lim.model not in models:
            warnings.append(f"{p}.model: '{lim.model}' is not a model any backend, experiment or alias names")


def _check_chains(config: Config, reserved: dict[str, str], errors: list[str], warnings: list[str]) -> None:
    """fallback_chains: known models only, no self-loops, no cycles; a warning
    where an ordinary model's chain names a reserved model (it is skipped)."""
    chains = config.fallback_chains
    clients = {e.model for e in config.model_experiments}
    declared = {m for b in config.backends if b.models for m in b.models}
    declared |= {n for m in config.model_metadata for n in (m.id, *m.aliases)}
    all_declared = all(b.models is not None for b in config.backends if b.enabled)
    for origin, chain in chains.items():
        p = f"fallback_chains.{origin}" if NAME_RE.fullmatch(origin) else f"fallback_chains[{origin!r}]"
        if origin in clients:
            errors.append(f"{p}: '{origin}' is an experiment's client model; chains start at the models its variants dispatch")
        if not chain:
            errors.append(f"{p}: a chain needs at least one fallback model")
        seen: set[str] = set()
        for j, hop in enumerate(chain):
            hp = f"{p}[{j}]"
            if hop == origin:
                errors.append(f"{hp}: '{hop}' falls back to itself")
            elif hop in seen:
                errors.append(f"{hp}: '{hop}' is already in this chain")
            elif hop in clients:
                errors.append(f"{hp}: '{hop}' is an experiment's client model, not a model a backend serves")
            elif all_declared and hop not in declared:
                errors.append(f"{hp}: unknown model '{hop}' (no backend or model_metadata entry declares it)")
            elif hop in reserved and origin not in reserved:
                warnings.append(
                    f"{hp}: '{hop}' is reserved by experiment '{reserved[hop]}'; this chain's origin is not, "
                    "so the hop is skipped at run time"
                )
            seen.add(hop)
    cycle = _cycle(chains)
    if cycle:
        errors.append(f"fallback_chains: the chains form a cycle: {' -> '.join(cycle)}")


def _cycle(chains: dict[str, list[str]]) -> list[str] | None:
    """One cycle through the chains (origin -> hop edges), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in chains.get(node, ()):
            if nxt == node:
                continue  # reported as a self-loop
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for origin in chains:
        if origin not in state and (found := visit(origin)):
            return found
    return None

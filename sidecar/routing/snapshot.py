"""An immutable, request-ready view of one configuration.

Built once per config load (and again when a backend's discovered model list
changes); the request path only reads dictionaries from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..config import address
from ..config import limits as limit_rules
from ..config.limits import Rule
from ..config.schema import ApiKey, Backend, Config, Experiment, ModelMetadata
from ..contract import ADMIN_TOKEN_HEADER as ADMIN_TOKEN_HEADER
from ..contract import ATTRIBUTION_HEADERS as ATTRIBUTION_HEADERS
from ..contract import BACKEND_HEADER as BACKEND_HEADER
from ..contract import CACHE_HEADER as CACHE_HEADER
from ..contract import CLIENT_ROUTER_HEADERS as CLIENT_ROUTER_HEADERS
from ..contract import EXPLAIN_HEADER as EXPLAIN_HEADER
from ..contract import ROUTER_HEADER_PREFIXES as ROUTER_HEADER_PREFIXES
from ..payload import response_ids
from .assignment import Race, salt_prefix


@dataclass(frozen=True)
class BackendInfo:
    name: str
    url: str  # effective URL (demo:// replaced by the engine's address)
    family: str
    base_path: str  # prefix joined before the ingress's upstream path
    host: str
    port: int
    tls: bool
    api_key: str | None
    internal: bool
    weight: int
    config: Backend
    # Its engine answers with its own model name whatever the request named (llama.cpp, TGI).
    names_itself: bool = False


@dataclass(frozen=True)
class ExperimentInfo:
    index: int
    config: Experiment
    variants: tuple[tuple[str, int], ...]  # (id, weight), declared order
    race: Race  # the weighted race over those variants, built once
    prefix: bytes  # the experiment's hash salt, encoded once


@dataclass(frozen=True, eq=False)
class Snapshot:
    config: Config
    backends: Mapping[str, BackendInfo]
    keys: Mapping[str, ApiKey] | None  # None: every caller is admitted
    aliases: Mapping[str, str]
    experiments: Mapping[str, ExperimentInfo]  # by client-facing model
    served: Mapping[str, tuple[str, ...]]  # model -> backends serving it, config order
    passthrough_backend: str | None  # proxy.passthrough_backend
    discovered: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    metadata: Mapping[str, ModelMetadata] = field(default_factory=dict)  # canonical id -> entry
    meta_alias: Mapping[str, str] = field(default_factory=dict)  # metadata alias -> canonical id
    # Variant models of experiments that hide them, with every metadata alias
    # of those names and canonical id of those aliases -> experiment name.
    reserved: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)  # client-facing model -> its limits
    id_key: bytes = response_ids.PROCESS_KEY  # seals response ids (sidecar.payload.response_ids)
    max_body_bytes: int = field(init=False)  # server.max_body_bytes: every request reads it, twice

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_body_bytes", self.config.server.max_body_bytes)

    def resolve(self, name: str) -> tuple[str, tuple[str, ...]]:
        """The catalog's one answer: (the id to dispatch, the backends serving it).

        A name a backend serves literally wins; otherwise a metadata alias
        dispatches as its canonical id. Unserved: (name, ()).
        """
        backends = self.served.get(name)
        if backends:
            return name, backends
        canonical = self.meta_alias.get(name)
        if canonical is not None:
            backends = self.served.get(canonical)
            if backends:
                return canonical, backends
        return name, ()

    def meta(self, name: str) -> ModelMetadata | None:
        return self.metadata.get(self.meta_alias.get(name, name))


def _experiment(index: int, e: Experiment) -> ExperimentInfo:
    variants = e.race
    return ExperimentInfo(index, e, variants, Race(variants), salt_prefix(e.name))


def build(
    config: Config,
    url_overrides: Mapping[str, str] | None = None,
    discovered: Mapping[str, tuple[str, ...]] | None = None,
    id_key: bytes | None = None,
) -> Snapshot:
    overrides = url_overrides or {}
    discovered = dict(discovered or {})
    backends: dict[str, BackendInfo] = {}
    served: dict[str, list[str]] = {}
    for b in config.backends:
        url = overrides.get(b.name, b.url)
        host, port, tls, path = address.split_url(url) if url != "demo://" else ("", 0, False, "")
        backends[b.name] = BackendInfo(
            name=b.name, url=url, family=b.family, base_path=path, host=host, port=port, tls=tls,
            api_key=b.api_key, internal=b.internal, weight=b.weight, config=b,
            names_itself=b.engine is not None and not b.engine.echoes_model,
        )
        if not b.enabled:
            continue
        models = list(b.models or ())
        for m in discovered.get(b.name, ()):
            if m not in models:
                models.append(m)
        for m in models:
            served.setdefault(m, []).append(b.name)
    keys = None
    if config.api_keys is not None:
        keys = MappingProxyType({k.key: k for k in config.api_keys})
    experiments = {
        e.model: _experiment(i, e)
        for i, e in enumerate(config.model_experiments)
    }
    metadata = {m.id: m for m in config.model_metadata}
    meta_alias = {a: m.id for m in config.model_metadata for a in m.aliases}
    reserved: dict[str, str] = {}
    for e in config.model_experiments:
        if not e.hide_variant_models:
            continue
        for v in e.arms():
            canonical = meta_alias.get(v.model, v.model)
            names = {v.model, canonical}
            if canonical in metadata:
                names.update(metadata[canonical].aliases)
            for n in names:
                reserved.setdefault(n, e.name)
    return Snapshot(
        config=config,
        backends=MappingProxyType(backends),
        keys=keys,
        aliases=MappingProxyType(dict(config.model_aliases)),
        experiments=MappingProxyType(experiments),
        served=MappingProxyType({m: tuple(v) for m, v in served.items()}),
        passthrough_backend=config.proxy.passthrough_backend,
        discovered=MappingProxyType({k: tuple(v) for k, v in discovered.items()}),
        metadata=MappingProxyType(metadata),
        meta_alias=MappingProxyType(meta_alias),
        reserved=MappingProxyType(reserved),
        limits=limit_rules.index(config),
        id_key=id_key or response_ids.PROCESS_KEY,
    )

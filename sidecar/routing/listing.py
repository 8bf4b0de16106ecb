"""Model listings: what a caller may see, in each API family's shape.

The catalog is computed once per snapshot; listings filter it per key.
Operators see every entry (hidden ones included) through ``/admin/models``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import orjson

from .. import errors
from ..config.schema import ApiKey
from ..errors import Reply
from .ingress import family_for
from .snapshot import Snapshot
from .suffixes import SUFFIXES, split, supported

CREATED = 0  # listings carry no creation time; a fixed value keeps them stable
_ANTHROPIC_CREATED = "1970-01-01T00:00:00Z"


@dataclass(frozen=True)
class Entry:
    id: str
    backends: tuple[str, ...]
    experiment: str | None = None  # set when the id is an experiment's client-facing name
    hidden_by: str | None = None  # the experiment that hides and reserves this model
    canonical: str | None = None  # for a metadata alias: the id it dispatches as


@lru_cache(maxsize=8)
def catalog(snap: Snapshot) -> tuple[Entry, ...]:
    """Every model the router serves, hidden ones included, in a stable order."""
    entries: dict[str, Entry] = {}
    for model, names in snap.served.items():
        backends = tuple(n for n in names if not snap.backends[n].internal)
        if backends:
            entries[model] = Entry(model, backends, hidden_by=snap.reserved.get(model))
    for alias, canonical in snap.meta_alias.items():
        if alias not in entries and canonical in entries:
            base = entries[canonical]
            entries[alias] = Entry(alias, base.backends, hidden_by=snap.reserved.get(alias), canonical=canonical)
    for client_model, info in snap.experiments.items():
        union: list[str] = []
        for v in info.config.variants:
            if v.race_weight <= 0:
                continue
            _, serving = snap.resolve(v.model)
            for n in serving:
                if snap.backends[n].internal or (v.backends is not None and n not in v.backends):
                    continue
                if n not in union:
                    union.append(n)
        if union:
            entries[client_model] = Entry(client_model, tuple(union), experiment=info.config.name)
        else:
            entries.pop(client_model, None)
    return tuple(sorted(entries.values(), key=lambda e: e.id))


def visible(snap: Snapshot, key: ApiKey | None) -> list[Entry]:
    """The entries a caller may see: hidden models removed, per-key filters applied."""
    out = []
    for e in catalog(snap):
        if e.hidden_by is not None:
            continue
        if key is not None:
            if key.allowed_models is not None and e.id not in key.allowed_models:
                continue
            if key.allowed_backends is not None:
                backends = tuple(b for b in e.backends if b in key.allowed_backends)
                if not backends:
                    continue
                e = Entry(e.id, backends, e.experiment, e.hidden_by, e.canonical)
        out.append(e)
    return out


def _openai(e: Entry) -> dict[str, Any]:
    return {"id": e.id, "object": "model", "created": CREATED, "owned_by": "model-router"}


def _extended(snap: Snapshot, e: Entry) -> dict[str, Any]:
    d = _openai(e)
    d["backends"] = list(e.backends)
    if e.experiment:
        d["experiment"] = e.experiment
    meta = snap.meta(e.id)
    d["metadata"] = None if meta is None else meta.model_dump(mode="json", exclude_defaults=True)
    return d


def _anthropic(e: Entry) -> dict[str, Any]:
    return {"type": "model", "id": e.id, "display_name": e.id, "created_at": _ANTHROPIC_CREATED}


def _ok(payload: dict[str, Any]) -> Reply:
    return Reply(200, orjson.dumps(payload))


def answer(snap: Snapshot, p: str, method: str, key: ApiKey | None) -> Reply:
    """The listing reply for ``p``, a path as :func:`ingress.listing_path` spells it."""
    family = family_for(p)
    if method not in ("GET", "HEAD"):
        refusal = errors.error("method_not_allowed", f"{method} is not supported on {p}; use GET.", family)
        return replace(refusal, headers=(("allow", "GET, HEAD"),))
    entries = visible(snap, key)
    if p == "/v1/models" or p == "/v1/models/proxy":
        return _ok({"object": "list", "data": [_openai(e) for e in entries]})
    if p == "/v1/models/extended":
        return _ok({"object": "list", "data": [_extended(snap, e) for e in entries]})
    if p == "/anthropic/v1/models":
        data = [_anthropic(e) for e in entries]
        return _ok({
            "data": data, "has_more": False,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
        })
    prefix = "/anthropic/v1/models/" if family == "anthropic" else "/v1/models/"
    wanted = unquote(p[len(prefix):])
    entry = _entry(snap, entries, wanted)
    if entry is None:
        return errors.model_not_found(wanted, family)
    return _ok(_anthropic(entry) if family == "anthropic" else _openai(entry))


def _entry(snap: Snapshot, entries: list[Entry], wanted: str) -> Entry | None:
    """The listed model ``wanted`` names; a variant (``base:nitro``) that chat
    completions would serve answers as its base's entry under the name asked for."""
    by_id = {e.id: e for e in entries}
    if wanted in by_id:
        return by_id[wanted]
    if not snap.config.proxy.variant_suffixes.enabled:
        return None
    base, word = split(snap, wanted)
    entry = by_id.get(base)
    if word is None or entry is None or not supported(snap, snap.resolve(base)[0], SUFFIXES[word]):
        return None
    return replace(entry, id=wanted)


def admin_view(snap: Snapshot) -> dict[str, Any]:
    """Every model with its backends and, for hidden ones, why."""
    data = []
    for e in catalog(snap):
        d = _extended(snap, e)
        d["hidden"] = e.hidden_by is not None
        if e.hidden_by is not None:
            d["hidden_reason"] = f"variant model of experiment '{e.hidden_by}' (hide_variant_models: true)"
        if e.canonical:
            d["alias_of"] = e.canonical
        data.append(d)
    return {"object": "list", "data": data}

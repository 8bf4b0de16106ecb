"""Model variant suffixes (``model:nitro``, ``:floor``, ``:thinking``, ``:online``).

Pure functions: the grammar (exact name first, then one recognised trailing
word), backend admission from monitor state, and the :nitro / :floor
narrowing of candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .snapshot import BackendInfo, Snapshot

SUFFIXES = ("nitro", "floor", "thinking", "online")
RANKED = ("nitro", "floor")


def known(snap: Snapshot, name: str) -> bool:
    """Whether the router resolves ``name`` as it is (served, declared or an experiment)."""
    return (
        name in snap.experiments
        or bool(snap.resolve(name)[1])
        or name in snap.metadata
        or name in snap.meta_alias
        or name in snap.reserved
    )


def split(snap: Snapshot, name: str) -> tuple[str, str | None]:
    """(base, suffix) for a requested name; suffix None means the name stands as sent.

    The full name is tried first, so a model served literally as ``x:nitro``
    (or an Ollama ``name:tag``) keeps its own identity. Only a recognised word
    after the last ``:`` on a known base is a variant.
    """
    if known(snap, name):
        return name, None
    base, sep, word = name.rpartition(":")
    if sep and base and word in SUFFIXES and known(snap, base):
        return base, word
    return name, None


@dataclass(frozen=True)
class Load:
    """What the monitor currently knows about a backend, already freshness-checked."""

    throughput: float | None = None
    waiting: float | None = None


def admissible(state, now: float, freshness_s: float, max_waiting: int | None, holdout: bool = True) -> bool:
    """Healthy, not held out after a failure (unless ``holdout`` is False), and
    not saturated by a fresh snapshot."""
    if state is None:
        return True
    if not state.healthy or (holdout and state.held_out_until > now):
        return False
    if max_waiting is not None:
        load = fresh_load(state, now, freshness_s)
        if load.waiting is not None and load.waiting > max_waiting:
            return False
    return True


def fresh_load(state, now: float, freshness_s: float) -> Load:
    if state is None or state.scraped_at is None or now - state.scraped_at > freshness_s:
        return Load()
    return Load(state.throughput_tps, state.waiting)


def estimate_tokens(body: dict, default_output: int) -> tuple[int, int]:
    """(prompt, output) token estimates for pricing a request before it runs."""
    chars = 0
    for m in body.get("messages") or ():
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


def narrow(
    word: str,
    snap: Snapshot,
    model: str,
    candidates: Sequence[BackendInfo],
    states: Mapping[str, object],
    now: float,
    body: dict,
) -> tuple[list[BackendInfo], bool]:
    """Candidates kept by a :nitro / :floor preference, and whether it applied.

    With nothing rankable the set is returned whole and the preference is
    reported as not applied.
    """
    cfg = snap.config
    if word == "nitro":
        rated = []
        for b in candidates:
            tps = fresh_load(states.get(b.name), now, cfg.monitor.freshness_s).throughput
            if tps is not None:
                rated.append((tps, b))
        if not rated:
            return list(candidates), False
        best = max(t for t, _ in rated)
        return [b for t, b in rated if t == best], True
    meta = snap.meta(model)
    prompt, out = estimate_tokens(body, cfg.proxy.variant_suffixes.default_output_tokens)
    priced = []
    for b in candidates:
        price = meta.price_on(b.name) if meta is not None else None
        if price is not None:
            priced.append(((prompt * price.input + out * price.output, price.output), b))
    if not priced:
        return list(candidates), False
    best = min(k for k, _ in priced)
    return [b for k, b in priced if k == best], True

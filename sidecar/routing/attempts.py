"""Fallback after a failed first attempt: which hops a request may move to,
and the Envoy clusters that carry it there.

A decision that may fall back names, besides its backend, up to
``fallback_attempts`` further hops of the model's chain, each with the backend
its own selection picked (inside the pin and the key's allow-list, admissible
now). Envoy carries the request through them in one client request: the route
points at a *composite* cluster ``[backend, hop 1's backend, ...]`` whose n-th
attempt goes to its n-th cluster, and an upstream filter that Envoy skips on
the first attempt has the sidecar rewrite every later one for its hop
(``sidecar/handlers/hop_stream.py``). A first attempt therefore costs nothing extra.
The cluster names are a function of the config, shared by the decision and
the Envoy bootstrap.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .snapshot import Snapshot, build

T = TypeVar("T")
COMPOSITE_PREFIX = "fallback"  # followed by the hop count and "~": fallback1~a~b
MEMBER_PREFIX = "attempt~"  # a composite's member: a backend's cluster for attempts in order
MAX_CLUSTERS = 2000  # composite clusters a config may need before it is refused


@dataclass(frozen=True, slots=True)
class Hop:
    """One further attempt: the chain's model (as configured), the id it
    dispatches as, and the backend its selection picked."""

    model: str
    upstream_model: str
    backend: str
    # What the hop is charged to: its model's limits (the limited model, "" for
    # none, and its token budgets' rule ids).
    limit_model: str = ""
    budgets: tuple[str, ...] = ()


def member_cluster(backend: str) -> str:
    """The copy of ``backend``'s cluster a composite sends its attempts to:
    without Envoy's outlier ejection, so a composite never finds one empty and
    moves an attempt on to the next member (with the wrong model)."""
    return MEMBER_PREFIX + backend


def composite_cluster(backend: str, hops: tuple[Hop, ...]) -> str:
    """The cluster of a first attempt on ``backend`` followed by ``hops``.
    Backend names never contain ``~``, so the name is unambiguous."""
    return f"{COMPOSITE_PREFIX}{len(hops)}~{backend}~" + "~".join(h.backend for h in hops)


_memo: list[Any] = [None, {}]  # one snapshot and the tables derived from it


def memo(snap: Snapshot, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` once per snapshot and key: the tables below depend on the
    config alone, and the request path asks for them on every decision."""
    if _memo[0] is not snap:
        _memo[0], _memo[1] = snap, {}
    table = _memo[1]
    if key not in table:
        table[key] = compute()
    return table[key]  # type: ignore[no-any-return]


def hop_backends(snap: Snapshot, model: str) -> frozenset[str]:
    """The backends a hop of ``model`` may be sent to: those the config itself
    says serve it (the bootstrap has clusters for no others; a model list
    discovered at run time does not count), never an internal one."""

    def compute() -> frozenset[str]:
        static = _static(snap)
        return frozenset(n for n in static.resolve(model)[1] if not static.backends[n].internal)

    return memo(snap, ("backends", model), compute)


_statics: dict[int, tuple[object, Snapshot]] = {}


def _static(snap: Snapshot) -> Snapshot:
    """The snapshot of the config alone, as the bootstrap saw it."""
    if not snap.discovered:
        return snap
    cached = _statics.get(id(snap.config))
    if cached is None or cached[0] is not snap.config:
        _statics.clear()
        _statics[id(snap.config)] = cached = (snap.config, build(snap.config))
    return cached[1]


def plans(snap: Snapshot, max_hops: int) -> Iterator[tuple[str, tuple[Hop, ...]]]:
    """Every (first backend, hops) a decision can name: for each chain, a first
    attempt on any of its models, then an ordered selection of the models after
    it (hops without an admissible backend are skipped at decision time), each
    on any of its backends. A superset of what any one request can reach."""
    for origin, chain in snap.config.fallback_chains.items():
        models = [origin, *chain]
        for i, first in enumerate(models):
            rest = models[i + 1:]
            for n in range(1, min(max_hops, len(rest)) + 1):
                for picked in itertools.combinations(rest, n):
                    choices = [[Hop(m, m, b) for b in sorted(hop_backends(snap, m))] for m in picked]
                    for backend in sorted(hop_backends(snap, first)):
                        for hops in itertools.product(*choices):
                            yield backend, hops


def composites(snap: Snapshot, max_hops: int) -> dict[str, list[str]]:
    """Every composite cluster a decision can name, with its members' backends."""
    out: dict[str, list[str]] = {}
    for backend, hops in plans(snap, max_hops):
        out.setdefault(composite_cluster(backend, hops), [backend, *(h.backend for h in hops)])
        if len(out) > MAX_CLUSTERS:
            raise ValueError(
                f"fallback_chains with fallback_attempts {max_hops} need more than {MAX_CLUSTERS} Envoy clusters; "
                "lower fallback_attempts or shorten the chains"
            )
    return out

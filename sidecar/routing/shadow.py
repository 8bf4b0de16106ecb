"""Shadow arms: which requests are copied, where to, and with which model.

A shadow arm is a variant written with ``shadow: {share, max_in_flight}``.
It never serves a caller. For a ``share`` of the experiment's routed
requests the decision names the arm's Envoy cluster in
:data:`sidecar.contract.SHADOW_HEADER`; the routes' mirror policy reads that header and sends
Envoy's copy of the request there, without the caller waiting for it. The
shadow cluster's own upstream filter asks the sidecar to put the arm's model
in the copy's body (:mod:`sidecar.handlers.shadow_stream`), and its circuit breaker
caps the copies in flight at ``max_in_flight``.

Everything here is pure: the draw takes its uniform number from the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..config.schema import Config, Experiment, ShadowArm

CLUSTER_PREFIX = "shadow~"


@dataclass(frozen=True, slots=True)
class Target:
    """Where one experiment's shadow copies go."""

    experiment: str
    arm: ShadowArm
    backend: str
    cluster: str


def cluster_name(experiment: str) -> str:
    return f"{CLUSTER_PREFIX}{experiment}"


def backend_of(config: Config, arm: ShadowArm) -> str | None:
    """The backend a shadow arm's copies go to: its pin, else the first
    enabled, non-internal backend that lists its model."""
    if arm.backends:
        return arm.backends[0]
    for b in config.backends:
        if b.enabled and not b.internal and b.models is not None and arm.model in b.models:
            return b.name
    return None


def targets(config: Config) -> Iterator[Target]:
    """Every experiment's shadow arm whose backend resolves (validation
    refuses the rest)."""
    for e in config.model_experiments:
        for arm in e.shadows:
            backend = backend_of(config, arm)
            if backend is not None:
                yield Target(e.name, arm, backend, cluster_name(e.name))


def target_of(config: Config, cluster: str) -> Target | None:
    """The shadow arm a copy's header names, or None (an unknown name: a
    config reloaded since the decision)."""
    return next((t for t in targets(config) if t.cluster == cluster), None)


def draw(experiment: Experiment | None, u: float) -> str | None:
    """The shadow cluster this request is copied to, or None; ``u`` is
    uniform in [0, 1)."""
    if experiment is None or not experiment.shadows:
        return None
    arm = experiment.shadows[0]
    return cluster_name(experiment.name) if u < arm.shadow.share else None

"""Assignment as a service: which arm of an experiment a caller is in.

:func:`answer` builds the answer from a configuration, an experiment (name or
client model), a sticky value and a time, with the same
:func:`sidecar.routing.assignment.assign` call the request path makes. The gRPC
service ``model_router.v1.Assignment`` (``proto/model_router/v1/assignment.proto``,
registered on the sidecar's gRPC port by :func:`add_to_server`) and the
``model-router experiments assign`` command (:mod:`sidecar.commands.assign`) both
render that one answer, so they cannot disagree with each other or with the
router.

The answer mirrors what the router does for a request:

* a blank sticky value (empty or whitespace only) is a random draw;
* an experiment with ``sticky_key: none`` never uses a sticky value, so its
  answer is a random draw whatever value is given;
* otherwise the value is used byte for byte, and ``sticky_ttl`` (if set)
  selects the caller's current window at the given time.

Weight-0 variants appear in the score table with ``score`` +inf; their ``u``
is left unset in the gRPC answer (``None`` in :class:`Answer`, ``null`` in
JSON) because they take no part in the race.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ..config.schema import Config, Experiment
from ..routing import assignment
from ..routing.snapshot import Snapshot

log = logging.getLogger("model_router.assign_service")

try:
    from .._proto import assignment_pb2 as pb
    from .._proto import assignment_pb2_grpc as pb_grpc
except Exception as exc:  # e.g. protobuf runtime older than the checked-in gencode
    if isinstance(exc, ImportError):
        raise
    log.error("the Assignment gRPC service is unavailable: %s", exc)
    raise ImportError(f"sidecar._proto cannot be imported: {exc}") from exc

__all__ = ["Answer", "InvalidArgument", "UnknownExperiment", "add_to_server", "answer", "find_experiment"]


class UnknownExperiment(LookupError):
    """No experiment has the requested name or client model."""


class InvalidArgument(ValueError):
    """The request cannot be answered as given (blank experiment, unusable time)."""


@dataclass(frozen=True)
class VariantAnswer:
    variant_id: str
    model: str
    weight: int
    u: float | None  # None for weight-0 variants
    score: float  # +inf for weight-0 variants


@dataclass(frozen=True)
class Answer:
    experiment: str
    client_model: str
    sticky_key: str
    variant_id: str
    variant_model: str
    sticky: bool
    unix_time: float
    sticky_ttl: int | None
    window: int | None  # sticky assignments with a TTL only
    next_boundary: float | None  # sticky assignments with a TTL only
    scores: tuple[VariantAnswer, ...]  # declared order
    algorithm: str = assignment.ALGORITHM

    @property
    def window_start(self) -> float | None:
        if self.next_boundary is None or self.sticky_ttl is None:
            return None
        return self.next_boundary - self.sticky_ttl

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form with the gRPC answer's field names.

        ``window``, ``next_boundary`` and ``sticky_ttl`` are ``None`` when
        unset; a weight-0 variant has ``u`` and ``score`` ``None`` (JSON has
        no infinity).
        """
        return {
            "algorithm": self.algorithm,
            "experiment": self.experiment,
            "client_model": self.client_model,
            "sticky_key": self.sticky_key,
            "variant_id": self.variant_id,
            "variant_model": self.variant_model,
            "sticky": self.sticky,
            "unix_time": self.unix_time,
            "sticky_ttl": self.sticky_ttl,
            "window": self.window,
            "next_boundary": self.next_boundary,
            "scores": [
                {
                    "variant_id": s.variant_id,
                    "model": s.model,
                    "weight": s.weight,
                    "u": s.u,
                    "score": s.score if math.isfinite(s.score) else None,
                }
                for s in self.scores
            ],
        }

    def to_proto(self) -> pb.AssignResponse:
        resp = pb.AssignResponse(
            experiment=self.experiment,
            client_model=self.client_model,
            variant_id=self.variant_id,
            variant_model=self.variant_model,
            sticky=self.sticky,
            unix_time=self.unix_time,
            sticky_key=self.sticky_key,
            algorithm=self.algorithm,
        )
        if self.sticky_ttl is not None:
            resp.sticky_ttl = self.sticky_ttl
        if self.window is not None:
            resp.window = self.window
        if self.next_boundary is not None:
            resp.next_boundary = self.next_boundary
        for s in self.scores:
            entry = resp.scores.add(variant_id=s.variant_id, model=s.model, weight=s.weight, score=s.score)
            if s.u is not None:
                entry.u = s.u
        return resp


def find_experiment(config: Config, experiment: str) -> Experiment:
    """The experiment named ``experiment``, else the one whose client model it is.

    Raises :class:`InvalidArgument` for a blank name and
    :class:`UnknownExperiment` when nothing matches.
    """
    if not experiment or experiment.isspace():
        raise InvalidArgument("experiment is required (an experiment name or its client model)")
    exps = config.model_experiments
    for e in exps:
        if e.name == experiment:
            return e
    for e in exps:
        if e.model == experiment:
            return e
    if exps:
        known = ", ".join(f"{e.name} (client model {e.model})" for e in exps)
        raise UnknownExperiment(
            f"unknown experiment '{experiment}': no experiment has that name or client model (known: {known})"
        )
    raise UnknownExperiment(f"unknown experiment '{experiment}': the config has no model_experiments")


def answer(config: Config, experiment: str, sticky_value: str, unix_time: float | None = None) -> Answer:
    """Which arm ``sticky_value`` gets in ``experiment`` at ``unix_time`` (default now).

    Raises :class:`InvalidArgument` or :class:`UnknownExperiment`.
    """
    exp = find_experiment(config, experiment)
    now = time.time() if unix_time is None else unix_time
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise InvalidArgument(f"unix_time must be a finite number of seconds, got {unix_time!r}")
    try:
        sticky_value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("the sticky value must be valid Unicode (no unpaired surrogates)") from None
    value = None if exp.sticky_key == "none" else sticky_value
    variants = exp.race
    try:
        a = assignment.assign(exp.name, variants, value, ttl_seconds=exp.sticky_ttl, unix_time=now)
        boundary = (
            assignment.next_boundary(exp.name, value, exp.sticky_ttl, now)
            if a.sticky and value is not None and exp.sticky_ttl is not None
            else None
        )
    except ValueError as exc:
        raise InvalidArgument(f"cannot assign at unix_time {now!r}: {exc}") from None
    winner = exp.variants[a.variant_index]
    scores = tuple(
        VariantAnswer(
            variant_id=s.variant_id,
            model=v.model,
            weight=s.weight,
            u=None if s.weight == 0 else s.u,
            score=s.score,
        )
        for s, v in zip(a.scores, exp.variants)
    )
    return Answer(
        experiment=exp.name,
        client_model=exp.model,
        sticky_key=exp.sticky_key,
        variant_id=winner.id,
        variant_model=winner.model,
        sticky=a.sticky,
        unix_time=float(now),
        sticky_ttl=exp.sticky_ttl,
        window=a.window if a.sticky else None,
        next_boundary=boundary,
        scores=scores,
    )


class HasSnapshot(Protocol):
    """What the service reads from the serving process: the current snapshot."""

    @property
    def snapshot(self) -> Snapshot: ...


class AssignmentServicer(pb_grpc.AssignmentServicer):
    """``model_router.v1.Assignment`` over the runtime's current snapshot.

    The snapshot is read once per call, so a config reload applies to the
    next call.
    """

    def __init__(self, runtime: HasSnapshot) -> None:
        self._runtime = runtime

    async def Assign(self, request: pb.AssignRequest, context: grpc.aio.ServicerContext) -> pb.AssignResponse:
        config = self._runtime.snapshot.config
        at = request.unix_time if request.HasField("unix_time") else None
        try:
            return answer(config, request.experiment, request.sticky_value, at).to_proto()
        except UnknownExperiment as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable: context.abort raises")


def add_to_server(server: grpc.aio.Server, runtime: HasSnapshot) -> None:
    """Register the Assignment service on ``server`` (reads ``runtime.snapshot`` per call)."""
    pb_grpc.add_AssignmentServicer_to_server(AssignmentServicer(runtime), server)  # type: ignore[no-untyped-call]

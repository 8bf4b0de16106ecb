"""The readout's figures from usage records (docs/metering.md): exact, one observation per request.

Pure: :func:`aggregate` takes the records as parsed JSON objects; reading the
file is :func:`read`'s only job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from . import readout, srm
from .readout import ArmData, feedback_key
from .sequential import Moments

if TYPE_CHECKING:
    from ..config.schema import Config, Experiment, ModelMetadata, Price

COUNTED_KINDS = ("routed", "refusal", "answered", "cache_hit")  # requests on an arm, as the metrics count them
SERVED_KINDS = ("routed", "answered", "cache_hit")


class RecordsError(ValueError):
    pass


def read(path: str | Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a usage-records file; a line that is not one is skipped (a torn last line)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(rec, dict):
                    yield rec
    except OSError as exc:
        raise RecordsError(f"cannot read usage records {path}: {exc.strerror}") from None


@dataclass
class _Arm:
    requests: int = 0
    metrics: dict[str, Moments] = field(default_factory=dict)
    callers: set[str] = field(default_factory=set)
    served_callers: set[str] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)

    def observe(self, name: str, x: float) -> None:
        self.metrics[name] = self.metrics.get(name, Moments()).add(x)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class _Prices:
    def __init__(self, config: Config) -> None:
        self.meta: dict[str, ModelMetadata] = {}
        for m in config.model_metadata:
            self.meta[m.id] = m
            for a in m.aliases:
                self.meta.setdefault(a, m)

    def cost(self, rec: Mapping[str, Any], prompt: float, completion: float) -> float | None:
        meta = self.meta.get(str(rec.get("upstream_model")))
        price: Price | None = meta.price_on(str(rec.get("backend"))) if meta is not None else None
        return None if price is None else (prompt * price.input + completion * price.output) / 1e6


def _request(arm: _Arm, rec: Mapping[str, Any], prices: _Prices) -> None:
    kind, status = rec.get("kind"), _num(rec.get("status")) or 0
    arm.requests += 1
    arm.observe("error_rate", 1.0 if status >= 500 else 0.0)
    caller = rec.get("caller")
    if isinstance(caller, str):
        arm.callers.add(caller)
        if kind in ("routed", "answered") and 200 <= status < 300:
            arm.served_callers.add(caller)  # the sample-ratio test's population (sidecar/experiments/srm.py)
    if kind not in SERVED_KINDS:
        return
    latency = _num(rec.get("duration_to_headers_ms"))
    if latency is not None:
        arm.latencies.append(latency)
        arm.observe("latency_ms", latency)
    prompt, completion = _num(rec.get("prompt_tokens")), _num(rec.get("completion_tokens"))
    if kind == "cache_hit" or prompt is None or completion is None:
        return
    arm.observe("tokens_per_request", prompt + completion)
    cost = prices.cost(rec, prompt, completion)
    if cost is not None:
        arm.observe("cost_per_request", cost)


def _percentile(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))]


def _at(rec: Mapping[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(rec.get("time"))).timestamp()
    except ValueError:
        return None


def aggregate(records: Iterable[Mapping[str, Any]], config: Config, experiment: Experiment,
              since: float | None = None) -> tuple[dict[str, ArmData], float | None]:
    """Per-arm figures and the sample-ratio p-value of one experiment's records (those from ``since`` on).
    A shadow arm's figures come from its copies' records (``shadow: true``), under its id."""
    arms = {v.id: _Arm() for v in experiment.variants}
    shadows = {v.id: _Arm() for v in experiment.shadows}
    # (request id, name) -> (revision, arm, value): the highest revision wins (records of
    # one request can reach the file out of order: Envoy flushes per worker thread).
    feedback: dict[tuple[str, str], tuple[int, str, float]] = {}
    kinds = {m.name: m.type for m in config.feedback_metrics}
    prices = _Prices(config)
    for rec in records:
        variant = rec.get("experiment_variant_id")
        if rec.get("shadow") is True:
            if rec.get("experiment_id") == experiment.name and variant in shadows and (
                    since is None or ((at := _at(rec)) is not None and at >= since)):
                _request(shadows[str(variant)], {**rec, "kind": "routed"}, prices)  # a copy: served, never cached
            continue
        if rec.get("experiment_id") != experiment.name or not isinstance(variant, str) or variant not in arms:
            continue
        if since is not None and ((at := _at(rec)) is None or at < since):
            continue
        if rec.get("kind") == "feedback":
            name, value = rec.get("name"), rec.get("value")
            if isinstance(name, str) and name in kinds and isinstance(rec.get("request_id"), str):
                x = float(value) if isinstance(value, bool) else _num(value)
                revision = rec.get("revision")
                revision = revision if isinstance(revision, int) else 1
                key = (rec["request_id"], name)
                if x is not None and revision >= feedback.get(key, (0, "", 0.0))[0]:
                    feedback[key] = (revision, variant, x)
        elif rec.get("kind") in COUNTED_KINDS:
            _request(arms[variant], rec, prices)
    for (_, name), (_, variant, x) in feedback.items():
        arms[variant].observe(feedback_key(name), x)
    out = {}
    for vid, a in (arms | shadows).items():
        a.latencies.sort()
        out[vid] = ArmData(requests=a.requests, callers=len(a.callers), latency_p50_ms=_percentile(a.latencies, 0.5),
                           latency_p95_ms=_percentile(a.latencies, 0.95), metrics=a.metrics)
    counts = [len(arms[v.id].served_callers) for v in experiment.variants]
    p = srm.p_value(counts, [w for _, w in experiment.race])
    return out, None if math.isnan(p) else p


def experiments_of(config: Config, name: str | None) -> list[Experiment]:
    """The experiments asked for; raises KeyError for an unknown name."""
    if name is None:
        return list(config.model_experiments)
    for e in config.model_experiments:
        if e.name == name:
            return [e]
    raise KeyError(name)


def report_from_records(config: Config, experiment: Experiment, rows: list[dict[str, Any]],
                        since: float | None = None) -> dict[str, Any]:
    arms, p = aggregate(rows, config, experiment, since)
    return readout.build(config, experiment, arms, p, "usage_records")

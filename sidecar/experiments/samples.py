"""The readout's figures from the per-arm metrics: a Prometheus server, or this process's own registry.

Counters give exact counts and sums; a per-request spread is known exactly
for 0/1 outcomes (errors, boolean feedback) and estimated from histogram
buckets (latency, float feedback: each bucket's observations taken at its
midpoint). Tokens and cost per request have no spread in the metrics, so
this source reports their means without an interval (usage records have it).
Distinct callers are the sample-ratio test's sampled callers.

:func:`arms_of` is pure; the two readers only fetch samples.
"""

from __future__ import annotations

import math
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from .readout import ArmData, build, feedback_key
from .sequential import Moments

if TYPE_CHECKING:
    from ..config.schema import Config, Experiment

Sample = tuple[str, Mapping[str, str], float]

REQUESTS = "model_experiment_requests_total"
DURATION = "model_experiment_request_duration_seconds"
TOKENS = "model_experiment_tokens_total"
CACHE_HITS = "model_experiment_cache_hits_total"
FEEDBACK = "model_experiment_feedback_total"
FEEDBACK_VALUE = "model_experiment_feedback_value_total"
FEEDBACK_RETRACTED = "model_experiment_feedback_value_retracted_total"
FEEDBACK_DISTRIBUTION = "model_experiment_feedback_distribution"
SRM_P = "model_experiment_srm_p_value"
SRM_CALLERS = "model_experiment_srm_callers"
# Counters and histogram parts read over a window, and the labels each is summed by.
COUNTERS = {REQUESTS: ("variant", "status"), TOKENS: ("variant", "kind"), CACHE_HITS: ("variant",), f"{DURATION}_bucket": ("variant", "le"),
            f"{DURATION}_count": ("variant",), f"{DURATION}_sum": ("variant",), FEEDBACK: ("variant", "name"),
            FEEDBACK_VALUE: ("variant", "name"), FEEDBACK_RETRACTED: ("variant", "name"),
            f"{FEEDBACK_DISTRIBUTION}_bucket": ("variant", "name", "le")}


def _total(samples: list[Sample], series: str, /, **match: str) -> float:
    return sum(v for n, labels, v in samples if n == series and all(labels.get(k) == x for k, x in match.items())
               and math.isfinite(v))


def _histogram(samples: list[Sample], series: str, /, **match: str) -> list[tuple[float, float]]:
    """(upper bound, observations in the bucket), the +Inf bucket last."""
    cumulative: dict[float, float] = {}
    for n, labels, v in samples:
        if n == f"{series}_bucket" and all(labels.get(k) == x for k, x in match.items()) and "le" in labels:
            le = float(labels["le"])
            cumulative[le] = cumulative.get(le, 0.0) + v
    out, below = [], 0.0
    for le in sorted(cumulative):
        out.append((le, max(0.0, cumulative[le] - below)))
        below = max(below, cumulative[le])
    return out


def _moments(buckets: list[tuple[float, float]], total: float, scale: float = 1.0) -> Moments:
    """Count, the exact sum and squares estimated at bucket midpoints (the open bucket at its lower bound)."""
    n, squares, lower = 0.0, 0.0, 0.0
    for le, count in buckets:
        mid = lower if math.isinf(le) else (lower + le) / 2
        n += count
        squares += count * (mid * scale) ** 2
        lower = lower if math.isinf(le) else le
    return Moments(n, total * scale, squares)


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    n = sum(c for _, c in buckets)
    if n <= 0:
        return None
    rank, seen, lower = q * n, 0.0, 0.0
    for le, count in buckets:
        if count and seen + count >= rank:
            return lower if math.isinf(le) else lower + (le - lower) * (rank - seen) / count
        seen += count
        lower = lower if math.isinf(le) else le
    return lower


def _arm(config: Config, experiment: Experiment, variant: str, samples: list[Sample]) -> ArmData:
    v = variant
    requests, errors = _total(samples, REQUESTS, variant=v), _total(samples, REQUESTS, variant=v, status="server_error")
    arm = ArmData(requests=round(requests))
    arm.metrics["error_rate"] = Moments(requests, errors, errors)
    latency = _histogram(samples, DURATION, variant=v)
    arm.metrics["latency_ms"] = _moments(latency, _total(samples, f"{DURATION}_sum", variant=v), 1000.0)
    p50, p95 = _quantile(latency, 0.5), _quantile(latency, 0.95)
    arm.latency_p50_ms, arm.latency_p95_ms = (None if p is None else p * 1000 for p in (p50, p95))
    # Answers from the response cache ran no model: they carry no tokens.
    served = _total(samples, REQUESTS, variant=v, status="success") - _total(samples, CACHE_HITS, variant=v)
    prompt = _total(samples, TOKENS, variant=v, kind="prompt")
    completion = _total(samples, TOKENS, variant=v, kind="completion")
    if served > 0 and prompt + completion > 0:
        arm.means_only["tokens_per_request"] = (prompt + completion) / served
        model = next(x.model for x in experiment.variants if x.id == v)
        meta = next((m for m in config.model_metadata if m.id == model or model in m.aliases), None)
        if meta is not None and meta.pricing is not None:
            arm.means_only["cost_per_request"] = (prompt * meta.pricing.input
                                                  + completion * meta.pricing.output) / 1e6 / served
    for m in config.feedback_metrics:
        n = _total(samples, FEEDBACK, variant=v, name=m.name)
        s = _total(samples, FEEDBACK_VALUE, variant=v, name=m.name) - _total(
            samples, FEEDBACK_RETRACTED, variant=v, name=m.name)
        if m.type == "boolean":
            arm.metrics[feedback_key(m.name)] = Moments(n, s, s)
        else:
            shape = _moments(_histogram(samples, FEEDBACK_DISTRIBUTION, variant=v, name=m.name), s)
            arm.metrics[feedback_key(m.name)] = Moments(n, s, shape.squares * n / shape.n if shape.n else 0.0)
    callers = [x for n_, labels, x in samples if n_ == SRM_CALLERS and labels.get("variant") == v]
    arm.callers = round(sum(callers)) if callers else None
    return arm


def arms_of(config: Config, experiment: Experiment, samples: Iterable[Sample]) -> tuple[dict[str, ArmData], float | None]:
    """Per-arm figures and the lowest sample-ratio p-value, from samples of one experiment's series."""
    rows = [s for s in samples if s[1].get("experiment", experiment.name) == experiment.name]
    arms = {v.id: _arm(config, experiment, v.id, rows) for v in experiment.variants}
    ps = [v for n, _, v in rows if n == SRM_P and not math.isnan(v)]
    return arms, min(ps) if ps else None


# --------------------------------------------------------------------------- readers


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - an operator-given URL
            doc = orjson.loads(resp.read())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"Prometheus at {base} did not answer {expr!r}: {exc}") from None
    if doc.get("status") != "success" or doc.get("data", {}).get("resultType") != "vector":
        raise ValueError(f"Prometheus refused {expr!r}: {doc.get('error', doc.get('status'))}")
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def prometheus_samples(base: str, experiment: str, window: str) -> Iterator[Sample]:
    """Each series' increase over the window (gauges: their latest value), summed over sidecar processes."""
    if not window or not window[:-1].isdigit() or window[-1] not in "smhdwy":
        raise ValueError(f"--window must be a Prometheus duration such as 14d, got {window!r}")
    selector = '{experiment="%s"}' % experiment.replace("\\", "\\\\").replace('"', '\\"')
    exprs = {name: f"sum by ({', '.join(by)}) (increase({name}{selector}[{window}]))" for name, by in COUNTERS.items()}
    exprs[SRM_P] = f"min({SRM_P}{selector})"
    exprs[SRM_CALLERS] = f"sum by (variant) ({SRM_CALLERS}{selector})"
    for name, expr in exprs.items():
        for row in _query(base, expr):
            try:
                labels, value = {str(k): str(v) for k, v in row["metric"].items()}, float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError, AttributeError):
                raise ValueError(f"Prometheus at {base} answered {expr!r} with a malformed sample") from None
            yield name, {**labels, "experiment": experiment}, value


def registry_samples() -> Iterator[Sample]:
    """This process's own series (cumulative since it started)."""
    from .. import metrics

    for family in metrics.REGISTRY.collect():
        for s in family.samples:
            if "experiment" in s.labels:
                yield s.name, s.labels, float(s.value)


def report_from_prometheus(config: Config, experiment: Experiment, base: str, window: str) -> dict[str, Any]:
    arms, p = arms_of(config, experiment, prometheus_samples(base, experiment.name, window))
    return build(config, experiment, arms, p, "prometheus")


def report_from_registry(config: Config, experiment: Experiment) -> dict[str, Any]:
    arms, p = arms_of(config, experiment, registry_samples())
    return build(config, experiment, arms, p, "metrics")

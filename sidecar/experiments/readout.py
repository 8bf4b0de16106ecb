"""The per-arm readout of an experiment: each arm against the control arm.

Pure: the sources (:mod:`.records`, :mod:`.samples`) turn usage records or
metric samples into :class:`ArmData`; :func:`build` compares every arm with
the control arm (the experiment's first variant) metric by metric, with the
always-valid interval of :mod:`.sequential`, and gates the whole comparison
on the sample-ratio test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .sequential import ALPHA, Moments, Optimize, difference, verdict

if TYPE_CHECKING:
    from ..config.schema import Config, Experiment

SRM_THRESHOLD = 0.001  # the live alert's threshold (docs/operations.md)
UNTRUSTED = "not trusted"

# Built-in metrics: name, direction, what one observation is.
BUILTIN: tuple[tuple[str, Optimize | None, str], ...] = (
    ("error_rate", "min", "1 when the client got a 5xx, else 0; every request the arm resolved"),
    ("latency_ms", "min", "milliseconds to the response headers; requests the arm served"),
    ("tokens_per_request", None, "prompt + completion tokens; requests whose response reported usage"),
    ("cost_per_request", "min", "USD from model_metadata pricing; requests with usage on a priced model"),
)


def feedback_key(name: str) -> str:
    return f"feedback:{name}"


@dataclass
class ArmData:
    """What a source knows about one arm."""

    requests: int = 0
    callers: int | None = None  # distinct callers; None: the source cannot tell
    latency_p50_ms: float | None = None
    latency_p95_ms: float | None = None
    metrics: dict[str, Moments] = field(default_factory=dict)
    means_only: dict[str, float] = field(default_factory=dict)  # a mean without the spread an interval needs


def metric_specs(config: Config) -> list[tuple[str, Optimize | None, str]]:
    out = list(BUILTIN)
    for m in config.feedback_metrics:
        what = "1 for true, 0 for false" if m.type == "boolean" else "the value given"
        out.append((feedback_key(m.name), m.optimize, f"{what}; the latest feedback per request"))
    return out


def srm_gate(p_value: float | None) -> dict[str, Any]:
    """Whether the arms got the callers their weights promise, as the report states it."""
    if p_value is None or math.isnan(p_value):
        return {"p_value": None, "threshold": SRM_THRESHOLD, "trusted": True,
                "reason": "too few sticky callers to test the sample ratio yet"}
    if p_value < SRM_THRESHOLD:
        return {"p_value": p_value, "threshold": SRM_THRESHOLD, "trusted": False,
                "reason": (f"sample-ratio mismatch: the arms' distinct callers depart from the racing weights "
                           f"(p = {p_value:.2g} < {SRM_THRESHOLD}); an arm is losing or gaining callers "
                           f"(failures, lost entries, an edit mid-experiment), so the arms no longer compare "
                           f"like with like")}
    return {"p_value": p_value, "threshold": SRM_THRESHOLD, "trusted": True,
            "reason": "the arms' callers match the racing weights"}


def _number(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def _arm_view(variant: str, role: str, arm: ArmData, specs: Sequence[tuple[str, Optimize | None, str]]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for name, _, _ in specs:
        m = arm.metrics.get(name)
        if m is not None:
            metrics[name] = {"n": m.n, "mean": _number(m.mean)}
        elif name in arm.means_only:
            metrics[name] = {"n": None, "mean": _number(arm.means_only[name])}
        else:
            metrics[name] = {"n": 0, "mean": None}
    return {"variant": variant, "role": role, "requests": arm.requests, "callers": arm.callers,
            "latency_p50_ms": arm.latency_p50_ms, "latency_p95_ms": arm.latency_p95_ms, "metrics": metrics}


def _compare(control: ArmData, arm: ArmData, name: str, optimize: Optimize | None, trusted: bool,
             alpha: float) -> dict[str, Any]:
    c, t = control.metrics.get(name), arm.metrics.get(name)
    if c is None or t is None or c.n == 0 or t.n == 0:
        cm, tm = control.means_only.get(name), arm.means_only.get(name)
        estimate = tm - cm if cm is not None and tm is not None else None
        return {"difference": _number(estimate), "low": None, "high": None, "optimize": optimize,
                "verdict": "not yet distinguishable" if trusted else UNTRUSTED,
                "note": "no interval: the source has no per-request spread for this metric"
                if estimate is not None else "no observations in one of the arms"}
    d = difference(c, t, alpha)
    return {"difference": _number(d.estimate), "low": d.low, "high": d.high, "optimize": optimize,
            "verdict": verdict(d, optimize) if trusted else UNTRUSTED}


def build(config: Config, experiment: Experiment, arms: Mapping[str, ArmData], srm_p_value: float | None,
          source: str, alpha: float = ALPHA) -> dict[str, Any]:
    """The report: every arm's figures and its comparison with the control arm."""
    specs = metric_specs(config)
    gate = srm_gate(srm_p_value)
    control_id = experiment.variants[0].id
    control = arms.get(control_id, ArmData())
    views: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    for j, v in enumerate(experiment.variants):
        arm = arms.get(v.id, ArmData())
        views.append(_arm_view(v.id, "control" if j == 0 else "treatment", arm, specs))
        if j:
            comparisons.append({"variant": v.id, "against": control_id, "metrics": {
                name: _compare(control, arm, name, optimize, gate["trusted"], alpha) for name, optimize, _ in specs}})
    for s in experiment.shadows:
        if s.id not in arms:
            continue  # a source without the shadow's figures (the metrics source)
        arm = arms[s.id]
        views.append(_arm_view(s.id, "shadow", arm, specs))
        # A shadow sees copies of a share of every arm's requests: its comparison is
        # with the control arm, outside the sample-ratio gate (nobody is assigned to it).
        comparisons.append({"variant": s.id, "against": control_id, "shadow": True, "metrics": {
            name: _compare(control, arm, name, optimize, True, alpha) for name, optimize, _ in specs}})
    return {"experiment": experiment.name, "control": control_id, "source": source, "alpha": alpha,
            "interval": "always-valid (mixture SPRT confidence sequence): safe to look at any time",
            "srm": gate, "metrics": {name: {"optimize": o, "observation": what} for name, o, what in specs},
            "arms": views, "comparisons": comparisons}


def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def render(report: Mapping[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [f"experiment {report['experiment']} (control arm: {report['control']}; source: {report['source']})"]
    gate = report["srm"]
    lines.append(("" if gate["trusted"] else "COMPARISON CANNOT BE TRUSTED: ") + gate["reason"]
                 + ("" if gate["p_value"] is None else f" [SRM p = {gate['p_value']:.3g}]"))
    lines.append("")
    lines.append(f"{'arm':<16} {'requests':>9} {'callers':>8} {'p50 ms':>9} {'p95 ms':>9}")
    for a in report["arms"]:
        callers = "-" if a["callers"] is None else str(a["callers"])
        name = a["variant"] + (" (shadow)" if a["role"] == "shadow" else "")
        lines.append(f"{name:<16} {a['requests']:>9} {callers:>8} {_fmt(a['latency_p50_ms']):>9} "
                     f"{_fmt(a['latency_p95_ms']):>9}")
    means = {a["variant"]: a["metrics"] for a in report["arms"]}
    for comp in report["comparisons"]:
        lines.append("")
        what = "shadow copies of a share of all arms' requests, " if comp.get("shadow") else ""
        lines.append(f"{comp['variant']} vs {comp['against']} ({what}{1 - report['alpha']:.0%} always-valid intervals)")
        lines.append(f"  {'metric':<26} {'control':>10} {'arm':>10} {'difference':>11} {'interval':>24}  verdict")
        for name, c in comp["metrics"].items():
            low, high = c["low"], c["high"]
            interval = "-" if low is None or high is None else f"[{low:.4g}, {high:.4g}]"
            lines.append(f"  {name:<26} {_fmt(means[comp['against']][name]['mean']):>10} "
                         f"{_fmt(means[comp['variant']][name]['mean']):>10} {_fmt(c['difference']):>11} "
                         f"{interval:>24}  {c['verdict']}")
    return "\n".join(lines) + "\n"

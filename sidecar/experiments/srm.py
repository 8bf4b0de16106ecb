"""Sample-ratio mismatch, live: are an experiment's arms getting the callers their weights promise?

Off the request path. The decision publishes ``caller`` (16 hex digits: the
first 8 bytes of the caller key that entered the race, already a SHA-256 of
the experiment and the sticky value, never the value itself) for sticky
assignments. From the access log, every request an arm *served* (2xx) adds
its caller to the experiment's sample; random assignments have no caller and
are not counted. Per experiment, each scrape reports
``model_experiment_srm_p_value``: the p-value of Pearson's chi-square
goodness-of-fit test of the sampled callers' arms against the racing weights.

Distinct callers, not requests, so a heavy caller weighs as much as a light
one and the arm labels are independent draws (the race hashes each caller
afresh). An arm whose upstream fails its callers, or whose entries are lost
before they are counted, then shows as a mismatch.

Memory bound: the window (:data:`WINDOW_S`) is :data:`BUCKETS` buckets. A
bucket keeps at most ``1.25 * SAMPLE`` callers and is cut back to the
:data:`SAMPLE` smallest caller hashes whenever it reaches that (a bottom-k
sample). The window's sample is the ``SAMPLE`` smallest hashes of the union
of its buckets, which is exactly the bottom-k of all its distinct callers.
The hash is independent of the arm (the arm comes from other hashes of the
caller key), so that sample is a uniform random sample of the window's
distinct callers and the test on it is exact in size; past ``SAMPLE``
callers only its power stops growing: with 2048 sampled callers a 50/50
split observed as 46.4/53.6 gives p = 0.001 (the statistic is ``4 n d²`` for
a shift ``d`` of a two-arm even split). Memory per experiment is at most
``BUCKETS * 1.25 * SAMPLE`` entries (12 800, about 1.3 MB of Python objects),
whatever the traffic.

A change of an experiment's racing weights (an edit, a pause) starts its
window afresh: callers drawn under the old weights would skew the new test.
Each sidecar process tests the entries it receives (Envoy spreads its
access-log streams over them), each a uniform share of the traffic.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..accounting.entries import Reads
from ..accounting.metering import Entry, status_class

if TYPE_CHECKING:
    from ..config.schema import Config

WINDOW_S = 900.0
BUCKETS = 5
SAMPLE = 2048
MIN_EXPECTED = 5.0  # below this many expected callers in an arm the chi-square approximation says nothing


# --------------------------------------------------------------------------- the test


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with ``dof`` degrees of freedom."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    if x <= 0:
        return 1.0
    return gamma_q(dof / 2.0, x / 2.0)


def gamma_q(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) = Γ(a, x) / Γ(a).

    A power series for P = 1 - Q below ``x = a + 1``, a continued fraction
    (modified Lentz) for Q above; both converge fast there.
    """
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return min(1.0, math.exp(log_prefix) * h)


def p_value(observed: Sequence[int], weights: Sequence[int]) -> float:
    """Chi-square goodness of fit of arm counts to weights (weight-0 arms left out); NaN
    when the sample is too small for the test to say anything, or fewer than two arms race."""
    pairs = [(o, w) for o, w in zip(observed, weights) if w > 0]
    n = sum(o for o, _ in pairs)
    total = sum(w for _, w in pairs)
    if len(pairs) < 2 or n == 0:
        return math.nan
    expected = [n * w / total for _, w in pairs]
    if min(expected) < MIN_EXPECTED:
        return math.nan
    stat = sum((o - e) ** 2 / e for (o, _), e in zip(pairs, expected))
    return chi2_sf(stat, len(pairs) - 1)


# --------------------------------------------------------------------------- the sample


@dataclass
class _Bucket:
    index: int
    callers: dict[int, int] = field(default_factory=dict)  # caller hash -> arm index
    limit: int = 1 << 64  # hashes at or above this are not in the bucket's bottom-k


@dataclass
class CallerSample:
    """Distinct callers per arm over a rolling window, as a bottom-k sample."""

    weights: tuple[int, ...]
    window_s: float = WINDOW_S
    buckets: int = BUCKETS
    size: int = SAMPLE
    _buckets: deque[_Bucket] = field(default_factory=deque)
    bucket_s: float = field(init=False)
    _cut_at: int = field(init=False)  # callers a bucket holds before it is cut back to ``size``

    def __post_init__(self) -> None:
        self.bucket_s = self.window_s / self.buckets
        self._cut_at = self.size + self.size // 4

    def add(self, caller: int, arm: int, now: float) -> None:
        index = math.floor(now / self.bucket_s)
        buckets = self._buckets
        if not buckets or buckets[-1].index != index:
            buckets.append(_Bucket(index))
            self._expire(index)
        b = buckets[-1]
        if caller >= b.limit:
            return
        b.callers[caller] = arm
        if len(b.callers) >= self._cut_at:
            kept = sorted(b.callers)[: self.size]
            b.callers = {h: b.callers[h] for h in kept}
            b.limit = kept[-1] + 1

    def _expire(self, index: int) -> None:
        while self._buckets and self._buckets[0].index <= index - self.buckets:
            self._buckets.popleft()

    def counts(self, now: float) -> list[int]:
        """Sampled distinct callers per arm in the window ending at ``now``."""
        self._expire(math.floor(now / self.bucket_s))
        union: dict[int, int] = {}
        for b in self._buckets:  # oldest first: a caller seen again keeps its latest arm
            union.update(b.callers)
        out = [0] * len(self.weights)
        for h in sorted(union)[: self.size] if len(union) > self.size else union:
            out[union[h]] += 1
        return out


READS = Reads(("kind", "experiment", "variant", "caller"))


class Tracker:
    """One :class:`CallerSample` per experiment, kept in step with the current config."""

    def __init__(self, config: Callable[[], Config], clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._seen: Config | None = None
        self._arms: dict[str, tuple[dict[str, int], tuple[int, ...]]] = {}  # experiment -> (arm index, weights)
        self.samples: dict[str, CallerSample] = {}
        self._slots: dict[tuple[str, str], tuple[CallerSample, int]] = {}  # an arm's sample and its index there

    def _refresh(self) -> None:
        cfg = self._config()
        if cfg is self._seen:
            return
        self._seen = cfg
        self._arms = {
            e.name: ({v.id: i for i, v in enumerate(e.variants)}, tuple(w for _, w in e.race))
            for e in cfg.model_experiments
        }
        self.samples = {
            name: s for name, s in self.samples.items() if name in self._arms and self._arms[name][1] == s.weights
        }
        self._slots = {}

    def reads(self) -> Reads:
        """What :meth:`observe` reads of a decision (its status class reads the kind)."""
        return READS

    def observe(self, entry: Entry) -> None:
        """An access-log entry: a 2xx an arm served to a sticky caller adds that caller."""
        d = entry.decision
        experiment, variant, caller = d.experiment, d.variant, d.caller
        if (experiment and variant and caller is not None and d.kind in ("routed", "answered")
                and status_class(entry) == "success"):
            self.add(experiment, variant, caller)

    def add(self, experiment: str, variant: str, caller: str) -> None:
        """A caller an arm served (``caller``: the hex digits the decision publishes)."""
        if self._config() is not self._seen:
            self._refresh()
        slot = self._slots.get((experiment, variant)) or self._slot(experiment, variant)
        if slot is None:
            return
        try:
            h = int(caller, 16)
        except ValueError:
            return
        slot[0].add(h, slot[1], self._clock())

    def _slot(self, experiment: str, variant: str) -> tuple[CallerSample, int] | None:
        """The sample of a configured arm's experiment (made now if new) and
        the arm's index in it; None for an arm the config does not have."""
        arms = self._arms.get(experiment)
        if arms is None or variant not in arms[0]:
            return None
        sample = self.samples.get(experiment)
        if sample is None:
            sample = self.samples[experiment] = CallerSample(arms[1])
        slot = self._slots[experiment, variant] = (sample, arms[0][variant])
        return slot

    def report(self) -> Iterator[tuple[str, list[str], list[int], float]]:
        """(experiment, arm ids, sampled callers per arm, p-value) for every experiment."""
        self._refresh()
        cfg = self._seen
        assert cfg is not None
        now = self._clock()
        for e in cfg.model_experiments:
            weights = self._arms[e.name][1]
            sample = self.samples.get(e.name)
            counts = sample.counts(now) if sample is not None else [0] * len(weights)
            yield e.name, [v.id for v in e.variants], counts, p_value(counts, weights)


class SrmCollector(Collector):
    """The tracker's figures, computed when Prometheus scrapes."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        p = GaugeMetricFamily(
            "model_experiment_srm_p_value",
            "Chi-square p-value of the arms' distinct served callers against the racing weights, over the "
            "rolling window (NaN: too few callers to test). Below 0.001: sample-ratio mismatch.",
            labels=["experiment"],
        )
        n = GaugeMetricFamily(
            "model_experiment_srm_callers",
            "Distinct served callers per arm in the SRM test's sample (a bottom-k sample of the window's callers).",
            labels=["experiment", "variant"],
        )
        for experiment, arms, counts, value in self.tracker.report():
            p.add_metric([experiment], value)
            for arm, count in zip(arms, counts):
                n.add_metric([experiment, arm], count)
        yield p
        yield n

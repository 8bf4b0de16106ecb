"""Always-valid comparison of two arms' means: a confidence sequence.

Pure functions, no I/O. The interval for ``mean(treatment) - mean(control)``
is the one the mixture sequential probability ratio test (mSPRT) inverts, with
a normal mixing distribution over the effect (Johari, Pekelis & Walsh, "Always
valid inference: continuous monitoring of A/B tests", Operations Research
2022; the form Optimizely's stats engine uses). For an estimate ``d`` whose
variance is ``V``, the test of "the difference is ``theta``" has the mixture
likelihood ratio

    sqrt(V / (V + tau2)) * exp(tau2 * (d - theta)^2 / (2 V (V + tau2)))

and rejects once that reaches ``1 / alpha``. The ratio is a non-negative
martingale under the null, so by Ville's inequality the chance that it *ever*
reaches ``1 / alpha`` is at most ``alpha``, however often it is looked at.
The values of ``theta`` not rejected form the interval

    d +- sqrt(V (V + tau2) / tau2 * (2 ln(1 / alpha) + ln((V + tau2) / V)))

which covers the true difference at every look at once with probability at
least ``1 - alpha``. ``V`` is the plug-in ``s_c^2 / n_c + s_t^2 / n_t``;
with tens of observations per arm and up this is close to the known-variance
case the guarantee is proved for (``tests/unit/test_sequential.py`` measures it).

``tau2`` only decides at which sample size the interval is tightest, never its
validity; it is set so that this happens near :data:`TUNED_N` observations per
arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ALPHA = 0.05
TUNED_N = 1000  # observations per arm where the interval is tightest
MIN_N = 10  # fewer observations in an arm: no interval

Optimize = Literal["max", "min"]
Verdict = Literal["better", "worse", "higher", "lower", "not yet distinguishable"]


@dataclass(frozen=True, slots=True)
class Moments:
    """A metric's observations in one arm, as count, sum and sum of squares (a count read from
    Prometheus's ``increase()`` is an extrapolated estimate, hence a float)."""

    n: float = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, x: float) -> Moments:
        return Moments(self.n + 1, self.total + x, self.squares + x * x)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def variance(self) -> float:
        """The sample variance (n - 1 in the denominator)."""
        if self.n < 2:
            return math.nan
        spread = self.squares - self.total * self.total / self.n
        # Rounding leaves a constant sample a spread of a few ulps of its squares: that is none.
        return spread / (self.n - 1) if spread > 1e-12 * self.squares else 0.0


@dataclass(frozen=True, slots=True)
class Difference:
    """``treatment - control`` with its always-valid interval (``low``/``high`` None: too little data)."""

    estimate: float
    low: float | None
    high: float | None

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)


def half_width(variance: float, tau2: float, alpha: float = ALPHA) -> float:
    """Half the width of the mixture-SPRT interval for an estimate of this variance."""
    if variance <= 0 or tau2 <= 0:
        raise ValueError("variance and tau2 must be positive")
    spread = variance * (variance + tau2) / tau2
    return math.sqrt(spread * (2 * math.log(1 / alpha) + math.log((variance + tau2) / variance)))


def difference(control: Moments, treatment: Moments, alpha: float = ALPHA, tuned_n: int = TUNED_N) -> Difference:
    """The difference of means and its confidence sequence."""
    estimate = treatment.mean - control.mean
    if control.n < MIN_N or treatment.n < MIN_N:
        return Difference(estimate, None, None)
    sc, st = control.variance, treatment.variance
    v = sc / control.n + st / treatment.n
    if not v > 0:  # both arms constant: nothing to say about the spread yet
        return Difference(estimate, None, None)
    h = half_width(v, (sc + st) / tuned_n, alpha)
    return Difference(estimate, estimate - h, estimate + h)


def verdict(diff: Difference, optimize: Optimize | None) -> Verdict:
    """better / worse for the metric's direction (higher / lower without one), once the interval excludes 0."""
    if not diff.excludes_zero:
        return "not yet distinguishable"
    up = diff.estimate > 0
    if optimize is None:
        return "higher" if up else "lower"
    return "better" if up == (optimize == "max") else "worse"

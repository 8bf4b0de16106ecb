"""The readout's confidence sequence: its formula, and its calibration under daily peeking.

The calibration simulates many experiments looked at once a day. Per day and
arm it draws the day's sufficient statistics exactly (a normal sample's mean
and variance are independent normal and chi-square draws; a Bernoulli sample
is one binomial count), accumulates them with numpy, and asks the product's
own :func:`difference` at every look. Tolerances come from the number of
simulated experiments: a share is allowed 3 binomial standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sidecar.experiments.sequential import ALPHA, Difference, Moments, difference, half_width, verdict

EXPERIMENTS = 2000
LOOKS = 30  # one a day for a month
PER_DAY = 200  # observations per arm per day


def tolerance(p: float, n: int = EXPERIMENTS) -> float:
    return 3 * math.sqrt(p * (1 - p) / n)


# --------------------------------------------------------------------------- the formula


def test_moments_match_numpy():
    xs = [3.0, 1.5, -2.0, 7.25, 0.0]
    m = Moments()
    for x in xs:
        m = m.add(x)
    assert (m.n, m.mean) == (5, pytest.approx(np.mean(xs)))
    assert m.variance == pytest.approx(np.var(xs, ddof=1))
    assert math.isnan(Moments().mean) and math.isnan(Moments(1, 2.0, 4.0).variance)


def test_half_width_is_the_mixture_boundary():
    # The interval's edge is where the mixture likelihood ratio equals 1 / alpha.
    v, tau2 = 0.004, 0.01
    h = half_width(v, tau2)
    ratio = math.sqrt(v / (v + tau2)) * math.exp(tau2 * h * h / (2 * v * (v + tau2)))
    assert ratio == pytest.approx(1 / ALPHA)
    assert half_width(v, tau2, alpha=0.01) > h
    with pytest.raises(ValueError):
        half_width(0.0, tau2)


def test_small_or_constant_arms_get_no_interval():
    few = Moments(5, 5.0, 5.0)
    assert difference(few, Moments(50, 10.0, 10.0)).low is None
    constant = Moments(50, 0.0, 0.0)
    d = difference(constant, constant)
    assert (d.estimate, d.low, d.high) == (0.0, None, None)
    assert verdict(d, "max") == "not yet distinguishable"
    tenths = Moments()
    for _ in range(1000):
        tenths = tenths.add(0.1)  # inexact in binary: the sums carry rounding error
    assert tenths.variance == 0.0 and difference(tenths, tenths).low is None


def test_verdict_follows_the_direction():
    up = Difference(0.3, 0.1, 0.5)
    down = Difference(-0.3, -0.5, -0.1)
    straddles = Difference(0.3, -0.1, 0.7)
    assert (verdict(up, "max"), verdict(up, "min"), verdict(up, None)) == ("better", "worse", "higher")
    assert (verdict(down, "max"), verdict(down, "min"), verdict(down, None)) == ("worse", "better", "lower")
    assert verdict(straddles, "max") == "not yet distinguishable"


# --------------------------------------------------------------------------- calibration


def normal_days(rng, mean: float) -> tuple[np.ndarray, np.ndarray]:
    """Per experiment and day: the sum and the sum of squares of PER_DAY unit-variance normals."""
    shape = (EXPERIMENTS, LOOKS)
    means = rng.normal(mean, 1 / math.sqrt(PER_DAY), shape)
    spread = rng.chisquare(PER_DAY - 1, shape)  # (n - 1) s^2 for unit variance
    return PER_DAY * means, spread + PER_DAY * means**2


def bernoulli_days(rng, p: float) -> tuple[np.ndarray, np.ndarray]:
    hits = rng.binomial(PER_DAY, p, (EXPERIMENTS, LOOKS)).astype(float)
    return hits, hits


def looks(control, treatment) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every experiment at every look: the estimate, the sequence's bounds, and the plain z statistic."""
    (cs, cq), (ts, tq) = ([np.cumsum(a, axis=1) for a in arm] for arm in (control, treatment))
    n = PER_DAY * np.arange(1, LOOKS + 1)
    est, low, high, z = (np.empty((EXPERIMENTS, LOOKS)) for _ in range(4))
    for i in range(EXPERIMENTS):
        for j in range(LOOKS):
            c, t = Moments(int(n[j]), cs[i, j], cq[i, j]), Moments(int(n[j]), ts[i, j], tq[i, j])
            d = difference(c, t)
            assert d.low is not None and d.high is not None
            est[i, j], low[i, j], high[i, j] = d.estimate, d.low, d.high
            z[i, j] = d.estimate / math.sqrt(c.variance / c.n + t.variance / t.n)
    return est, low, high, z


@pytest.mark.parametrize("data", ["normal", "bernoulli"])
def test_a_a_peeked_daily_stays_within_alpha_where_a_t_test_does_not(data):
    rng = np.random.default_rng(20261202 + (data == "bernoulli"))
    draw = (lambda: normal_days(rng, 0.0)) if data == "normal" else (lambda: bernoulli_days(rng, 0.2))
    _, low, high, z = looks(draw(), draw())
    sequential = np.mean(np.any((low > 0) | (high < 0), axis=1))
    fixed = np.mean(np.any(np.abs(z) > 1.959964, axis=1))
    print(f"{data}: sequential {sequential:.4f}, daily t-test {fixed:.4f}")
    assert sequential <= ALPHA + tolerance(ALPHA)
    assert fixed > 0.10  # the inflation peeking causes in a fixed-horizon test
    assert fixed > sequential + 3 * tolerance(0.1)


def test_a_known_effect_is_covered_and_detected():
    rng = np.random.default_rng(7)
    effect = 0.1  # a tenth of a standard deviation
    _, low, high, _ = looks(normal_days(rng, 0.0), normal_days(rng, effect))
    covered = np.mean(np.all((low <= effect) & (effect <= high), axis=1))
    detected = np.mean(low[:, -1] > 0)
    wrong_way = np.mean(np.any(high < 0, axis=1))
    print(f"coverage at every look {covered:.4f}, better by day {LOOKS} {detected:.4f}")
    assert covered >= 1 - ALPHA - tolerance(ALPHA)
    assert detected >= 0.95
    assert wrong_way <= tolerance(ALPHA)

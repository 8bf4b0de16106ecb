"""A batch's histogram observations added at once read as if observed one at a time."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from sidecar.accounting.metering import observe_all
from sidecar.metrics import EXPERIMENT_DURATION


def test_observe_all_is_observe_one_at_a_time_to_the_last_bit():
    registry = CollectorRegistry()
    bounds = EXPERIMENT_DURATION._upper_bounds  # the metric it serves
    one = Histogram("one", "", ["arm"], buckets=bounds[:-1], registry=registry).labels("a")
    batch = Histogram("batch", "", ["arm"], buckets=bounds[:-1], registry=registry).labels("a")
    rng = random.Random(3)
    edges = [b for b in bounds if b != float("inf")]
    for _ in range(300):
        values = [rng.choice((rng.random() * 3, rng.expovariate(2.0), rng.choice(edges), 0.0, 1e6))
                  for _ in range(rng.randrange(1, 20))]
        for v in values:
            one.observe(v)
        observe_all(batch, values)
        assert batch._sum.get() == one._sum.get()  # (==: the same float, bit for bit)
        assert [b.get() for b in batch._buckets] == [b.get() for b in one._buckets]


def test_a_nan_is_in_no_bucket_as_observe_has_it():
    registry = CollectorRegistry()
    one = Histogram("one", "", buckets=(1.0,), registry=registry)
    batch = Histogram("batch", "", buckets=(1.0,), registry=registry)
    one.observe(float("nan"))
    observe_all(batch, [float("nan")])
    assert [b.get() for b in batch._buckets] == [b.get() for b in one._buckets] == [0.0, 0.0]

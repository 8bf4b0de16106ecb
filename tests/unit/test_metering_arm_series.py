"""An arm's series appear when they first move, whether or not they are looked up together."""

from __future__ import annotations

from sidecar import metrics
from sidecar.accounting.entries import Entry
from sidecar.accounting.metering import Meter


def _entry(experiment: str, prompt: int | None, completion: int | None, total_s: float | None) -> Entry:
    return Entry({"kind": "routed", "experiment": experiment, "variant": "v", "request_id": "r"},  # type: ignore[arg-type]
                 200, 0.0, None, total_s, prompt, completion, False, False)


def _series(experiment: str) -> set[str]:
    out = set()
    for metric in (metrics.EXPERIMENT_TOKENS, metrics.EXPERIMENT_DURATION):
        for family in metric.collect():
            out |= {f"{s.name}:{s.labels.get('kind', '')}" for s in family.samples
                    if s.labels.get("experiment") == experiment and not s.name.endswith(("_created", "_bucket"))}
    return out


def test_a_series_that_never_moved_does_not_appear():
    meter = Meter(lambda b, s: None)
    meter.record([_entry("series-a", 5, None, None), _entry("series-a", 3, None, None)])
    assert _series("series-a") == {"model_experiment_tokens_total:prompt"}
    meter.record([_entry("series-a", 1, 2, 0.5)])
    assert _series("series-a") == {"model_experiment_tokens_total:prompt", "model_experiment_tokens_total:completion",
                                   "model_experiment_request_duration_seconds_count:",
                                   "model_experiment_request_duration_seconds_sum:"}
    meter.record([_entry("series-a", 4, 6, 1.5)])  # (now looked up together)
    assert metrics.EXPERIMENT_TOKENS.labels("series-a", "v", "prompt")._value.get() == 13
    assert metrics.EXPERIMENT_TOKENS.labels("series-a", "v", "completion")._value.get() == 8
    assert metrics.EXPERIMENT_DURATION.labels("series-a", "v")._sum.get() == 2.0

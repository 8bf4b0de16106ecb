"""``bench/decision.py``'s access-log row accounts what the server accounts:
the decisions the router's handler sent Envoy for the bench's requests,
through the server's own meter (metrics, usage records and every observer),
so the row times the work a live entry costs, not a lighter stand-in."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson

from sidecar import metrics
from sidecar.experiments import srm
from sidecar.serve.runtime import Runtime
from sidecar.serve.server import meter_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import decision as bench  # noqa: E402


def _requests(experiment: str) -> float:
    return sum(
        s.value for m in metrics.EXPERIMENT_REQUESTS.collect() for s in m.samples
        if s.name.endswith("_total") and s.labels["experiment"] == experiment
    )


def test_each_entry_of_the_row_is_accounted_as_a_live_one(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(bench.CONFIG % bench.KEYS)
    usage = tmp_path / "usage.jsonl"
    runtime = Runtime(str(config), usage_records=str(usage))
    tracker = srm.Tracker(lambda: runtime.snapshot.config)
    meter = meter_of(runtime, tracker)
    decisions = bench.routed_decisions(runtime)
    sent = {d.fields["request_id"].string_value: d for d in decisions}
    assert len(sent) == bench.ALS_BATCH  # one decision per request, each its own

    before = _requests("chat-ab")
    bench.account(meter, bench.access_log_batch(decisions))

    # The usage record of each entry names the request and the arm its decision chose.
    records = [orjson.loads(line) for line in usage.read_bytes().splitlines()]
    assert sorted(r["request_id"] for r in records) == sorted(sent)
    for r in records:
        d = sent[r["request_id"]].fields
        assert (r["kind"], r["experiment_id"], r["experiment_variant_id"], r["caller"]) == (
            "routed", "chat-ab", d["variant"].string_value, d["caller"].string_value)
        assert (r["prompt_tokens"], r["completion_tokens"], r["estimated"]) == (24, 5, False)
    # The arm's metrics count each entry, and the sample-ratio observer sees each
    # distinct caller (it reads the decision's caller, which the accounting alone does not need).
    assert _requests("chat-ab") - before == bench.ALS_BATCH
    callers = {d.fields["caller"].string_value for d in decisions}
    assert sum(tracker.samples["chat-ab"].counts(time.time())) == len(callers) > 1

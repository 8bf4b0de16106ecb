"""Engine specs, the metrics parser on sample pages built from each engine's metric definitions, and the throughput rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config.engines import (
    ENGINES,
    EngineMetrics,
    compute_throughput,
    counter_throughput,
    decode_speed,
    parse_engine_metrics,
)

PAGES = Path(__file__).resolve().parents[1] / "data" / "engines"


def page(name: str) -> str:
    return (PAGES / f"{name}.prom").read_text(encoding="utf-8")


# page -> (engine, throughput series value, waiting, running), as a correct reading gives them.
EXPECTED = {
    "vllm-v1": ("vllm", 182345.0, 2.0, 7.0),  # _created and the by-reason sibling are not read
    "vllm-v1-dp-api-servers": ("vllm", 1200.0, 4.0, 9.0),  # engine="0","1": data-parallel ranks add up
    "vllm-v0": ("vllm", 9000.0, 1.0, 3.0),
    "sglang-default": ("sglang", 800.0, 6.0, 9.0),
    "sglang-priority-buckets": ("sglang", 800.0, 6.0, 9.0),  # the priority="" total, not total + buckets
    "sglang-dp": ("sglang", 772.5, 5.0, None),  # dp_rank="0","1" add up
    "sglang-tp-all-schedulers": ("sglang", 800.0, 6.0, None),  # one batch seen by two TP ranks counts once
    "tgi": ("tgi", 51234.0, 4.0, 12.0),  # tokens: the _sum of a histogram observed as requests end
    "llamacpp": ("llamacpp", 6789.0, 1.0, 3.0),  # the counter, not the per-request speed gauge
}
DECODE_SECONDS = {"llamacpp": 73.0}  # the decode-time counter beside the token counter


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_pages_read_as_their_engine(name):
    engine, throughput, waiting, running = EXPECTED[name]
    expected = EngineMetrics(engine, throughput, waiting, running, DECODE_SECONDS.get(name))
    assert parse_engine_metrics(page(name), ENGINES[engine]) == expected
    # A backend whose type names no engine reads the page of whichever engine it shows.
    assert parse_engine_metrics(page(name)) == expected


def test_a_page_of_another_engine_gives_nothing():
    assert parse_engine_metrics(page("sglang-default"), ENGINES["vllm"]) == EngineMetrics()
    assert parse_engine_metrics(page("vllm-v1"), ENGINES["sglang"]) == EngineMetrics()
    assert parse_engine_metrics(page("llamacpp"), ENGINES["tgi"]) == EngineMetrics()


def test_each_type_has_its_health_check_and_counter_kind():
    rules = {name: (e.health.kind, e.health.down_after, e.throughput.kind) for name, e in ENGINES.items()}
    assert rules == {
        "vllm": ("liveness", 1, "counter"),
        "sglang": ("generation", 2, "gauge"),
        "tgi": ("liveness", 1, "completion_counter"),
        "llamacpp": ("liveness", 1, "decode"),
    }


def test_a_breakdown_without_its_total_is_summed():
    text = (
        'sglang:num_queue_reqs{priority="le_4",tp_rank="0"} 4\n'
        'sglang:num_queue_reqs{priority="gt_4",tp_rank="0"} 2\n'
        # dp_rank 1 publishes its total: its breakdown is ignored, rank 0's is not.
        'sglang:num_queue_reqs{dp_rank="1",priority="",tp_rank="0"} 5\n'
        'sglang:num_queue_reqs{dp_rank="1",priority="1",tp_rank="0"} 5\n'
    )
    assert parse_engine_metrics(text, ENGINES["sglang"]).waiting == 11.0


def test_copies_count_once_at_their_maximum_per_data_parallel_rank():
    text = (
        'sglang:num_running_reqs{dp_rank="0",pp_rank="0",tp_rank="0"} 3\n'
        'sglang:num_running_reqs{dp_rank="0",pp_rank="0",tp_rank="1"} 3\n'
        'sglang:num_running_reqs{dp_rank="0",pp_rank="1",tp_rank="0"} 2\n'
        'sglang:num_running_reqs{dp_rank="1",pp_rank="0",tp_rank="0"} 4\n'
        'sglang:num_running_reqs{dp_rank="1",moe_ep_rank="1",pp_rank="0",tp_rank="0"} 4\n'
    )
    assert parse_engine_metrics(text, ENGINES["sglang"]).running == 7.0
    # prometheus_client's multiprocess "all" mode: one series per process, one real.
    per_process = (
        'vllm:num_requests_waiting{engine="0",pid="271"} 0\n'
        'vllm:num_requests_waiting{engine="0",pid="272"} 3\n'
        'vllm:num_requests_waiting{engine="1",pid="273"} 2\n'
    )
    assert parse_engine_metrics(per_process, ENGINES["vllm"]).waiting == 5.0


def test_missing_series_are_none():
    assert parse_engine_metrics("") == EngineMetrics()
    assert parse_engine_metrics("# just a comment\nprocess_cpu_seconds_total 1\n") == EngineMetrics()
    assert parse_engine_metrics("vllm:num_requests_waiting 2\n") == EngineMetrics("vllm", waiting=2.0)


def test_help_and_type_lines_are_not_needed_and_a_family_may_drop_total():
    untyped = 'vllm:generation_tokens_total{model_name="m"} 42\nvllm:num_requests_running 1\n'
    assert parse_engine_metrics(untyped) == EngineMetrics("vllm", throughput=42.0, running=1.0)
    openmetrics_style = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="m"} 42\n'
        'vllm:generation_tokens_created{model_name="m"} 1.7e9\n'
    )
    assert parse_engine_metrics(openmetrics_style, ENGINES["vllm"]).throughput == 42.0


def test_malformed_lines_and_non_finite_values_are_ignored():
    text = (
        "this is not prometheus text {{{\n"
        'vllm:num_requests_waiting{model_name="a"} 3\n'
        'vllm:num_requests_waiting{model_name="b" oops\n'
        'vllm:num_requests_waiting{model_name="c"} NaN\n'
        'vllm:num_requests_running{model_name="a"} +Inf\n'
        'vllm:generation_tokens_total{model_name="a"} 7 1700000000000\n'
    )
    assert parse_engine_metrics(text, ENGINES["vllm"]) == EngineMetrics("vllm", 7.0, 3.0, None)


# --------------------------------------------------------------------------- throughput rule


def test_throughput_fresh_pair():
    assert compute_throughput((10.0, 100.0), (12.0, 300.0), freshness_s=5) == pytest.approx(100.0)
    assert compute_throughput((10.0, 100.0), (12.0, 100.0), freshness_s=5) == 0.0


def test_throughput_needs_a_previous_scrape_and_time_order():
    assert compute_throughput(None, (12.0, 300.0), freshness_s=5) is None
    assert compute_throughput((12.0, 100.0), (12.0, 300.0), freshness_s=5) is None
    assert compute_throughput((13.0, 100.0), (12.0, 300.0), freshness_s=5) is None


def test_throughput_stale_pair_makes_no_statement():
    assert compute_throughput((10.0, 100.0), (15.0, 300.0), freshness_s=5) == pytest.approx(40.0)
    assert compute_throughput((10.0, 100.0), (15.5, 300.0), freshness_s=5) is None


def test_a_completion_counter_is_rated_over_the_freshness_window():
    # Readings every 2 s; 800 tokens counted when a request finished at t=10.
    history = ((2.0, 0.0), (4.0, 0.0), (6.0, 0.0), (8.0, 0.0))
    tps, kept = counter_throughput("completion_counter", history, (10.0, 800.0), freshness_s=7)
    assert tps == pytest.approx(800 / 6) and kept == ((4.0, 0.0), (6.0, 0.0), (8.0, 0.0), (10.0, 800.0))
    # Two seconds later nothing more finished: still 800 over the window, not a rate of 0.
    tps, kept = counter_throughput("completion_counter", kept, (12.0, 800.0), freshness_s=7)
    assert tps == pytest.approx(800 / 6) and kept[0] == (6.0, 0.0)
    # A counter that moves with generation is rated between two scrapes.
    assert counter_throughput("counter", kept, (14.0, 1000.0), freshness_s=7) == (100.0, ((14.0, 1000.0),))
    # A restart starts over.
    assert counter_throughput("completion_counter", kept, (14.0, 10.0), freshness_s=7) == (None, ((14.0, 10.0),))


def test_decode_speed_is_one_request_s_speed_over_the_window():
    # A slow engine: 2 requests of 100 tokens each finished at t=10, each took 10 s to decode.
    history = ((2.0, 0.0, 0.0), (6.0, 0.0, 0.0))
    speed, kept = decode_speed(history, (10.0, 200.0, 20.0), freshness_s=7)
    assert speed == pytest.approx(10.0)  # per request, not the 200 tokens / 8 s the engine made in all
    assert kept == ((6.0, 0.0, 0.0), (10.0, 200.0, 20.0))
    # Idle afterwards: the window counts no decode time, and the engine keeps its lifetime speed.
    speed, kept = decode_speed(kept, (20.0, 200.0, 20.0), freshness_s=7)
    assert speed == pytest.approx(10.0) and kept == ((20.0, 200.0, 20.0),)
    # Faster requests in the window rate the window alone.
    speed, kept = decode_speed(kept, (22.0, 1200.0, 22.0), freshness_s=7)
    assert speed == pytest.approx(500.0)
    # Never decoded: no figure. A restart starts over on the new counters.
    assert decode_speed((), (1.0, 0.0, 0.0), freshness_s=7) == (None, ((1.0, 0.0, 0.0),))
    assert decode_speed(kept, (24.0, 30.0, 0.5), freshness_s=7) == (pytest.approx(60.0), ((24.0, 30.0, 0.5),))


def test_throughput_counter_reset_waits_for_the_next_pair():
    assert compute_throughput((10.0, 5000.0), (12.0, 40.0), freshness_s=5) is None
    assert compute_throughput((12.0, 40.0), (14.0, 140.0), freshness_s=5) == pytest.approx(50.0)

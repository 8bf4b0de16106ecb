"""``bench/run.py`` judges the router's latency at 1 connection against the
trivial processor (both pay the same two gRPC round trips), and streams
whose client asks for usage at 0.9x bare Envoy, apart from streams where the
router adds and strips the usage event (0.95x)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import run as bench  # noqa: E402


def _verdicts(results: dict[tuple[str, str], list[dict]]) -> dict[str, bool | None]:
    runner = SimpleNamespace(results=results, decision={}, count_requests=500, openloop_rate=0.0, quick=False,
                             args=SimpleNamespace(one_process=False))
    table = bench.Table(runner)
    table.build()
    return {text.rsplit(": ", 1)[0]: met for text, met in table.verdicts}


P50 = "p50, 1 connection / model-router, experiment, 2 processes"


def _p50(bare_us: float, trivial_us: float, router_us: float) -> dict[tuple[str, str], list[dict]]:
    return {("c1", "bare"): [{"p50_us": bare_us}], ("c1", "minimal"): [{"p50_us": trivial_us}],
            ("c1", "router"): [{"p50_us": router_us}]}


def test_p50_is_judged_over_the_trivial_processor_not_bare_envoy() -> None:
    # 1.13 ms over bare Envoy, 0.25 ms over the trivial processor: met.
    assert _verdicts(_p50(220, 1100, 1350))[P50] is True
    # 0.35 ms over the trivial processor: not met, however close to bare Envoy.
    assert _verdicts(_p50(220, 400, 750))[P50] is False


def _streams(usage: float, added: float, client: float) -> dict[tuple[str, str], list[dict]]:
    return {("sse", "bare-sse"): [{"rps": 100.0}], ("sse", "router-up-usage"): [{"rps": usage}],
            ("sse", "router-up"): [{"rps": added}], ("sse", "router-client"): [{"rps": client}]}


def test_each_stream_case_has_its_own_bar() -> None:
    usage = "paced SSE streams/s, 32 connections / model-router, experiment, response_model: upstream, client asks for usage"
    added = ("paced SSE streams/s, 32 connections / model-router, experiment, response_model: upstream "
             "(router adds and strips the usage event)")
    client = "paced SSE streams/s, 32 connections / model-router, experiment, response_model: client"
    met = _verdicts(_streams(usage=91, added=94, client=76))
    assert (met[usage], met[added], met[client]) == (True, False, True)
    met = _verdicts(_streams(usage=89, added=96, client=74))
    assert (met[usage], met[added], met[client]) == (False, True, False)

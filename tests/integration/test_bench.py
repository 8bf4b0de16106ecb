"""The benchmark harness runs: every stack of ``bench/run.py`` (bare Envoy, the
trivial processor, the router with 2 processes, without its access log, with
1 process) and every load generator answer a few requests, and the report is
printed; ``bench/instructions.py`` counts every in-process row. Nothing here
judges a figure against a target: performance is what the full runs report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every configuration the quick run measures, as the table names it.
CONFIGURATIONS = (
    "bare Envoy",
    "trivial ext_proc, 2 processes",
    "model-router, experiment, 2 processes",
    "model-router, model without experiment, 2 processes",
    "model-router, experiment, access log removed, 2 processes",
    "model-router, experiment, 1 process",
    "model-router, experiment, response_model: upstream (router adds and strips the usage event)",
    "model-router, experiment, response_model: upstream, client asks for usage",
    "model-router, experiment, response_model: client",
    "model-router, model without experiment",
)


def _rows(report: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in report.splitlines() if line.startswith("| ") and not line.startswith("| case ")]


@pytest.mark.integration
def test_quick_run_measures_every_stack() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stdout
    assert "## model-router benchmark (quick run)" in report
    assert "All runs: 0 errors." in report, report
    rows = _rows(report)
    by_case: dict[str, set[str]] = {}
    for row in rows:
        by_case.setdefault(row[0], set()).add(row[1])
    throughput = by_case["req/s, 32 connections"]
    assert set(CONFIGURATIONS[:6]) <= throughput, throughput
    assert set(CONFIGURATIONS[:2] + CONFIGURATIONS[6:]) <= by_case["paced SSE streams/s, 32 connections"]
    assert set(CONFIGURATIONS[:2] + CONFIGURATIONS[6:]) <= by_case["TTFT p50, 1 connection"]
    assert any(case.startswith("p50, open loop") for case in by_case), sorted(by_case)
    # Every router configuration sent exactly 2 request messages per request, counted by Envoy.
    counted = [r for r in rows if r[0].startswith("ext_proc messages/request")]
    assert {r[1] for r in counted} == set(CONFIGURATIONS[1:6])
    assert all(r[3] == "2.000" for r in counted), counted
    # bench/decision.py ran: its in-process rows carry a figure, not an error.
    for case in ("in-process decision (bench/decision.py)", "access log: one entry in-process (bench/decision.py)"):
        row = next(r for r in rows if r[0] == case)
        assert re.fullmatch(r"[0-9.,]+ µs/(req|entry)", row[3]), row
    flushed = [r for r in rows if r[0] == "in-process ext_proc handler, caches flushed before each request (bench/decision.py)"]
    assert {r[1] for r in flushed} == {"model-router", CONFIGURATIONS[1]}, flushed
    assert all(re.fullmatch(r"[0-9.,]+ µs/req", r[3]) for r in flushed), flushed


@pytest.mark.integration
def test_instruction_counts_cover_every_in_process_row() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "instructions.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {}
    for line in done.stdout.splitlines()[2:]:
        found = re.fullmatch(r"(.+?)\s+([0-9,]+)\s*([0-9.]*)", line)
        assert found, line
        counts[found[1]] = int(found[2].replace(",", ""))
    decision = counts["decision: parse, gate, experiment, select, rewrite"]
    router = counts["ext_proc handler, 2 messages with protobuf (model-router)"]
    floor = counts["ext_proc handler, 2 messages (the contract's own work, no decision)"]
    trivial = counts["ext_proc handler, 2 messages (trivial processor)"]
    entry = counts["access-log entry, usage records off (the default)"]
    records = counts["access-log entry, usage records written"]
    # Each row counted its own operations: a handler that runs the decision
    # does more than one that does not, and a record written costs something.
    assert 0 < trivial < floor < router, counts
    assert 0 < decision < router - floor, counts
    assert 0 < entry < records, counts

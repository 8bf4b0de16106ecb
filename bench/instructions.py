"""Instructions per operation for the in-process rows of ``bench/decision.py``,
counted by callgrind: figures the machine's load does not move.

    .venv/bin/python bench/instructions.py            # about 2 minutes on 2 cores
    .venv/bin/python bench/instructions.py --quick    # few operations per row: checks it runs

Each row runs in its own ``valgrind --tool=callgrind`` process with counting
off; the process sets up and warms up, counts ``--count`` operations (turned
on and off with ``callgrind_control``), and the table divides by them, less
what turning the count on and off costs. ``PYTHONHASHSEED`` is fixed, so a
row gives the same figure run after run on one machine and build; compare
figures from one run of this script. Needs valgrind (``python -m
tests.support.servers`` installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
_COLLECTED = re.compile(r"Collected : (\d+)")
Run = Callable[[int], object]  # runs its operation n times


def _decision() -> Run:
    import decision as bench

    return _repeat(bench.decision_call())


def _runtime(usage: bool):  # type: ignore[no-untyped-def]
    import decision as bench

    return bench.bench_runtime(tempfile.mkdtemp(), usage_records=usage)


def _handler(which: str) -> Run:
    """Requests (both messages each) through a servicer's ``Process``, one
    after another on one event loop, as ``bench/decision.py`` drives them."""
    import decision as bench
    from minimal_extproc import MinimalProcessor

    from sidecar.handlers.extproc import Processor

    servicer = {"router": lambda: Processor(_runtime(usage=False)), "floor": bench.ContractFloor,
                "trivial": lambda: MinimalProcessor("pool-a", "llama-3.1-8b")}[which]()
    batch = bench.handler_batch(servicer)
    loop = asyncio.new_event_loop()
    return lambda n: loop.run_until_complete(batch(n))


def _access_log(usage: bool) -> Run:
    """One access-log message of ``ALS_BATCH`` entries, through the server's own meter."""
    import decision as bench

    from sidecar.experiments import srm
    from sidecar.serve.server import meter_of

    runtime = _runtime(usage)
    meter = meter_of(runtime, srm.Tracker(lambda: runtime.snapshot.config))
    raw = bench.access_log_batch(bench.routed_decisions(runtime))
    return _repeat(lambda: bench.account(meter, raw))


def _repeat(call: Callable[[], object]) -> Run:
    def run(n: int) -> None:
        for _ in range(n):
            call()

    return run


# name -> (what it counts, operations per call, setup returning the call)
ROWS: dict[str, tuple[str, int, Callable[[], Run]]] = {
    "decision": ("decision: parse, gate, experiment, select, rewrite", 1, _decision),
    "router": ("ext_proc handler, 2 messages with protobuf (model-router)", 1, lambda: _handler("router")),
    "floor": ("ext_proc handler, 2 messages (the contract's own work, no decision)", 1, lambda: _handler("floor")),
    "trivial": ("ext_proc handler, 2 messages (trivial processor)", 1, lambda: _handler("trivial")),
    "entry": ("access-log entry, usage records off (the default)", 16, lambda: _access_log(usage=False)),
    "entry-records": ("access-log entry, usage records written", 16, lambda: _access_log(usage=True)),
    "nothing": ("(turning the count on and off)", 1, lambda: _repeat(lambda: None)),
}


def _toggle(on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def child(row: str, count: int) -> None:
    """Inside valgrind: set up, warm up, then count ``count`` calls."""
    sys.path.insert(0, HERE)
    run = ROWS[row][2]()
    run(200)
    _toggle(True)
    run(count)
    _toggle(False)


def collected(row: str, count: int) -> int:
    """Instructions callgrind counted for ``count`` calls of ``row`` (with the toggling)."""
    with tempfile.TemporaryDirectory() as d:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={d}/out",
             sys.executable, os.path.abspath(__file__), "--row", row, "--count", str(count)],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
        )
    found = _COLLECTED.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"callgrind run of {row!r} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few operations per row (a smoke test)")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row is not None:
        child(args.row, args.count)
        return
    calls = 20 if args.quick else 1_000
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = dict(zip(ROWS, pool.map(lambda r: collected(r, calls if r != "nothing" else 0), ROWS)))
    toggling = counts.pop("nothing")
    per_op = {r: (n - toggling) / (calls * ROWS[r][1]) for r, n in counts.items()}
    trivial = per_op["trivial"]
    width = max(len(ROWS[r][0]) for r in per_op)
    print(f"{'step':<{width}}  instructions per operation  × trivial handler")
    print(f"{'-' * width}  --------------------------  -----------------")
    for r, n in per_op.items():
        ratio = f"{n / trivial:.2f}" if r in ("router", "floor", "trivial") else ""
        print(f"{ROWS[r][0]:<{width}}  {n:26,.0f}  {ratio:>17}")


if __name__ == "__main__":
    main()

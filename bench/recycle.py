"""What recycling workers costs: throughput and failures with and without it, side by side.

    .venv/bin/python bench/recycle.py                 # 30 s per case and round
    .venv/bin/python bench/recycle.py --seconds 10    # quicker, noisier

Starts three stacks (``sidecar.devstack.stack.Stack``: demo engines, the sidecar, the
real Envoy), the same config as ``bench/soak.py`` but for
``server.max_requests_per_worker``:

- ``never``: ``0``, one process that is never replaced (the baseline);
- ``default``: the product's default under the worker supervisor, which a run
  this short never reaches: what the supervisor itself costs;
- ``frequent``: ``--bound`` (default 2,000) under the supervisor, so workers
  are replaced every few seconds: what a recycle costs.

Each case drives closed-loop load (the soak's client threads and request mix,
every answer checked) for ``--seconds``, in the order A B C, then C B A, with
the stacks that are not measured idle. Prints one table: requests/s, the ratio
to ``never``, failed requests and the recycles that happened while measured
(counted in the supervisor's log). Every process started is
stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from soak import CONFIG, Load  # noqa: E402

from sidecar.devstack.stack import Stack  # noqa: E402


def recycles(stack: Stack) -> int:
    """Recycles so far: the worker supervisor logs each handover (none without it)."""
    return stack.log("sidecar-supervisor").count(" recycled: ")


def measure(stack: Stack, seconds: float, threads: int) -> tuple[float, int, int]:
    """(requests/s, failed requests, recycles during the run) of closed-loop load."""
    before = recycles(stack)
    load = Load(stack.url, threads, keys=5000)
    load.start()
    load.stop.wait(seconds)
    load.join()
    return load.total() / seconds, sum(load.errors.values()), recycles(stack) - before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30, help="closed-loop load per case and round (default 30)")
    ap.add_argument("--threads", type=int, default=4, help="client threads (default 4)")
    ap.add_argument("--bound", type=int, default=2000, help="max_requests_per_worker of the frequent case (default 2000)")
    args = ap.parse_args(argv)
    cases = {"never": 0, "default": None, "frequent": args.bound}
    stacks: dict[str, Stack] = {}
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory(prefix="model-router-recycle-") as tmp:
        try:
            for name, bound in cases.items():
                work = Path(tmp) / name
                work.mkdir()
                text = textwrap.dedent(CONFIG).lstrip()
                if bound is not None:
                    text = text.replace("admin_token: soak-admin}",
                                        f"admin_token: soak-admin, max_requests_per_worker: {bound}}}")
                config = work / "config.yaml"
                config.write_text(text)
                stacks[name] = Stack(config, workdir=work, supervised=bound != 0).start()
            order = list(cases)
            for round_ in (order, order[::-1]):
                for name in round_:
                    results[name].append(measure(stacks[name], args.seconds, args.threads))
                    rps, failed, n = results[name][-1]
                    print(f"recycle: {name}: {rps:.0f} req/s, {failed} failed, {n} recycles", flush=True)
        except KeyboardInterrupt:
            return 1
        finally:
            for stack in stacks.values():
                stack.stop()
    base = sum(r for r, _, _ in results["never"]) / len(results["never"])
    print(f"\n{args.threads} client threads, closed loop, {args.seconds:.0f} s per case and round, rounds A B C | C B A\n")
    print("| case | max_requests_per_worker | req/s (mean of 2) | vs never | failed | recycles |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, bound in cases.items():
        rows = results[name]
        rps = sum(r for r, _, _ in rows) / len(rows)
        label = "default (supervisor)" if bound is None else str(bound)
        print(f"| {name} | {label} | {rps:.0f} | {rps / base:.2f}x | {sum(f for _, f, _ in rows)} "
              f"| {sum(n for _, _, n in rows)} |")
    return 0 if all(f == 0 for rows in results.values() for _, f, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a 10% shadow arm costs the live path, and what a dead or silent candidate changes.

    .venv/bin/python bench/shadow.py              # 4 rounds of 8 s per config
    .venv/bin/python bench/shadow.py --seconds 3  # quicker

Four stacks (``sidecar.devstack.stack.Stack``: the real Envoy and one sidecar process),
the live arm on the same fast stub upstream (bench/fallback.py's): an
experiment with no shadow; the same with a shadow arm of share 0.1 on a second
fast stub; with the shadow's backend dead (nothing listens); and with it
silent (connections taken, never answered: every copy is held until the cap,
``max_in_flight: 16``, then dropped). A closed-loop client (keep-alive
connections, one request in flight each) runs against each in turn, rotating
the order every round, and the output is each config's throughput, p50 and p99
latency, the ratios to the no-shadow config, how many copies each made, and
the ext_proc messages Envoy sent the sidecar per client request (the copies'
streams included: the sidecar's extra work).
Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from fallback import closed_loop, ext_proc_messages, serve_upstream  # noqa: E402

from sidecar.devstack.stack import Stack, free_port  # noqa: E402

CONFIG = """
server: {{max_in_flight: 1024}}
monitor: {{enabled: false}}
backends:
  - {{name: live, url: "http://127.0.0.1:{live}", models: [plain-live]}}
  - {{name: cand, url: "http://127.0.0.1:{cand}", models: [plain-cand]}}
model_experiments:
  - name: bench
    model: plain
    variants:
      - {{id: control, model: plain-live, weight: 1}}
{shadow}"""
SHADOW = "      - {id: cand, model: plain-cand, shadow: {share: 0.1, max_in_flight: 16}}\n"


def silent_server() -> tuple[int, socket.socket]:
    """Takes connections and never answers (they stay open until the end)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    held = []

    def serve() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1], sock


def copies(stack: Stack) -> float:
    total = 0.0
    for text in stack.metrics_text():
        for line in text.splitlines():
            if line.startswith("model_experiment_shadow_copies_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=16)
    args = ap.parse_args()
    live, cand = free_port(), free_port()
    upstreams = [multiprocessing.Process(target=serve_upstream, args=(p,), daemon=True) for p in (live, cand)]
    for u in upstreams:
        u.start()
    silent, silent_sock = silent_server()
    configs = {
        "no shadow": (cand, ""),
        "10% shadow": (cand, SHADOW),
        "10% shadow, dead backend": (free_port(), SHADOW),
        "10% shadow, silent backend": (silent, SHADOW),
    }
    stacks: dict[str, Stack] = {}
    try:
        for name, (port, shadow) in configs.items():
            d = Path(tempfile.mkdtemp(prefix="bench-shadow-"))
            (d / "config.yaml").write_text(CONFIG.format(live=live, cand=port, shadow=shadow))
            stacks[name] = Stack(d / "config.yaml", workdir=d, sidecars=1).start()
        for s in stacks.values():  # every stack answers before any is measured
            assert httpx.post(s.url + "/v1/chat/completions", json={"model": "plain", "messages": []}).status_code == 200
        results: dict[str, list[dict]] = {n: [] for n in stacks}
        messages = {n: 0 for n in stacks}
        order = list(stacks)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                before = ext_proc_messages(stacks[name])
                results[name].append(asyncio.run(closed_loop(stacks[name].listen, args.connections, args.seconds)))
                messages[name] += ext_proc_messages(stacks[name]) - before
        base = results["no shadow"]
        print(f"| config | req/s (median of {args.rounds}) | p50 ms | p99 ms | errors | copies / request "
              "| ext_proc msgs / request | req/s ratio | p50 ratio | p99 ratio |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, runs in results.items():
            def med(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(x[key] for x in runs)

            def ratio(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(y[key] / x[key] for x, y in zip(base, runs))

            total = max(sum(x["total"] for x in runs), 1)
            share = copies(stacks[name]) / total
            print(f"| {name} | {med('rps'):.0f} | {med('p50_ms'):.2f} | {med('p99_ms'):.2f} | "
                  f"{sum(x['errors'] for x in runs)} | {share:.3f} | {messages[name] / total:.2f} "
                  f"| {ratio('rps'):.3f} | {ratio('p50_ms'):.3f} "
                  f"| {ratio('p99_ms'):.3f} |")
        print("\nratios: the median over rounds of (config / no shadow) in the same round")
        return 0
    finally:
        for s in stacks.values():
            s.close()
        for u in upstreams:
            u.terminate()
            u.join(5)
        silent_sock.close()


if __name__ == "__main__":
    sys.exit(main())

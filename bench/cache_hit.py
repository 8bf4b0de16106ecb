"""Cache-hit benchmark: requests/s of a response-cache hit against bare Envoy.

    .venv/bin/python bench/cache_hit.py              # 10 s per case and round
    .venv/bin/python bench/cache_hit.py --seconds 3  # smoke test

One run starts, on free 127.0.0.1 ports, the model-router stack
(``sidecar.devstack.stack.Stack``: the real Envoy, 2 sidecar processes, a demo engine)
with ``cache: {}``, and a bare Envoy (the same bootstrap with every router
piece removed, see ``bench/run.py``) in front of the same demo engine. The
same ~200 B chat completion is sent by a closed-loop generator in its own
process (keep-alive connections, one request in flight on each) to:

- bare Envoy, answered by the demo engine;
- the router with ``cache-control: no-store`` (decided, sent upstream, not cached);
- the router, answered from the cache (a hit: no upstream call).

Each case runs in order in round 1 and in reverse in round 2 (A B C | C B A);
the table shows the mean of the two rounds and the ratio to bare Envoy.
Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _http  # noqa: E402

CONFIG = """
server: {message_timeout_ms: 2000}
backends:
  - {name: engine, url: "demo://", models: [m]}
cache: {}
"""


def request(host: str, no_store: bool) -> bytes:
    body = _http.chat_body("m")
    extra = "cache-control: no-store\r\n" if no_store else ""
    head = (f"POST {_http.PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


# --------------------------------------------------------------------------- load (its own process)


async def _load(target: str, connections: int, seconds: float, no_store: bool) -> dict:
    import uvloop  # noqa: F401  (the event loop is chosen by the caller)

    host, _, port = target.rpartition(":")
    payload = request(target, no_store)
    counts = {"ok": 0, "errors": 0}
    stop_at = time.monotonic() + seconds

    async def one() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        parser = _http.ResponseParser()
        try:
            while time.monotonic() < stop_at:
                writer.write(payload)
                done: list[int] = []
                while not done:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed")
                    done = parser.feed(data)
                for status in done:
                    counts["ok" if status < 400 else "errors"] += 1
        finally:
            writer.close()

    started = time.monotonic()
    await asyncio.gather(*(one() for _ in range(connections)))
    return {**counts, "rps": counts["ok"] / (time.monotonic() - started)}


def load_main(argv: list[str]) -> None:
    import uvloop

    p = argparse.ArgumentParser()
    p.add_argument("--target")
    p.add_argument("--connections", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--no-store", action="store_true")
    a = p.parse_args(argv)
    print("LOAD " + json.dumps(uvloop.run(_load(a.target, a.connections, a.seconds, a.no_store))), flush=True)


def run_load(target: str, connections: int, seconds: float, no_store: bool = False) -> dict:
    argv = [sys.executable, __file__, "--load", "--target", target, "--connections", str(connections),
            "--seconds", str(seconds)] + (["--no-store"] if no_store else [])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("LOAD ")), None)
    if line is None:
        raise RuntimeError(f"load generator failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(line[5:])


# --------------------------------------------------------------------------- the run


def _hits(stack) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for text in stack.metrics_text() for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "model_router_cache_hits_total")


def main() -> None:
    import run as bench_run

    from sidecar.config import schema as config_mod
    from sidecar.deploy import envoy as envoyconf
    from sidecar.devstack.stack import Stack

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--connections", type=int, default=16)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mr-cache-bench-"))
    cfg_path = work / "config.yaml"
    cfg_path.write_text(CONFIG)
    procs = bench_run.Procs(work)
    stack = Stack(cfg_path, workdir=work, sidecars=2)
    try:
        stack.start()
        config = config_mod.load(cfg_path).config
        boot = envoyconf.bootstrap(config, standby=False, sidecar_addresses=stack.sidecar_grpc,
                                   backend_urls={"engine": stack.demo_urls["engine"]})
        bare, _, _ = bench_run.start_envoy(procs, work, "bare", bench_run.bare_bootstrap(boot, "engine"))
        router = stack.listen
        cases = [("bare Envoy -> demo engine", bare, False),
                 ("router, not cached (no-store) -> demo engine", router, True),
                 ("router, cache hit (no upstream call)", router, False)]
        for _, target, no_store in cases:  # warm up: connections, and the entry in both sidecars
            run_load(target, args.connections, 2, no_store)
        results: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        errors: dict[str, int] = {name: 0 for name, _, _ in cases}
        hits: dict[str, float] = {name: 0.0 for name, _, _ in cases}
        for order in (cases, cases[::-1]):
            for name, target, no_store in order:
                before = _hits(stack)
                r = run_load(target, args.connections, args.seconds, no_store)
                results[name].append(r["rps"])
                errors[name] += r["errors"]
                hits[name] += (_hits(stack) - before) / max(r["ok"], 1) / 2
        base = sum(results[cases[0][0]]) / 2
        print(f"\ncache-hit bench: {args.connections} connections, {args.seconds:g} s per case and round, "
              f"2 sidecar processes, Envoy concurrency {config.envoy.concurrency}\n")
        print("| case | requests/s (round 1, round 2) | mean | vs bare Envoy | cache hits per request | errors |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, _, _ in cases:
            r1, r2 = results[name]
            mean = (r1 + r2) / 2
            print(f"| {name} | {r1:,.0f}, {r2:,.0f} | {mean:,.0f} | {mean / base:.2f}x | {hits[name]:.2f} "
                  f"| {errors[name]} |")
    finally:
        procs.stop_all()
        stack.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load"]:
        load_main(sys.argv[2:])
    else:
        main()

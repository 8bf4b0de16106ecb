"""Big-body benchmark: other requests' latency while one client sends huge JSON.

    .venv/bin/python bench/big_bodies.py              # 20 s per case
    .venv/bin/python bench/big_bodies.py --seconds 5  # smoke test

One run starts, on free 127.0.0.1 ports, the model-router stack
(``sidecar.devstack.stack.Stack``: the real Envoy, one sidecar process, a demo engine)
and a bare Envoy (the same bootstrap with every router piece removed, see
``bench/run.py``) in front of the same demo engine. A victim client sends a
small chat completion, one at a time on a keep-alive connection, and records
each latency:

- to bare Envoy (the floor);
- to the router, quiet;
- to the router while an attacker (its own process, two connections) sends
  30 MiB JSON bodies of three million top-level members back to back.

The table shows p50, p99 and the worst latency per case, the ratio of each p99
to the quiet router's, and what the attacker got. Only the victim's requests
are timed. Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
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
backends:
  - {name: engine, url: "demo://", models: [m]}
"""
MEMBERS = 3_000_000


def attack_body() -> bytes:
    """About 30 MiB: a routable request padded with three million members."""
    pad = b",".join(b'"%06x":1' % i for i in range(MEMBERS))
    return b'{"model":"m","messages":[{"role":"user","content":"hi"}],' + pad + b"}"


# --------------------------------------------------------------------------- the attacker (its own process)


def _attack_one(host: str, port: int, payload: bytes, stop_at: float, out: dict) -> None:
    while time.monotonic() < stop_at:
        try:
            with socket.create_connection((host, port), timeout=120) as s:
                s.sendall(payload)
                data = b""
                while b"\r\n" not in data:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
        except OSError as exc:
            status = type(exc).__name__
        out[status] = out.get(status, 0) + 1


def attack_main(argv: list[str]) -> None:
    import threading

    target, seconds, connections = argv[0], float(argv[1]), int(argv[2])
    host, _, port = target.rpartition(":")
    body = attack_body()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    payload = head + body
    print("READY", flush=True)
    stop_at = time.monotonic() + seconds
    out: dict[str, int] = {}
    threads = [threading.Thread(target=_attack_one, args=(host, int(port), payload, stop_at, out))
               for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("ATTACK " + json.dumps({"bytes": len(body), "statuses": out}), flush=True)


# --------------------------------------------------------------------------- the victim


async def victim(target: str, seconds: float) -> dict:
    host, _, port = target.rpartition(":")
    body = _http.chat_body("m")
    payload = (f"POST {_http.PATH} HTTP/1.1\r\nHost: {target}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    reader, writer = await asyncio.open_connection(host, int(port))
    parser = _http.ResponseParser()
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds
    try:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            writer.write(payload)
            done: list[int] = []
            while not done:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("closed")
                done = parser.feed(data)
            latencies.append(time.perf_counter() - started)
            errors += sum(status >= 400 for status in done)
    finally:
        writer.close()
    latencies.sort()
    return {"n": len(latencies), "errors": errors, "p50": _http.percentile(latencies, 50),
            "p99": _http.percentile(latencies, 99), "max": latencies[-1]}


def measure(target: str, seconds: float, attack_on: str | None) -> tuple[dict, dict | None]:
    attacker = None
    if attack_on is not None:
        attacker = subprocess.Popen([sys.executable, __file__, "--attack", attack_on, str(seconds + 2), "2"],
                                    stdout=subprocess.PIPE, text=True)
        assert attacker.stdout is not None
        while attacker.stdout.readline().strip() != "READY":  # the body is built before the clock starts
            if attacker.poll() is not None:
                raise RuntimeError("the attacker could not start")
        time.sleep(2)  # the first bodies are in flight
    try:
        result = asyncio.run(victim(target, seconds))
    finally:
        attack = None
        if attacker is not None:
            out, _ = attacker.communicate(timeout=seconds + 180)
            line = next((ln for ln in out.splitlines() if ln.startswith("ATTACK ")), None)
            attack = json.loads(line[7:]) if line else None
    return result, attack


def main() -> None:
    import run as bench_run

    from sidecar.config import schema as config_mod
    from sidecar.deploy import envoy as envoyconf
    from sidecar.devstack.stack import Stack

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mr-big-bodies-"))
    cfg_path = work / "config.yaml"
    cfg_path.write_text(CONFIG)
    procs = bench_run.Procs(work)
    stack = Stack(cfg_path, workdir=work, sidecars=1)
    try:
        stack.start()
        config = config_mod.load(cfg_path).config
        boot = envoyconf.bootstrap(config, standby=False, sidecar_addresses=stack.sidecar_grpc,
                                   backend_urls={"engine": stack.demo_urls["engine"]})
        bare, _, _ = bench_run.start_envoy(procs, work, "bare", bench_run.bare_bootstrap(boot, "engine"))
        router = stack.listen
        measure(router, 2, None)  # warm up
        cases = [("bare Envoy, quiet", bare, None), ("router, quiet", router, None),
                 ("router, under big bodies", router, router)]
        rows = [(name, *measure(target, args.seconds, attack)) for name, target, attack in cases]
        quiet = rows[1][1]["p99"]
        print(f"\nbig-body bench: {args.seconds:g} s per case, one sidecar process, Envoy concurrency "
              f"{config.envoy.concurrency}; attacker: 2 connections of {MEMBERS:,}-member bodies\n")
        print("| case | victim requests | p50 ms | p99 ms | max ms | p99 vs quiet router | victim errors "
              "| attacker's answers |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, r, attack in rows:
            got = "" if attack is None else (f"{sum(attack['statuses'].values())} bodies of "
                                             f"{attack['bytes'] / 2**20:.1f} MiB: {attack['statuses']}")
            print(f"| {name} | {r['n']} | {r['p50'] * 1000:.2f} | {r['p99'] * 1000:.2f} | {r['max'] * 1000:.1f} "
                  f"| {r['p99'] / quiet:.2f}x | {r['errors']} | {got} |")
    finally:
        procs.stop_all()
        stack.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--attack"]:
        attack_main(sys.argv[2:])
    else:
        main()

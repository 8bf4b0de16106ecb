"""What fallback after a failed attempt costs a request that does not fail.

    .venv/bin/python bench/fallback.py              # 4 rounds of 8 s per config
    .venv/bin/python bench/fallback.py --seconds 3  # quicker

Two stacks (``sidecar.devstack.stack.Stack``: the real Envoy and one sidecar process)
in front of the same fast stub upstream (asyncio, a fixed chat completion):
one config without ``fallback_chains``, and the same config with a chain for
the model the load asks for, so every request is routed through a composite
cluster and its hop filter is skipped. A closed-loop client (asyncio, keep-alive
connections, one request in flight per connection) runs against each in turn,
A B B A ..., and the output is each config's throughput and median latency,
the ratios B / A, and Envoy's ext_proc messages per request for each. Every
process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _http  # noqa: E402
import httpx  # noqa: E402

from sidecar.devstack.stack import Stack, free_port  # noqa: E402

_BODY = (b'{"id":"chatcmpl-1","object":"chat.completion","created":1700000000,"model":"plain",'
         b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, friend."},'
         b'"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13}}')
_REPLY = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
          + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)

CONFIG = """
server: {{max_in_flight: 1024}}
monitor: {{enabled: false}}
backends:
  - {{name: fast, url: "http://127.0.0.1:{port}", models: [plain]}}
  - {{name: spare, url: "http://127.0.0.1:{port}", models: [plain-2]}}
{chains}
"""
CHAINS = "fallback_chains: {plain: [plain-2]}"


class _Upstream(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].lower()
            pos = head.find(b"content-length:")
            length = int(head[pos + 15:].split(b"\r\n", 1)[0]) if pos >= 0 else 0
            if len(self.buf) < head_end + 4 + length:
                return
            self.buf = self.buf[head_end + 4 + length:]
            self.transport.write(_REPLY)


def serve_upstream(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


class _Client(asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        self.run = run
        self.parser = _http.ResponseParser()

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.send()

    def send(self) -> None:
        self.sent = time.monotonic()
        self.transport.write(self.run.next_request())

    def data_received(self, data: bytes) -> None:
        for status in self.parser.feed(data):
            self.run.done(status, time.monotonic() - self.sent)
            if not self.run.stopped:
                self.send()


class _Run:
    def __init__(self, requests: list[bytes]) -> None:
        self.requests, self.i = requests, 0
        self.latencies: list[float] = []
        self.errors = 0
        self.total = 0  # every response, warm-up included
        self.stopped = False

    def next_request(self) -> bytes:
        self.i += 1
        return self.requests[self.i % len(self.requests)]

    def done(self, status: int, latency: float) -> None:
        self.latencies.append(latency)
        self.total += 1
        self.errors += status != 200


async def closed_loop(listen: str, connections: int, seconds: float) -> dict:
    host, _, port = listen.rpartition(":")
    run = _Run(_http.chat_requests(listen, "plain", 64))
    loop = asyncio.get_running_loop()
    conns = [await loop.create_connection(lambda: _Client(run), host, int(port)) for _ in range(connections)]
    await asyncio.sleep(1.0)  # warm-up
    run.latencies.clear()
    start = time.monotonic()
    await asyncio.sleep(seconds)
    run.stopped = True
    elapsed = time.monotonic() - start
    count = len(run.latencies)
    for transport, _ in conns:
        transport.close()
    lat = sorted(run.latencies)
    return {"rps": count / elapsed, "p50_ms": statistics.median(lat) * 1000 if count else 0.0,
            "p99_ms": lat[min(count - 1, int(0.99 * count))] * 1000 if count else 0.0,
            "errors": run.errors, "count": count, "total": run.total}


def ext_proc_messages(stack: Stack) -> int:
    text = httpx.get(f"http://{stack.envoy_admin}/stats", params={"filter": "stream_msgs_sent"}).text
    return sum(int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if v.strip().isdigit())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--connections", type=int, default=16)
    args = ap.parse_args()
    import multiprocessing

    port = free_port()
    upstream = multiprocessing.Process(target=serve_upstream, args=(port,), daemon=True)
    upstream.start()
    stacks: dict[str, Stack] = {}
    try:
        for name, chains in (("without chains", ""), ("with chains", CHAINS)):
            d = Path(tempfile.mkdtemp(prefix="bench-fallback-"))
            (d / "config.yaml").write_text(CONFIG.format(port=port, chains=chains))
            stacks[name] = Stack(d / "config.yaml", workdir=d, sidecars=1).start()
        results: dict[str, list[dict]] = {n: [] for n in stacks}
        messages: dict[str, float] = {}
        order = list(stacks)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                before = ext_proc_messages(stacks[name])
                res = asyncio.run(closed_loop(stacks[name].listen, args.connections, args.seconds))
                sent = ext_proc_messages(stacks[name]) - before
                messages[name] = sent / max(res["total"], 1)
                results[name].append(res)
        print(f"| config | req/s (median of {args.rounds}) | p50 ms | errors | ext_proc msgs/req |")
        print("| --- | --- | --- | --- | --- |")
        for name, runs in results.items():
            rps = statistics.median(x["rps"] for x in runs)
            p50 = statistics.median(x["p50_ms"] for x in runs)
            print(f"| {name} | {rps:.0f} | {p50:.2f} | {sum(x['errors'] for x in runs)} | {messages[name]:.2f} |")
        a, b = results["without chains"], results["with chains"]
        pairs = [y["rps"] / x["rps"] for x, y in zip(a, b)]
        lat = [y["p50_ms"] / x["p50_ms"] for x, y in zip(a, b)]
        print(f"\nper-round throughput ratios with/without: {' '.join(f'{r:.3f}' for r in pairs)}")
        print(f"median throughput ratio: {statistics.median(pairs):.3f}; median p50 ratio: {statistics.median(lat):.3f}")
        return 0
    finally:
        for s in stacks.values():
            s.close()
        upstream.terminate()
        upstream.join(5)


if __name__ == "__main__":
    sys.exit(main())

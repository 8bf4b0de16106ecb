"""Open-loop HTTP load at a fixed rate over keep-alive connections (wrk2-style pacing).

    .venv/bin/python bench/openloop.py --target 127.0.0.1:8080 --rate 1500 --duration 10 --warmup 2

Request ``i`` is due at ``start + i / rate`` whatever happened to earlier
requests. A pacing loop wakes about every millisecond and hands every due
request to an idle connection; when all connections are busy, due requests
wait in a queue, and that wait counts in their latency. Latency runs from the
moment the pacing loop took the request up to the last byte of its response.
The pacing lag (how late the loop took requests up after they fell due) is
reported separately, so a generator that could not keep up is visible.

Prints one line ``OPENLOOP {json}``: requests sent and completed in the
measured window, errors (status >= 400, socket errors, timeouts), latency
percentiles in microseconds, the achieved rate, pacing lag and the
generator's own CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import resource
import socket
import sys
import time

import _http
import uvloop


class Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.parser = _http.ResponseParser()
        self.transport: asyncio.Transport | None = None
        self.current: tuple[float, bool] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, request: bytes, taken: float, measured: bool) -> None:
        self.current = (taken, measured)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        try:
            statuses = self.parser.feed(data)
        except _http.ParseError:
            self.gen.socket_errors += 1
            self.transport.close()
            return
        for status in statuses:
            now = time.monotonic()
            taken, measured = self.current
            self.current = None
            self.gen.completed_one(self, status, now - taken, measured)

    def connection_lost(self, exc) -> None:
        self.gen.lost(self)


class Generator:
    def __init__(self, host: str, port: int, requests: list[bytes], connections: int) -> None:
        self.host, self.port = host, port
        self.requests = requests
        self.connections = connections
        self.idle: collections.deque[Conn] = collections.deque()
        self.queue: collections.deque[tuple[float, bool]] = collections.deque()
        self.next_request = 0
        self.latencies: list[float] = []
        self.lags: list[float] = []
        self.sent = 0
        self.completed = 0
        self.completed_all = 0
        self.status_errors = 0
        self.socket_errors = 0
        self.reconnects = 0
        self.outstanding = 0
        self.stopping = False

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        transport, conn = await loop.create_connection(lambda: Conn(self), self.host, self.port)
        self.idle.append(conn)

    def dispatch(self, conn: Conn) -> None:
        taken, measured = self.queue.popleft()
        request = self.requests[self.next_request % len(self.requests)]
        self.next_request += 1
        if measured:
            self.sent += 1
        self.outstanding += 1
        conn.send(request, taken, measured)

    def completed_one(self, conn: Conn, status: int, latency: float, measured: bool) -> None:
        self.outstanding -= 1
        self.completed_all += 1
        if measured:
            self.completed += 1
            self.latencies.append(latency)
            if status >= 400:
                self.status_errors += 1
        if not conn.parser.keep_alive:
            conn.transport.close()
            return
        if self.queue:
            self.dispatch(conn)
        else:
            self.idle.append(conn)

    def lost(self, conn: Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        if conn.current is not None:
            self.outstanding -= 1
            if conn.current[1]:
                self.socket_errors += 1
            conn.current = None
        if not self.stopping:
            self.reconnects += 1
            asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            await self.connect()
        except OSError:
            self.socket_errors += 1
            return
        conn = self.idle.pop()
        if self.queue:
            self.dispatch(conn)
        else:
            self.idle.append(conn)

    async def run(self, rate: float, duration: float, warmup: float, drain: float) -> dict:
        for _ in range(self.connections):
            await self.connect()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic() + 0.01
        measure_from = start + warmup
        end = measure_from + duration
        i = 0
        while True:
            now = time.monotonic()
            due = start + i / rate
            if due >= end:
                break
            if due > now:
                await asyncio.sleep(max(due - now, 0.001))
                continue
            while due <= now and due < end:
                measured = due >= measure_from
                self.queue.append((now, measured))
                if measured:
                    self.lags.append(now - due)
                i += 1
                due = start + i / rate
            while self.queue and self.idle:
                self.dispatch(self.idle.popleft())
        deadline = time.monotonic() + drain
        while (self.queue or self.outstanding > 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        unfinished = len(self.queue) + max(self.outstanding, 0)
        self.stopping = True
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        lat = sorted(self.latencies)
        lags = sorted(self.lags)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        return {
            "rate": rate,
            "duration_s": duration,
            "connections": self.connections,
            "sent": self.sent,
            "completed": self.completed,
            "completed_all": self.completed_all,
            "achieved_rps": self.completed / duration,
            "status": self.status_errors,
            "socket": self.socket_errors,
            "timeout": unfinished,
            "reconnects": self.reconnects,
            "p50_us": _http.percentile(lat, 50) * 1e6,
            "p90_us": _http.percentile(lat, 90) * 1e6,
            "p99_us": _http.percentile(lat, 99) * 1e6,
            "p999_us": _http.percentile(lat, 99.9) * 1e6,
            "max_us": (lat[-1] if lat else 0.0) * 1e6,
            "lag_p50_us": _http.percentile(lags, 50) * 1e6,
            "lag_p99_us": _http.percentile(lags, 99) * 1e6,
            "generator_cpu_pct": 100.0 * cpu / (duration + warmup),
        }


async def amain(args) -> dict:
    host, _, port = args.target.rpartition(":")
    requests = _http.chat_requests(args.target, args.model, args.keys)
    gen = Generator(host, int(port), requests, args.connections)
    return await gen.run(args.rate, args.duration, args.warmup, args.drain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the HTTP listener")
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds at the same rate before measuring")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--model", default="chat")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--drain", type=float, default=5.0, help="seconds to wait for responses after the last send")
    args = parser.parse_args()
    result = uvloop.run(amain(args))
    print("OPENLOOP " + json.dumps(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()

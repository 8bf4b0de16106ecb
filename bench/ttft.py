"""Time to first token of paced SSE chat completions, sequential on one keep-alive connection.

    .venv/bin/python bench/ttft.py --target 127.0.0.1:8080 --model chat-stream --count 150

Each request is sent, then the response is read to its end. TTFT is the time
from sending the request to the arrival of the first ``data:`` line of the
body; the total is the time to the end of the stream. API keys rotate as in
``chat.lua``; the first ``--warmup`` requests are not counted.

Prints one line ``TTFT {json}`` with counts, errors and percentiles in
microseconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import _http


def run(args) -> dict:
    host, _, port = args.target.rpartition(":")
    requests = _http.chat_requests(
        args.target, args.model, args.keys, stream=True, events=args.events, interval_ms=args.interval_ms,
        include_usage=args.include_usage,
    )
    sock: socket.socket | None = None
    ttfts: list[float] = []
    totals: list[float] = []
    errors = {"status": 0, "socket": 0, "timeout": 0, "no_data": 0}
    deadline = time.monotonic() + args.max_seconds
    total = args.warmup + args.count
    done = 0
    done_all = 0
    for n in range(total):
        if time.monotonic() > deadline:
            break
        measured = n >= args.warmup
        if sock is None:
            sock = socket.create_connection((host, int(port)), timeout=args.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        first: list[float] = []
        seen = bytearray()

        def on_body(piece: bytes, first: list[float] = first, seen: bytearray = seen) -> None:
            if first:
                return
            seen.extend(piece)
            if b"data:" in seen:
                first.append(time.perf_counter())

        parser = _http.ResponseParser(on_body)
        request = requests[n % len(requests)]
        t0 = time.perf_counter()
        status = None
        try:
            sock.sendall(request)
            while status is None:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("connection closed mid-response")
                statuses = parser.feed(data)
                if statuses:
                    status = statuses[0]
        except TimeoutError:
            if measured:
                errors["timeout"] += 1
            sock.close()
            sock = None
            continue
        except (OSError, _http.ParseError):
            if measured:
                errors["socket"] += 1
            if sock is not None:
                sock.close()
            sock = None
            continue
        t_end = time.perf_counter()
        if not parser.keep_alive:
            sock.close()
            sock = None
        done_all += 1
        if not measured:
            continue
        done += 1
        if status >= 400:
            errors["status"] += 1
            continue
        if not first:
            errors["no_data"] += 1
            continue
        ttfts.append(first[0] - t0)
        totals.append(t_end - t0)
    if sock is not None:
        sock.close()
    ttfts.sort()
    totals.sort()
    return {
        "requests": done,
        "requests_all": done_all,
        "ok": len(ttfts),
        **errors,
        "ttft_p50_us": _http.percentile(ttfts, 50) * 1e6,
        "ttft_p90_us": _http.percentile(ttfts, 90) * 1e6,
        "ttft_p99_us": _http.percentile(ttfts, 99) * 1e6,
        "total_p50_us": _http.percentile(totals, 50) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the HTTP listener")
    parser.add_argument("--model", default="chat-stream")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--count", type=int, default=150, help="measured requests")
    parser.add_argument("--warmup", type=int, default=10, help="requests sent first and not counted")
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--interval-ms", type=int, default=1)
    parser.add_argument("--include-usage", action="store_true", help='send "stream_options":{"include_usage":true}')
    parser.add_argument("--timeout", type=float, default=10.0, help="socket timeout per request")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop sending after this long")
    args = parser.parse_args()
    print("TTFT " + json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()

"""Bounded soak: steady load through the real Envoy, watching the sidecar's memory.

    .venv/bin/python bench/soak.py                              # 3 minutes, closed loop
    .venv/bin/python bench/soak.py --seconds 3600 --rate half   # an hour at half the saturation
    .venv/bin/python bench/soak.py --recycle 100000             # under the worker supervisor

Starts a ``sidecar.devstack.stack.Stack`` (two demo engines, one sidecar process, the
real Envoy) with an active experiment (sticky by API key, ``response_model:
client``, attribution headers), then a few client threads send buffered and
streamed chat completions (with and without ``stream_options.include_usage``)
and Anthropic messages, each with a caller key drawn from a large pool so
per-caller state, if any, would grow (``--keys N`` cycles a pool of N keys
instead). ``--rate`` paces them (``half``: half of what the stack answers
closed-loop over 20 s, measured first). Every ``--interval`` seconds it
samples the sidecar's VmRSS and, from ``/admin/memory``, Python's allocated
blocks, tracked objects and (``--tracemalloc``) traced bytes: a growing RSS
with a flat Python heap is native memory.

Verdict: FLAT when the mean RSS of the last five samples is less than 5 MB
above that of the first five after the warm-up (``--warmup``, default a
quarter of the run); the least-squares slope of RSS per request is printed
with it. Exit status 0 when flat and every request succeeded, 1 otherwise.
The run stops by itself after ``--seconds`` (also on Ctrl-C or SIGTERM) and
stops every process it started.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar.devstack.stack import Stack  # noqa: E402

CONFIG = """
server: {max_body_bytes: 1048576, admin_token: soak-admin}
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_experiments:
  - name: soak
    model: chat
    sticky_key: api_key
    response_model: client
    response_headers: true
    variants:
      - {id: control, model: model-a, weight: 80}
      - {id: candidate, model: model-b, weight: 20}
"""

MESSAGES = [{"role": "user", "content": "soak the router with a few words of text"}]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sidecar_rss_kb(stack: Stack) -> int:
    """The sidecar's RSS; under the worker supervisor, its workers' (a draining one included)."""
    proc = stack._procs.get("sidecar-0") or stack._procs["sidecar-supervisor"]
    pid = proc.popen.pid
    if "sidecar-0" in stack._procs:
        return rss_kb(pid)
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sum(rss_kb(int(k)) for k in kids)


class Load:
    """Client threads with shared counters; each request is checked, not just sent."""

    def __init__(self, url: str, threads: int, keys: int = 0, rate: float = 0.0) -> None:
        self.url = url
        self.keys = keys
        self.interval = threads / rate if rate > 0 else 0.0  # per thread; 0: as fast as answers come
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 30) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=timeout)

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def _record(self, kind: str, error: str | None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if error:
                self.errors[f"{kind}: {error}"[:160]] += 1

    def _run(self, seed: int) -> None:
        kinds = itertools.cycle(["buffered", "streamed", "buffered", "streamed-usage", "anthropic", "buffered"])
        if self.keys:
            keys = itertools.cycle([f"soak-caller-{n}" for n in range(seed, self.keys, len(self.threads))] or ["k"])
        else:
            keys = (f"soak-caller-{seed}-{n}" for n in itertools.count())  # never repeats: worst case for caches
        with httpx.Client(base_url=self.url, timeout=30) as http:
            due = time.monotonic()
            while not self.stop.is_set():
                if self.interval:
                    due += self.interval
                    self.stop.wait(max(0.0, due - time.monotonic()))
                kind = next(kinds)
                try:
                    error = getattr(self, "_" + kind.replace("-", "_"))(http, next(keys))
                except httpx.HTTPError as exc:
                    error = repr(exc)
                self._record(kind, error)

    @staticmethod
    def _buffered(http: httpx.Client, key: str) -> str | None:
        r = http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES},
                      headers={"authorization": f"Bearer {key}"})
        if r.status_code != 200:
            return f"status {r.status_code}"
        if r.json()["model"] != "chat" or r.headers.get("x-continuum-experiment") != "soak":
            return "not rewritten"
        return None

    @staticmethod
    def _stream(http: httpx.Client, key: str, usage: bool) -> str | None:
        body = {"model": "chat", "messages": MESSAGES, "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"authorization": f"Bearer {key}", "x-demo-events": "8"}) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            models, done, saw_usage = set(), False, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                models.add(chunk.get("model"))
                saw_usage = saw_usage or chunk.get("usage") is not None
        if not done or models != {"chat"} or saw_usage != usage:
            return f"stream done={done} models={sorted(map(str, models))} usage={saw_usage}"
        return None

    def _streamed(self, http: httpx.Client, key: str) -> str | None:
        return self._stream(http, key, usage=False)

    def _streamed_usage(self, http: httpx.Client, key: str) -> str | None:
        return self._stream(http, key, usage=True)

    @staticmethod
    def _anthropic(http: httpx.Client, key: str) -> str | None:
        r = http.post("/anthropic/v1/messages", json={"model": "chat", "max_tokens": 16, "messages": MESSAGES},
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
        if r.status_code != 200:
            return f"status {r.status_code}"
        return None if r.json()["model"] == "chat" else "not rewritten"


def verdict(samples: list[tuple[float, int, int]], warmup_s: float) -> tuple[bool, str]:
    """(flat, explanation) from (t, requests, rss_kb) samples; those before the warm-up are left out.

    Flat: the mean RSS of the last five samples is under 5 MB above the mean of
    the first five after the warm-up. The least-squares slope of RSS per request
    served is printed with it."""
    after = [(n, rss) for t, n, rss in samples if t >= warmup_s]
    steady = [rss for _, rss in after]
    if len(steady) < 10:
        return False, f"too few samples after warm-up ({len(steady)}); run longer"
    mean_n = sum(n for n, _ in after) / len(after)
    mean_r = sum(steady) / len(steady)
    var = sum((n - mean_n) ** 2 for n, _ in after)
    slope = sum((n - mean_n) * (r - mean_r) for n, r in after) / var * 1024 if var else 0.0
    first = sum(steady[:5]) / 5
    last = sum(steady[-5:]) / 5
    growth = last - first
    flat = growth < 5 * 1024
    return flat, (f"after warm-up {first / 1024:.1f} MB, at the end {last / 1024:.1f} MB, growth {growth / 1024:+.1f} MB "
                  f"(allowed < 5 MB); slope {slope:+.1f} bytes of RSS per request")


def memory(admin: str) -> dict:
    try:
        return httpx.get(f"http://{admin}/admin/memory", headers={"authorization": "Bearer soak-admin"},
                         timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def calibrate(url: str, threads: int, keys: int, seconds: float) -> float:
    """Requests/s the stack answers with closed-loop clients (its saturation here)."""
    load = Load(url, threads, keys)
    load.start()
    time.sleep(seconds)
    load.join()
    return load.total() / seconds


HEADER = (f"{'t (s)':>7} {'requests':>9} {'req/s':>7} {'errors':>7} {'RSS (MB)':>9} "
          f"{'py blocks':>10} {'gc objects':>10} {'traced (MB)':>11}")


def row(t: float, total: int, rate: float | None, errors: int, rss: int, mem: dict) -> str:
    traced = mem.get("tracemalloc", {}).get("current_bytes")
    return (f"{t:>7.0f} {total:>9} {'-' if rate is None else f'{rate:.1f}':>7} {errors:>7} {rss / 1024:>9.1f} "
            f"{mem.get('allocated_blocks', '-'):>10} {mem.get('gc_objects', '-'):>10} "
            f"{'-' if traced is None else f'{traced / 2**20:.1f}':>11}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180, help="length of the soak (default 180)")
    ap.add_argument("--threads", type=int, default=4, help="client threads (default 4)")
    ap.add_argument("--keys", type=int, default=0,
                    help="size of the caller-key pool; 0 (default): every request a new key")
    ap.add_argument("--rate", default="0",
                    help="offered requests/s: a number, 'half' (half the saturation measured first), "
                         "or 0 (default: as fast as answers come)")
    ap.add_argument("--interval", type=float, default=10, help="seconds between samples (default 10)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds of samples left out of the verdict (default: a quarter of the run)")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="run the sidecar under tracemalloc (slower) and print where its heap grew")
    ap.add_argument("--recycle", type=int, default=0, metavar="N",
                    help="run the sidecar under its supervisor with server.max_requests_per_worker: N")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the sidecar's environment (repeatable), e.g. MALLOC_ARENA_MAX=2")
    args = ap.parse_args(argv)
    warmup = args.seconds / 4 if args.warmup is None else args.warmup

    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    with tempfile.TemporaryDirectory(prefix="model-router-soak-") as tmp:
        config = Path(tmp) / "config.yaml"
        text = textwrap.dedent(CONFIG).lstrip()
        if args.recycle:
            text = text.replace("admin_token: soak-admin}", f"admin_token: soak-admin, max_requests_per_worker: {args.recycle}}}")
        config.write_text(text)
        stack = Stack(config, workdir=Path(tmp), supervised=bool(args.recycle))
        stack.sidecar_env = dict(item.split("=", 1) for item in args.env)
        if args.tracemalloc:
            stack.sidecar_env["PYTHONTRACEMALLOC"] = "1"
        load = None
        samples: list[tuple[float, int, int]] = []
        try:
            stack.start()
            proc = stack._procs.get("sidecar-0") or stack._procs["sidecar-supervisor"]
            pid = proc.popen.pid
            admin = stack.sidecar_admin[0]
            rate = 0.0
            if args.rate == "half":
                saturation = calibrate(stack.url, args.threads, args.keys, 20)
                rate = saturation / 2
                print(f"soak: saturation {saturation:.0f} req/s over 20 s; offering half: {rate:.0f} req/s", flush=True)
            else:
                rate = float(args.rate)
            print(f"soak: {args.seconds:.0f} s, {args.threads} client threads, "
                  f"{f'{rate:.0f} req/s offered' if rate else 'closed loop'}, "
                  f"{args.keys or 'unique'} caller keys, sidecar pid {pid}, "
                  f"sampling every {args.interval:.0f} s, verdict after {warmup:.0f} s", flush=True)
            print(HEADER, flush=True)
            load = Load(stack.url, args.threads, args.keys, rate)
            start = time.monotonic()
            samples.append((0.0, 0, sidecar_rss_kb(stack)))
            print(row(0, 0, None, 0, samples[-1][2], memory(admin)), flush=True)
            load.start()
            next_sample = start + args.interval
            end = start + args.seconds
            while not stopping.is_set():
                now = time.monotonic()
                if now >= next_sample:
                    if proc.popen.poll() is not None:
                        print("soak: the sidecar exited", flush=True)
                        return 1
                    total = load.total()
                    t = now - start
                    prev_t, prev_n, _ = samples[-1]
                    samples.append((t, total, sidecar_rss_kb(stack)))
                    per_s = (total - prev_n) / (t - prev_t) if t > prev_t else 0.0
                    print(row(t, total, per_s, sum(load.errors.values()), samples[-1][2], memory(admin)), flush=True)
                    next_sample += args.interval
                if now >= end:
                    break
                time.sleep(min(0.2, max(0.0, min(next_sample, end) - now)))
            if args.tracemalloc:
                for entry in memory(admin).get("tracemalloc", {}).get("top", []):
                    print(f"  {entry['bytes'] / 1024:>10.1f} KiB {entry['count']:>8} blocks  {entry['where']}")
        finally:
            if load is not None:
                load.join()
            stack.stop()
        flat, why = verdict(samples, warmup)
        errors = sum(load.errors.values()) if load else 0
        print(f"requests: {dict(load.counts) if load else {}}; errors: {errors}")
        for err, n in (load.errors.most_common(5) if load else []):
            print(f"  {n} x {err}")
        print(f"verdict: {'FLAT' if flat else 'GROWING'}: {why}")
        return 0 if flat and errors == 0 and not stopping.is_set() else 1

if __name__ == "__main__":
    sys.exit(main())

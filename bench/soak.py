"""Bounded soak: steady load through the real Envoy, watching the sidecar's memory.

    .venv/bin/python bench/soak.py                              # 3 minutes, closed loop
    .venv/bin/python bench/soak.py --seconds 3600 --rate half   # an hour at half the saturation
    .venv/bin/python bench/soak.py --recycle 0                  # one process, never recycled
    .venv/bin/python bench/soak.py --processor trivial          # bench/minimal_extproc.py instead

Starts a ``sidecar.devstack.stack.Stack`` (two demo engines, the sidecar as ``serve``
runs it by default: its supervisor and one worker, recycled at
``server.max_requests_per_worker``; the real Envoy) with an active experiment (sticky by API key, ``response_model:
client``, attribution headers), then a few client threads send buffered and
streamed chat completions (with and without ``stream_options.include_usage``)
and Anthropic messages, each with a caller key drawn from a large pool so
per-caller state, if any, would grow (``--keys N`` cycles a pool of N keys
instead). ``--rate`` paces them (``half``: half of what the stack answers
closed-loop over 20 s, measured first). Every ``--interval`` seconds it
samples the sidecar's VmRSS (under the supervisor, of the worker serving each
slot: a draining one and its replacement overlap for a few seconds) and, from ``/admin/memory``, Python's allocated
blocks, tracked objects and (``--tracemalloc``) traced bytes: a growing RSS
with a flat Python heap is native memory.

Verdict: FLAT when the mean RSS of the last five samples is less than 5 MB
above that of the first five after the warm-up (``--warmup``, default a
quarter of the run); the least-squares slope of RSS per request over the
samples after the warm-up is printed with it, the figure to compare between
changes.

``--processor trivial`` puts ``bench/minimal_extproc.py`` (one process, grpc.aio,
no decision logic; ``trivial-ended``: ending each stream from its side,
``trivial-sync``: grpcio's synchronous server) behind its own Envoy (the router's bootstrap minus the
metering, as ``bench/run.py`` builds it) in front of the same demo engines and
watches that process instead: the baseline for what grpc.aio itself keeps. Exit status 0 when flat and every request succeeded, 1 otherwise.
The run stops by itself after ``--seconds`` (also on Ctrl-C or SIGTERM) and
stops every process it started.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
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

sys.path.insert(0, str(ROOT / "bench"))

from sidecar.config import schema as config_mod  # noqa: E402
from sidecar.deploy import envoy as envoyconf  # noqa: E402
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
TRIVIAL_BACKEND, TRIVIAL_MODEL = "pool-a", "model-a"
TRIVIAL_FLAGS = {"trivial": [], "trivial-ended": ["--end-stream"], "trivial-sync": ["--sync"]}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sidecar_rss_kb(stack: Stack) -> int:
    """The sidecar's RSS; under the worker supervisor, that of the oldest worker
    of each slot: during a recycle, the one that served until its replacement
    took over (counting both would read as a spike; the replacement alone, while
    it still starts, as a dip)."""
    proc = stack._procs.get("sidecar-0") or stack._procs["sidecar-supervisor"]
    pid = proc.popen.pid
    if "sidecar-0" in stack._procs:
        return rss_kb(pid)
    oldest: dict[str, tuple[int, int]] = {}  # slot (its admin address) -> (start time, pid)
    for kid in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        try:
            argv = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            started = int(Path(f"/proc/{kid}/stat").read_text().rpartition(")")[2].split()[19])
        except OSError:
            continue  # it exited meanwhile
        slot = argv[argv.index(b"--admin-listen") + 1].decode() if b"--admin-listen" in argv else str(kid)
        if slot not in oldest or started < oldest[slot][0]:
            oldest[slot] = (started, kid)
    return sum(rss_kb(kid) for _, kid in oldest.values())


class Trivial:
    """``bench/minimal_extproc.py`` behind its own Envoy, in front of ``stack``'s demo engines."""

    def __init__(self, stack: Stack, config: Path, workdir: Path, flags: list[str]) -> None:
        import run  # bench/run.py: the same trivial bootstrap the benchmark measures

        self.procs = run.Procs(workdir)
        addr = f"127.0.0.1:{run.free_port()}"
        name = f"minimal-{TRIVIAL_BACKEND}-0"
        try:
            self.popen = self.procs.spawn(name, [sys.executable, str(ROOT / "bench" / "minimal_extproc.py"),
                                                 "--listen", addr, "--backend", TRIVIAL_BACKEND,
                                                 "--model", TRIVIAL_MODEL, *flags])
            run.wait_tcp(addr, time.monotonic() + 30, lambda: self.procs.check(name))
            boot = envoyconf.bootstrap(config_mod.load(config).config, standby=False, sidecar_addresses=[addr],
                                       backend_urls=stack.demo_urls, listen="127.0.0.1:1", admin_listen="127.0.0.1:1")
            listen, _admin, _envoy = run.start_envoy(self.procs, workdir, "envoy-trivial", run.trivial_bootstrap(boot))
        except BaseException:
            self.procs.stop_all()
            raise
        self.pid = self.popen.pid
        self.url = f"http://{listen}"

    def stop(self) -> None:
        self.procs.stop_all()


class Load:
    """Client threads with shared counters; each request is checked, not just sent."""

    def __init__(self, url: str, threads: int, keys: int = 0, rate: float = 0.0, trivial: bool = False) -> None:
        self.url = url
        # The trivial processor names every request model-a, sets no experiment
        # headers and leaves paths alone (Anthropic requests go to /v1/messages).
        self.model = TRIVIAL_MODEL if trivial else "chat"
        self.experiment = None if trivial else "soak"
        self.anthropic_path = "/v1/messages" if trivial else "/anthropic/v1/messages"
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

    def _buffered(self, http: httpx.Client, key: str) -> str | None:
        r = http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES},
                      headers={"authorization": f"Bearer {key}"})
        if r.status_code != 200:
            return f"status {r.status_code}"
        if r.json()["model"] != self.model or r.headers.get("x-continuum-experiment") != self.experiment:
            return "not rewritten"
        return None

    def _stream(self, http: httpx.Client, key: str, usage: bool) -> str | None:
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
        if not done or models != {self.model} or saw_usage != usage:
            return f"stream done={done} models={sorted(map(str, models))} usage={saw_usage}"
        return None

    def _streamed(self, http: httpx.Client, key: str) -> str | None:
        return self._stream(http, key, usage=False)

    def _streamed_usage(self, http: httpx.Client, key: str) -> str | None:
        return self._stream(http, key, usage=True)

    def _anthropic(self, http: httpx.Client, key: str) -> str | None:
        r = http.post(self.anthropic_path, json={"model": "chat", "max_tokens": 16, "messages": MESSAGES},
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
        if r.status_code != 200:
            return f"status {r.status_code}"
        return None if r.json()["model"] == self.model else "not rewritten"


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
    if not admin:
        return {}
    try:
        return httpx.get(f"http://{admin}/admin/memory", headers={"authorization": "Bearer soak-admin"},
                         timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def calibrate(url: str, threads: int, keys: int, seconds: float, trivial: bool) -> float:
    """Requests/s the stack answers with closed-loop clients (its saturation here)."""
    load = Load(url, threads, keys, trivial=trivial)
    load.start()
    time.sleep(seconds)
    load.join()
    return load.total() / seconds


HEADER = (f"{'t (s)':>7} {'requests':>9} {'req/s':>7} {'errors':>7} {'RSS (MB)':>9} "
          f"{'py blocks':>10} {'gc objects':>10} {'traced (MB)':>11} {'load 1m':>7}")


def row(t: float, total: int, rate: float | None, errors: int, rss: int, mem: dict) -> str:
    traced = mem.get("tracemalloc", {}).get("current_bytes")
    return (f"{t:>7.0f} {total:>9} {'-' if rate is None else f'{rate:.1f}':>7} {errors:>7} {rss / 1024:>9.1f} "
            f"{mem.get('allocated_blocks', '-'):>10} {mem.get('gc_objects', '-'):>10} "
            f"{'-' if traced is None else f'{traced / 2**20:.1f}':>11} {os.getloadavg()[0]:>7.2f}")


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
    ap.add_argument("--recycle", type=int, default=None, metavar="N",
                    help="server.max_requests_per_worker: N (default: the product's default, under the worker "
                         "supervisor; 0: one process that is never recycled)")
    ap.add_argument("--processor", choices=["router", *TRIVIAL_FLAGS], default="router",
                    help="whose memory to watch: the sidecar (default) or bench/minimal_extproc.py "
                         "(trivial-ended: --end-stream; trivial-sync: --sync)")
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
        if args.recycle is not None:
            text = text.replace("admin_token: soak-admin}", f"admin_token: soak-admin, max_requests_per_worker: {args.recycle}}}")
        config.write_text(text)
        stack = Stack(config, workdir=Path(tmp), supervised=bool(config_mod.load(config).config.server.max_requests_per_worker))
        stack.sidecar_env = dict(item.split("=", 1) for item in args.env)
        if args.tracemalloc:
            stack.sidecar_env["PYTHONTRACEMALLOC"] = "1"
        load = None
        trivial: Trivial | None = None
        samples: list[tuple[float, int, int]] = []
        try:
            stack.start()
            proc = stack._procs.get("sidecar-0") or stack._procs["sidecar-supervisor"]
            popen, url, admin = proc.popen, stack.url, stack.sidecar_admin[0]
            measure = lambda: sidecar_rss_kb(stack)  # noqa: E731
            if args.processor != "router":
                trivial = Trivial(stack, config, Path(tmp), TRIVIAL_FLAGS[args.processor])
                popen, url, admin = trivial.popen, trivial.url, ""
                measure = lambda: rss_kb(trivial.pid)  # noqa: E731
            is_trivial = trivial is not None
            rate = 0.0
            if args.rate == "half":
                saturation = calibrate(url, args.threads, args.keys, 20, is_trivial)
                rate = saturation / 2
                print(f"soak: saturation {saturation:.0f} req/s over 20 s; offering half: {rate:.0f} req/s", flush=True)
            else:
                rate = float(args.rate)
            print(f"soak: {args.processor} processor, {args.seconds:.0f} s, {args.threads} client threads, "
                  f"{f'{rate:.0f} req/s offered' if rate else 'closed loop'}, "
                  f"{args.keys or 'unique'} caller keys, processor pid {popen.pid}, "
                  f"sampling every {args.interval:.0f} s, verdict after {warmup:.0f} s", flush=True)
            print(HEADER, flush=True)
            load = Load(url, args.threads, args.keys, rate, trivial=is_trivial)
            start = time.monotonic()
            samples.append((0.0, 0, measure()))
            print(row(0, 0, None, 0, samples[-1][2], memory(admin)), flush=True)
            load.start()
            next_sample = start + args.interval
            end = start + args.seconds
            while not stopping.is_set():
                now = time.monotonic()
                if now >= next_sample:
                    if popen.poll() is not None:
                        print("soak: the processor exited", flush=True)
                        return 1
                    total = load.total()
                    t = now - start
                    prev_t, prev_n, _ = samples[-1]
                    samples.append((t, total, measure()))
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
            if trivial is not None:
                trivial.stop()
            stack.stop()
        recycles = stack.log("sidecar-supervisor").count(" recycled: ") if trivial is None else 0
        flat, why = verdict(samples, warmup)
        errors = sum(load.errors.values()) if load else 0
        print(f"requests: {dict(load.counts) if load else {}}; errors: {errors}; worker recycles: {recycles}")
        for err, n in (load.errors.most_common(5) if load else []):
            print(f"  {n} x {err}")
        print(f"verdict: {'FLAT' if flat else 'GROWING'}: {why}")
        return 0 if flat and errors == 0 and not stopping.is_set() else 1

if __name__ == "__main__":
    sys.exit(main())

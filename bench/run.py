"""End-to-end benchmark: model-router behind the real Envoy, against bare Envoy and a trivial ext_proc.

    .venv/bin/python bench/run.py            # full run: 10 s per case after warm-up, about 13 minutes
    .venv/bin/python bench/run.py --quick    # harness check: every stack, a few requests each (under a minute)

The full run first waits (up to 10 minutes) for a 1-minute load average below
0.7, and before each measurement waits while processes outside the run use
more than 25% of a core, repeating a measurement they disturbed once (at most
240 s added in all). Needs ``wrk`` and ``nginx`` (Debian: wrk, nginx-light).

One run starts, on free 127.0.0.1 ports:

- nginx (``return 200`` with a fixed chat completion) for non-streaming cases;
- the model-router stack (``sidecar.devstack.stack.Stack``: the real Envoy, 2 sidecar
  processes as 2 ext_proc endpoints, and a demo engine for paced SSE), with
  its metering: the usage filters, the gRPC access log and the response
  processor on the rewrite route;
- the same model-router bootstrap without ``access_log``, in front of the same
  2 sidecar processes: what the access log costs;
- bare Envoy: the bootstrap with every router piece removed (both ext_proc
  filters, the usage filters, the access log) and one fixed cluster (one
  instance for nginx, one for the demo engine);
- the bare bootstrap plus the request ext_proc filter in front of
  ``bench/minimal_extproc.py`` (2 processes), a processor that only rewrites
  ``model``;
- optionally a second stack with 1 sidecar process.

Load comes from separate processes: ``wrk`` with ``bench/chat.lua`` (closed
loop), ``bench/openloop.py`` (fixed rate) and ``bench/ttft.py`` (time to first
token). Every case runs its configurations in order in round 1 and in reverse
order in round 2 (A B C | C B A). The output is one markdown table with ratios to
bare Envoy, the targets and whether each was met, errors per case, ext_proc
messages per request (Envoy's counters) and the processors' CPU per request
from ``/proc/<pid>/stat``. Every process started is stopped at the end, also
on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

import _http  # noqa: E402

from sidecar.config import schema as config_mod  # noqa: E402
from sidecar.deploy import envoy as envoyconf  # noqa: E402
from sidecar.devstack.stack import Stack, StackError, envoy_binary, free_port  # noqa: E402
from sidecar.devstack.stack import wait_http as stack_wait_http  # noqa: E402
from sidecar.devstack.stack import wait_tcp as stack_wait_tcp  # noqa: E402

KEYS = 1000
BACKEND_HEADER = "x-model-router-backend"
NGINX_BACKEND = "nginx"
ENGINE_BACKEND = "engine"
STREAM_EVENTS = 50
STREAM_INTERVAL_MS = 1
CLK_TCK = os.sysconf("SC_CLK_TCK")

NGINX_RESPONSE = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"llama-3.1-8b",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, friend."},'
    '"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":5,"total_tokens":29}}'
)

TARGETS = {
    "msgs_per_req": 2.0,  # request-filter ext_proc messages per request, exactly
    "throughput": 0.90,  # router c32 req/s / trivial ext_proc c32 req/s
    # The router against the trivial processor, which pays the same two gRPC round trips.
    "p50_over_trivial_ms": 0.3,
    "p99_added_ms": 2.5,
    "ttft_added_ms": 2.0,
    "stream_usage": 0.90,  # the client asks for usage: 2 messages per stream, Envoy reads the usage
    "stream_upstream": 0.95,  # the router adds and strips the usage event: "keeps the bare-Envoy rate"
    "stream_client": 0.75,
}
EXT_PROC = "envoy.filters.http.ext_proc"
COUNT_REQUESTS = 500  # sequential requests per configuration for the exact message count (quick: 20)
FLUSH_SETTLE_S = 1.2  # > metering.flush_interval_ms (default 1000)
RESPONSE_FILTER = getattr(envoyconf, "RESPONSE_FILTER", "envoy.filters.http.ext_proc/response")
METERING_FILTERS = {"envoy.filters.http.json_to_metadata", "envoy.filters.http.sse_to_metadata"}


def router_config(nginx_url: str) -> str:
    """The benchmark's router config.

    1,000 API keys; a 90/10 ``chat`` experiment on nginx; two 90/10 SSE
    experiments on the demo engine (``chat-stream`` with ``response_model:
    upstream``, ``chat-stream-client`` with ``client``); and two models
    outside any experiment, ``plain`` (nginx) and ``plain-s`` (demo engine).
    Workers are not recycled: a full run sends each sidecar process more than
    the default 50,000 requests, and nothing here starts a recycled one again
    (``bench/recycle.py`` measures what recycling costs).
    """
    keys = "\n".join(
        f"  - {{key: {_http.key(i)}, id: team-{i:04d}, allowed_models: [chat, plain, chat-stream, chat-stream-client, plain-s]}}"
        for i in range(KEYS)
    )
    return textwrap.dedent(
        f"""\
        server:
          message_timeout_ms: 2000
          max_requests_per_worker: 0
        backends:
          - {{name: {NGINX_BACKEND}, url: "{nginx_url}", type: openai, models: [llama-3.1-8b, qwen3-8b, plain]}}
          - {{name: {ENGINE_BACKEND}, url: "demo://", type: vllm, models: [llama-s, qwen-s, llama-c, qwen-c, plain-s]}}
        model_experiments:
          - name: chat-ab
            model: chat
            sticky_key: api_key
            response_model: upstream
            response_headers: true
            variants:
              - {{id: control, model: llama-3.1-8b, weight: 90}}
              - {{id: candidate, model: qwen3-8b, weight: 10}}
          - name: stream-upstream
            model: chat-stream
            sticky_key: api_key
            response_model: upstream
            response_headers: true
            variants:
              - {{id: control, model: llama-s, weight: 90}}
              - {{id: candidate, model: qwen-s, weight: 10}}
          - name: stream-client
            model: chat-stream-client
            sticky_key: api_key
            response_model: client
            response_headers: true
            variants:
              - {{id: control, model: llama-c, weight: 90}}
              - {{id: candidate, model: qwen-c, weight: 10}}
        api_keys:
        """
    ) + keys + "\n"


# --------------------------------------------------------------------------- processes


class BenchError(RuntimeError):
    pass


class Procs:
    """Processes this run started itself (nginx, extra Envoys, minimal processors)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.items: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        try:
            p = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        finally:
            log.close()
        self.items[name] = p
        return p

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def check(self, name: str) -> None:
        p = self.items[name]
        if p.poll() is not None:
            raise BenchError(f"{name} exited with code {p.returncode}:\n{self.log(name)}")

    def stop_all(self) -> None:
        for p in reversed(list(self.items.values())):
            if p.poll() is not None:
                continue
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
            except ProcessLookupError:
                pass


def wait_http(url: str, deadline: float, alive=None) -> None:
    if not stack_wait_http(url, deadline, alive):
        raise BenchError(f"not ready: {url}")


def wait_tcp(addr: str, deadline: float, alive=None) -> None:
    if not stack_wait_tcp(addr, deadline, alive):
        raise BenchError(f"nothing listening on {addr}")


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None)


def start_nginx(procs: Procs, workdir: Path) -> str:
    """nginx in the foreground, one worker, answering every request with NGINX_RESPONSE; returns HOST:PORT."""
    binary = nginx_binary()
    if binary is None:
        raise BenchError("nginx not found: apt-get install nginx-light (or nginx)")
    port = free_port()
    d = workdir / "nginx"
    (d / "tmp").mkdir(parents=True, exist_ok=True)
    conf = d / "nginx.conf"
    conf.write_text(textwrap.dedent(f"""\
        worker_processes 1;
        pid {d}/nginx.pid;
        error_log {d}/error.log warn;
        events {{ worker_connections 4096; }}
        http {{
            access_log off;
            client_body_temp_path {d}/tmp;
            client_body_buffer_size 64k;
            keepalive_requests 10000000;
            keepalive_timeout 300s;
            server {{
                listen 127.0.0.1:{port};
                location / {{
                    default_type application/json;
                    return 200 '{NGINX_RESPONSE}';
                }}
            }}
        }}
        """))
    procs.spawn("nginx", [binary, "-p", str(d), "-e", str(d / "error.log"), "-c", str(conf), "-g", "daemon off;"])
    wait_tcp(f"127.0.0.1:{port}", time.monotonic() + 15, lambda: procs.check("nginx"))
    return f"127.0.0.1:{port}"


def _hcms(boot: dict):
    for listener in boot["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                yield f["typed_config"]


def _strip_metering(hcm: dict) -> None:
    """Remove what only the metering needs: usage filters, the response
    processor (and the route that selects it), the access log, attribution headers."""
    hcm.pop("access_log", None)
    hcm["http_filters"] = [h for h in hcm["http_filters"] if h["name"] not in METERING_FILTERS]
    for h in hcm["http_filters"]:
        up = h.get("typed_config", {}).get("upstream_http_filters")
        if up is not None:
            h["typed_config"]["upstream_http_filters"] = [u for u in up if u["name"] != RESPONSE_FILTER]
    rc = hcm["route_config"]
    rc.pop("response_headers_to_add", None)
    for vh in rc["virtual_hosts"]:
        vh["routes"] = [r for r in vh["routes"] if r.get("name") != "rewrite"] or vh["routes"][-1:]
        for r in vh["routes"]:
            r.pop("typed_per_filter_config", None)


def bare_bootstrap(boot: dict, cluster: str) -> dict:
    """``boot`` without any router piece, every request sent to ``cluster``."""
    boot = copy.deepcopy(boot)
    for hcm in _hcms(boot):
        _strip_metering(hcm)
        # The body buffer exists for the decision: bare Envoy streams bodies through.
        hcm["http_filters"] = [h for h in hcm["http_filters"] if h["name"] not in (EXT_PROC, "envoy.filters.http.buffer")]
        for vh in hcm["route_config"]["virtual_hosts"]:
            for r in vh["routes"]:
                r["route"].pop("cluster_header", None)
                r["route"]["cluster"] = cluster
    return boot


def trivial_bootstrap(boot: dict) -> dict:
    """``boot`` with only the request ext_proc filter: routing on its header, no metering."""
    boot = copy.deepcopy(boot)
    for hcm in _hcms(boot):
        _strip_metering(hcm)
    return boot


def no_access_log_bootstrap(boot: dict) -> dict:
    """``boot`` as the router runs it, minus the gRPC access log."""
    boot = copy.deepcopy(boot)
    for hcm in _hcms(boot):
        hcm.pop("access_log", None)
    return boot


@dataclass
class Target:
    """One Envoy listener and the processes whose CPU is charged to it."""

    key: str
    label: str
    listen: str
    envoy_admin: str
    envoy_pid: int
    processor_pids: list[int] = field(default_factory=list)
    upstream_pid: int | None = None
    processor_admins: list[str] = field(default_factory=list)  # sidecar admin addresses (/metrics)


def start_envoy(procs: Procs, workdir: Path, name: str, boot: dict) -> tuple[str, str, int]:
    listen = f"127.0.0.1:{free_port()}"
    admin = f"127.0.0.1:{free_port()}"
    boot = copy.deepcopy(boot)
    boot["admin"]["address"]["socket_address"]["port_value"] = int(admin.rpartition(":")[2])
    boot["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = int(listen.rpartition(":")[2])
    path = workdir / f"{name}.yaml"
    path.write_text(envoyconf.render(boot))
    p = procs.spawn(name, [envoy_binary(), "-c", str(path), "--concurrency", "2", "--use-dynamic-base-id",
                           "--disable-hot-restart", "--log-level", "warn"])
    deadline = time.monotonic() + 30
    wait_http(f"http://{admin}/ready", deadline, lambda: procs.check(name))
    wait_tcp(listen, deadline, lambda: procs.check(name))
    return listen, admin, p.pid


# --------------------------------------------------------------------------- accounting


def proc_ticks(pid: int) -> int:
    """utime + stime of ``pid`` (all its threads), in clock ticks; 0 when gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = raw.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def foreign_ticks() -> dict[int, tuple[str, int]]:
    """CPU ticks of every user-space process that is not this run or one of its descendants."""
    me = os.getpid()
    info: dict[int, tuple[int, str, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        head, _, rest = raw.rpartition(")")
        fields = rest.split()
        info[int(entry.name)] = (int(fields[1]), head.partition("(")[2], int(fields[11]) + int(fields[12]))
    out = {}
    for pid, (_ppid, comm, ticks) in info.items():
        p, ours, kernel = pid, False, False
        for _ in range(64):
            if p == me:
                ours = True
                break
            if p in (0, 1):
                break
            if p == 2:
                kernel = True
                break
            p = info.get(p, (0, "", 0))[0]
        if not ours and not kernel and pid != 1:
            out[pid] = (comm, ticks)
    return out


def _get(url: str) -> str:
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except (urllib.error.URLError, OSError):
        return ""


def envoy_counters(admin: str) -> dict[str, int]:
    """Envoy's counters for one window: requests on the public listener,
    messages sent by the request ext_proc filter and by the response processor,
    and access-log entries written."""
    text = _get(f"http://{admin}/stats?filter=(stream_msgs_sent|downstream_rq_total|grpc_access_log.logs_written)")
    out = {"rq": 0, "msgs": 0, "resp_msgs": 0, "als": 0}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if not value.strip().isdigit():
            continue
        if name == "http.model_router.downstream_rq_total":
            out["rq"] += int(value)
        elif name.endswith("response.stream_msgs_sent"):
            out["resp_msgs"] += int(value)
        elif name.endswith("ext_proc.stream_msgs_sent"):
            out["msgs"] += int(value)
        elif name.endswith("logs_written"):
            out["als"] += int(value)
    return out


def sidecar_entries(admins: list[str]) -> float:
    """Access-log entries the sidecar processes received (``model_router_access_log_entries_total``)."""
    total = 0.0
    for admin in admins:
        for line in _get(f"http://{admin}/metrics").splitlines():
            if line.startswith("model_router_access_log_entries_total "):
                total += float(line.split()[1])
    return total


class Sample:
    """CPU and Envoy/sidecar counters of one target around one measured window."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.t = time.monotonic()
        self.envoy = proc_ticks(target.envoy_pid)
        self.processors = sum(proc_ticks(p) for p in target.processor_pids)
        up = [target.upstream_pid, *children(target.upstream_pid)] if target.upstream_pid else []
        self.upstream_pids = up
        self.upstream = sum(proc_ticks(p) for p in up)
        self.counters = envoy_counters(target.envoy_admin)
        self.entries = sidecar_entries(target.processor_admins)
        self.foreign = foreign_ticks()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.children_cpu = ru.ru_utime + ru.ru_stime

    def delta(self, done: int) -> dict:
        later = Sample(self.target)
        secs = later.t - self.t
        per = 1e6 / CLK_TCK / max(done, 1)
        foreign = 0
        top: list[tuple[int, str]] = []
        for pid, (comm, ticks) in later.foreign.items():
            d = ticks - self.foreign[pid][1] if pid in self.foreign else 0
            if d > 0:
                foreign += d
                top.append((d, comm))
        top.sort(reverse=True)
        c = {k: later.counters[k] - self.counters[k] for k in self.counters}
        rq = max(c["rq"], 1)
        proc = bool(self.target.processor_pids)
        return {
            "envoy_us": (later.envoy - self.envoy) * per,
            "processor_us": (later.processors - self.processors) * per if proc else None,
            "upstream_us": (later.upstream - self.upstream) * per if self.upstream_pids else None,
            "envoy_pct": 100 * (later.envoy - self.envoy) / CLK_TCK / secs,
            "upstream_pct": 100 * (later.upstream - self.upstream) / CLK_TCK / secs,
            "processor_pct": 100 * (later.processors - self.processors) / CLK_TCK / secs,
            "envoy_requests": c["rq"],
            "msgs_per_req": c["msgs"] / rq if proc else None,
            "resp_msgs_per_req": c["resp_msgs"] / rq if proc else None,
            "als_written_per_req": c["als"] / rq,
            "als_received_per_req": (later.entries - self.entries) / rq if self.target.processor_admins else None,
            "foreign_pct": 100 * foreign / CLK_TCK / secs,
            "foreign_top": [f"{c} {100 * d / CLK_TCK / secs:.0f}%" for d, c in top[:3]],
        }


# --------------------------------------------------------------------------- load generators


def run_wrk(listen: str, connections: int, seconds: int, model: str, stream: bool, usage: bool = False) -> dict:
    env = dict(
        os.environ, BENCH_MODEL=model, BENCH_KEYS=str(KEYS), BENCH_STREAM="1" if stream else "0",
        BENCH_EVENTS=str(STREAM_EVENTS), BENCH_INTERVAL_MS=str(STREAM_INTERVAL_MS), BENCH_USAGE="1" if usage else "0",
    )
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "-s", str(BENCH / "chat.lua"),
            f"http://{listen}{_http.PATH}"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise BenchError(f"wrk failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    r = json.loads(line[8:])
    r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out.stdout)
    r["non2xx"] = int(m.group(1)) if m else 0
    r["socket"] = r["connect"] + r["read"] + r["write"]
    return r


def run_openloop(listen: str, rate: float, seconds: int, warmup: int, model: str) -> dict:
    argv = [sys.executable, str(BENCH / "openloop.py"), "--target", listen, "--rate", f"{rate:.1f}",
            "--duration", str(seconds), "--warmup", str(warmup), "--connections", "32", "--model", model,
            "--keys", str(KEYS)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + warmup + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("OPENLOOP ")), None)
    if line is None:
        raise BenchError(f"openloop failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    r = json.loads(line[9:])
    r["requests"] = r["completed"]
    r["requests_all"] = r["completed_all"]
    r["non2xx"] = r["status"]
    return r


def run_ttft(listen: str, count: int, warmup: int, model: str, max_seconds: float, usage: bool = False) -> dict:
    argv = [sys.executable, str(BENCH / "ttft.py"), "--target", listen, "--model", model, "--keys", str(KEYS),
            "--count", str(count), "--warmup", str(warmup), "--events", str(STREAM_EVENTS),
            "--interval-ms", str(STREAM_INTERVAL_MS), "--max-seconds", str(max_seconds)] + (
        ["--include-usage"] if usage else [])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=max_seconds + 60)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("TTFT ")), None)
    if line is None:
        raise BenchError(f"ttft failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    r = json.loads(line[5:])
    r["non2xx"] = r["status"]
    r["timeout"] = r["timeout"] + r["no_data"]
    return r


# --------------------------------------------------------------------------- sanity checks


def post(listen: str, model: str, stream: bool = False, usage: bool = False) -> tuple[int, dict, bytes]:
    body = _http.chat_body(model, stream, usage)
    headers = {"content-type": "application/json", "authorization": f"Bearer {_http.key(7)}"}
    if stream:
        headers.update({"x-demo-interval-ms": str(STREAM_INTERVAL_MS), "x-demo-events": str(STREAM_EVENTS)})
    req = urllib.request.Request(f"http://{listen}{_http.PATH}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def check_json(name: str, listen: str, model: str, experiment: bool) -> None:
    status, headers, body = post(listen, model)
    if status != 200:
        raise BenchError(f"{name}: status {status}: {body[:300]!r}")
    data = json.loads(body)
    if data.get("usage", {}).get("total_tokens") != 29:
        raise BenchError(f"{name}: unexpected body {body[:300]!r}")
    if experiment and headers.get("x-continuum-experiment") != "chat-ab":
        raise BenchError(f"{name}: no experiment header in {headers}")


def check_stream(name: str, listen: str, cfg_model: str, expect_model: set[str], usage: bool = False) -> None:
    """A paced stream arrives whole, with the expected model, and with a usage event only when asked for."""
    status, _, body = post(listen, cfg_model, stream=True, usage=usage)
    events = [ln[5:].strip() for ln in body.decode().splitlines() if ln.startswith("data:")]
    if status != 200 or not events or events[-1] != "[DONE]":
        raise BenchError(f"{name}: status {status}, stream {body[:300]!r}")
    chunks = [json.loads(e) for e in events[:-1]]
    models = {c.get("model") for c in chunks}
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    usage_events = [c for c in chunks if c.get("usage")]
    if not models <= expect_model or len(content) != STREAM_EVENTS:
        raise BenchError(f"{name}: models {models} (want {expect_model}), {len(content)} content events")
    if bool(usage_events) != usage:
        raise BenchError(f"{name}: {len(usage_events)} usage events, client asked for usage: {usage}")


def check_metering(stack: Stack, models: set[str], deadline_s: float = 5.0) -> None:
    """The checks' requests reached the usage records, with token counts."""
    path = Path(stack.usage_records)
    end = time.monotonic() + deadline_s
    while True:
        recs = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
        counted = {r["client_model"] for r in recs if r.get("completion_tokens") is not None}
        if models <= counted:
            return
        if time.monotonic() > end:
            raise BenchError(f"usage records without tokens for {sorted(models - counted)} in {path}")
        time.sleep(0.2)


def count_messages(target: Target, model: str, n: int) -> dict:
    """ext_proc messages per request over ``n`` sequential keep-alive requests: none is cut
    at a window's edge, so the ratio of Envoy's counters is exact."""
    body = _http.chat_body(model)
    before = envoy_counters(target.envoy_admin)
    conn = http.client.HTTPConnection(target.listen, timeout=10)
    bad = 0
    try:
        for i in range(n):
            conn.request("POST", _http.PATH, body=body, headers={
                "content-type": "application/json", "authorization": f"Bearer {_http.key(i % KEYS)}"})
            resp = conn.getresponse()
            resp.read()
            bad += resp.status >= 400
    except (OSError, http.client.HTTPException) as exc:
        raise BenchError(f"counting messages on {target.label}: {exc}") from exc
    finally:
        conn.close()
    after = envoy_counters(target.envoy_admin)
    c = {k: after[k] - before[k] for k in before}
    rq = max(c["rq"], 1)
    return {"requests": c["rq"], "msgs_per_req": c["msgs"] / rq, "resp_msgs_per_req": c["resp_msgs"] / rq,
            "non2xx": bad, "round": 1}


# --------------------------------------------------------------------------- the run


@dataclass
class Config:
    key: str
    label: str
    target: Target
    model: str
    usage: bool = False  # streams: the client asks for its usage event itself


@dataclass
class Case:
    key: str
    kind: str  # "wrk", "openloop", "ttft"
    configs: list[Config]
    connections: int = 32
    stream: bool = False
    rate: float = 0.0  # open loop: requests per second


class Runner:
    def __init__(self, args) -> None:
        self.args = args
        self.quick = args.quick
        self.seconds = args.duration or (1 if args.quick else 10)
        self.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 2)
        self.ttft_count = 3 if args.quick else 100
        self.ttft_warmup = 1 if args.quick else 5
        self.count_requests = 20 if args.quick else COUNT_REQUESTS
        self.rounds = 1 if args.quick else max(args.rounds, 2)
        self.results: dict[tuple[str, str], list[dict]] = {}
        self.notes: list[str] = []
        self.started = time.monotonic()
        self.deadline = self.started + args.max_minutes * 60
        self.openloop_rate = 0.0
        self.decision: dict = {}
        self.quiet: dict = {}
        self.max_foreign = 0.0 if args.quick else args.max_foreign
        self.wait_budget = args.wait_budget
        self.waited = 0.0
        self.repeated = 0
        self.repeat_s = 0.0

    def over_time(self) -> bool:
        return time.monotonic() > self.deadline

    def measure(self, case: Case, cfg: Config, rnd: int) -> dict:
        """One measured window of ``cfg`` under ``case``'s load, with CPU accounting around it."""
        r = self._load(case, cfg)
        r["round"] = rnd
        return r

    def _load(self, case: Case, cfg: Config) -> dict:
        t = cfg.target
        if case.kind == "wrk":
            if self.warmup:
                run_wrk(t.listen, case.connections, self.warmup, cfg.model, case.stream, cfg.usage)
            before = Sample(t)
            r = run_wrk(t.listen, case.connections, self.seconds, cfg.model, case.stream, cfg.usage)
        elif case.kind == "openloop":
            if not self.quick:
                time.sleep(FLUSH_SETTLE_S)  # the previous window's last access-log flush lands before this one
            before = Sample(t)
            r = run_openloop(t.listen, case.rate, self.seconds, self.warmup, cfg.model)
        else:
            before = Sample(t)
            r = run_ttft(t.listen, self.ttft_count, self.ttft_warmup, cfg.model,
                         max_seconds=4 * self.seconds + 20, usage=cfg.usage)
        r.update(before.delta(r.get("requests_all", r["requests"])))
        gen = resource.getrusage(resource.RUSAGE_CHILDREN)
        r["generator_pct"] = 100 * (gen.ru_utime + gen.ru_stime - before.children_cpu) / max(time.monotonic() - before.t, 1e-3)
        return r

    def run_case(self, case: Case) -> None:
        for rnd in range(1, self.rounds + 1):
            order = case.configs if rnd % 2 == 1 else list(reversed(case.configs))
            for cfg in order:
                if self.over_time():
                    self.notes.append(f"time limit reached: {case.key} {cfg.key} round {rnd} not run")
                    continue
                self.gate()
                r = self.measure(case, cfg, rnd)
                print(f"  {case.key:<10} round {rnd}  {cfg.label:<38} {short(case, r)}", file=sys.stderr, flush=True)
                if self.max_foreign and r["foreign_pct"] > self.max_foreign and self.budget_left() > 0:
                    self.repeated += 1
                    self.gate()
                    t0 = time.monotonic()
                    again = self.measure(case, cfg, rnd)
                    self.repeat_s += time.monotonic() - t0
                    print(f"  {case.key:<10} round {rnd}  {cfg.label:<38} {short(case, again)} (repeated)",
                          file=sys.stderr, flush=True)
                    r = min((r, again), key=lambda x: x["foreign_pct"])
                self.results.setdefault((case.key, cfg.key), []).append(r)

    def budget_left(self) -> float:
        """Seconds the waits and repeats for a quiet machine may still add."""
        return self.wait_budget - self.waited - self.repeat_s

    def gate(self) -> None:
        """Wait (bounded) while processes outside this run use more than ``max_foreign`` % of a core."""
        if not self.max_foreign:
            return
        start = time.monotonic()
        while True:
            before = foreign_ticks()
            time.sleep(0.5)
            after = foreign_ticks()
            busy = sum(t - before[p][1] for p, (_, t) in after.items() if p in before)
            pct = 100 * busy / CLK_TCK / 0.5
            if pct <= self.max_foreign or time.monotonic() - start > 60 or self.budget_left() < time.monotonic() - start:
                break
            time.sleep(4.5)
        self.waited += time.monotonic() - start


def short(case: Case, r: dict) -> str:
    err = errors_text(r)
    if case.kind == "wrk":
        s = f"{r['rps']:8.1f}/s p50 {r['p50_us'] / 1000:6.2f} ms p99 {r['p99_us'] / 1000:6.2f} ms"
    elif case.kind == "openloop":
        s = f"{r['achieved_rps']:8.1f}/s p50 {r['p50_us'] / 1000:6.2f} ms p99 {r['p99_us'] / 1000:6.2f} ms lag p99 {r['lag_p99_us'] / 1000:.2f} ms"
    else:
        s = f"TTFT p50 {r['ttft_p50_us'] / 1000:6.2f} ms p90 {r['ttft_p90_us'] / 1000:6.2f} ms ({r['ok']} streams)"
    if r.get("processor_us") is not None:
        s += f"  proc {r['processor_us']:.0f} µs/req ({r['msgs_per_req']:.2f}+{r['resp_msgs_per_req']:.2f} msgs"
        s += f", log {r['als_received_per_req']:.2f})" if r.get("als_received_per_req") is not None else ")"
    s += f"  envoy {r['envoy_us']:.0f} µs/req  generator {r['generator_pct']:.0f}%  other {r['foreign_pct']:.0f}%"
    return s + (f"  ERRORS {err}" if err != "0" else "")


def errors_text(r: dict) -> str:
    parts = []
    if r.get("non2xx"):
        parts.append(f"{r['non2xx']} status>=400")
    sock = r.get("socket", 0)
    if sock:
        parts.append(f"{sock} socket")
    if r.get("timeout"):
        parts.append(f"{r['timeout']} timeout")
    return ", ".join(parts) if parts else "0"


def wait_quiet(limit_s: float) -> dict:
    start = time.monotonic()
    load0 = os.getloadavg()[0]
    while os.getloadavg()[0] >= 0.7 and time.monotonic() - start < limit_s:
        print(f"waiting for a quiet machine: load average {os.getloadavg()[0]:.2f} (need < 0.7)", file=sys.stderr, flush=True)
        time.sleep(min(15.0, max(limit_s - (time.monotonic() - start), 0.1)))
    load = os.getloadavg()[0]
    return {"load_before": load0, "load_at_start": load, "waited_s": time.monotonic() - start, "quiet": load < 0.7}


def start_decision(quick: bool) -> subprocess.Popen:
    """``bench/decision.py`` in the background (quick: beside the stacks' start, where its
    figures do not matter; a full run waits for it before starting anything)."""
    return subprocess.Popen([sys.executable, str(BENCH / "decision.py"), *(["--quick"] if quick else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def decision_result(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": "bench/decision.py timed out"}
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    rows = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^(.*?)\s{2,}([0-9.]+)\s*$", line)
        if m:
            rows[m.group(1).strip()] = float(m.group(2))
    total = next((v for k, v in rows.items() if k.startswith("request path total")), None)
    if out.returncode != 0 or total is None:
        return {"error": f"bench/decision.py failed: {(out.stderr or out.stdout)[-300:]}"}
    return {"total_us": total, "rows": rows}


def machine() -> dict:
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    wrk_version = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": model,
        "memory": mem,
        "python": platform.python_version(),
        "wrk": wrk_version.split(" [")[0],
    }


# --------------------------------------------------------------------------- the table


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def fmt(x: float, digits: int = 2) -> str:
    if x != x:
        return "–"
    return f"{x:,.{digits}f}"


LABELS = {
    "bare": "bare Envoy",
    "bare-sse": "bare Envoy",
    "minimal": "trivial ext_proc, 2 processes",
    "minimal-sse": "trivial ext_proc, 2 processes",
    "router": "model-router, experiment, 2 processes",
    "router-noexp": "model-router, model without experiment, 2 processes",
    "router-nolog": "model-router, experiment, access log removed, 2 processes",
    "router1": "model-router, experiment, 1 process",
    "router-up": "model-router, experiment, response_model: upstream (router adds and strips the usage event)",
    "router-up-usage": "model-router, experiment, response_model: upstream, client asks for usage",
    "router-client": "model-router, experiment, response_model: client",
    "router-plain": "model-router, model without experiment",
}


class Table:
    HEAD = ("case", "configuration", "rounds", "value", "vs bare Envoy", "target", "met", "errors",
            "ext_proc msgs/req (request + response)", "processor CPU µs/req", "Envoy CPU µs/req")

    def __init__(self, runner: Runner) -> None:
        self.r = runner
        self.rows: list[tuple[str, ...]] = []
        self.verdicts: list[tuple[str, bool | None]] = []

    def res(self, case: str, cfg: str) -> list[dict]:
        return self.r.results.get((case, cfg), [])

    def vals(self, case: str, cfg: str, field_: str, scale: float = 1.0) -> list[float]:
        return [x[field_] * scale for x in self.res(case, cfg) if x.get(field_) is not None]

    def cpu(self, case: str, cfg: str) -> tuple[str, str, str]:
        """The accounting columns: messages per request, processor CPU, Envoy CPU."""
        if not self.res(case, cfg):
            return "–", "–", "–"
        msgs, resp = mean(self.vals(case, cfg, "msgs_per_req")), mean(self.vals(case, cfg, "resp_msgs_per_req"))
        mtxt = "–" if msgs != msgs else f"{msgs:.2f}" + (f" + {resp:.2f}" if resp >= 0.005 else "")
        proc = mean(self.vals(case, cfg, "processor_us"))
        return mtxt, fmt(proc, 0), fmt(mean(self.vals(case, cfg, "envoy_us")), 0)

    def errors(self, case: str, cfg: str) -> str:
        texts = [errors_text(x) for x in self.res(case, cfg)]
        return "0" if all(t == "0" for t in texts) else " / ".join(texts)

    def add(self, case_label, cfg_label, rounds, value, vs, target="", met=None, errors="", cpu=("–", "–", "–")):
        mark = "" if met is None else ("**met**" if met else "**not met**")
        self.rows.append((case_label, cfg_label, rounds, value, vs, target, mark, errors, *cpu))
        if met is not None:
            self.verdicts.append((f"{case_label} / {cfg_label}: {target}", met))

    def rate_target(self, case: str, cfg: str, v: float, base: float) -> tuple[str, bool | None]:
        if case == "c32" and cfg == "router":
            triv = mean(self.vals(case, "minimal", "rps"))
            ratio = v / triv if triv == triv and triv else float("nan")
            return f"≥ {TARGETS['throughput']:.2f}× trivial ext_proc (is {ratio:.2f}×)", ratio >= TARGETS["throughput"]
        if case == "sse" and cfg == "router-up-usage":
            return f"≥ {TARGETS['stream_usage']:.2f}× bare", v / base >= TARGETS["stream_usage"]
        if case == "sse" and cfg == "router-up":
            return f"≥ {TARGETS['stream_upstream']:.2f}× bare", v / base >= TARGETS["stream_upstream"]
        if case == "sse" and cfg == "router-client":
            return f"≥ {TARGETS['stream_client']:.2f}× bare", v / base >= TARGETS["stream_client"]
        return "", None

    def rate_rows(self, case: str, case_label: str, bare: str, cfgs: list[str], unit: str) -> None:
        base = mean(self.vals(case, bare, "rps"))
        for cfg in [bare, *cfgs]:
            v = self.vals(case, cfg, "rps")
            if not v:
                continue
            rounds = " / ".join(fmt(x, 0) for x in v)
            vs = "1" if cfg == bare else f"{mean(v) / base:.3f}×"
            target, met = self.rate_target(case, cfg, mean(v), base)
            self.add(case_label, LABELS[cfg], rounds, f"{fmt(mean(v), 0)} {unit}", vs, target, met,
                     self.errors(case, cfg), self.cpu(case, cfg))

    def latency_rows(self, case: str, case_label: str, bare: str, cfgs: list[str], field_: str,
                     target_key: str | None = None, targeted: tuple[str, ...] = ()) -> None:
        base = mean(self.vals(case, bare, field_, 1e-3))
        for cfg in [bare, *cfgs]:
            v = self.vals(case, cfg, field_, 1e-3)
            if not v:
                continue
            rounds = " / ".join(fmt(x) for x in v)
            added = mean(v) - base
            vs = "–" if cfg == bare else f"{added:+.2f} ms"
            target, met = "", None
            if target_key == "p50_over_trivial_ms" and cfg in targeted:
                over = mean(v) - mean(self.vals(case, "minimal", field_, 1e-3))
                target = f"≤ +{TARGETS[target_key]:.1f} ms over trivial ext_proc (is {over:+.2f} ms)"
                met = over <= TARGETS[target_key]
            elif target_key and cfg in targeted:
                target = f"≤ +{TARGETS[target_key]:.1f} ms added"
                met = added <= TARGETS[target_key]
            self.add(case_label, LABELS[cfg], rounds, f"{fmt(mean(v))} ms", vs, target, met,
                     self.errors(case, cfg), self.cpu(case, cfg))

    def msgs_rows(self, case: str, case_label: str, cfgs: list[str], targeted: str | None) -> None:
        """Request-filter ext_proc messages per request, from Envoy's counters (response processor apart)."""
        for cfg in cfgs:
            v = self.vals(case, cfg, "msgs_per_req")
            if not v:
                continue
            target, met = "", None
            if cfg == targeted:
                target = f"= {TARGETS['msgs_per_req']:.0f} exactly"
                met = all(abs(x - TARGETS["msgs_per_req"]) < 1e-9 for x in v)
            resp = mean(self.vals(case, cfg, "resp_msgs_per_req"))
            value = f"{mean(v):.3f}" + (f" + {resp:.2f} response" if resp >= 0.005 else "")
            self.add(case_label, LABELS[cfg], " / ".join(f"{x:.3f}" for x in v), value, "–", target, met,
                     self.errors(case, cfg), self.cpu(case, cfg))

    def access_log_rows(self, case: str, case_label: str) -> None:
        """Sidecar CPU per request with the access log minus without it, round by round."""
        on, off = self.vals(case, "router", "processor_us"), self.vals(case, "router-nolog", "processor_us")
        if not on or not off:
            return
        diffs = [a - b for a, b in zip(on, off)]
        entries = mean(self.vals(case, "router", "als_received_per_req"))
        self.add(case_label, "model-router, experiment: with − without access log", " / ".join(fmt(x, 0) for x in diffs),
                 f"{fmt(mean(diffs), 0)} µs/req", "–", f"{fmt(mean(on), 0)} − {fmt(mean(off), 0)} µs/req; "
                 f"{entries:.2f} entries received per request", None, self.errors(case, "router"),
                 ("–", "–", "–"))

    def build(self) -> None:
        r = self.r
        one = ["router1"] if r.args.one_process else []
        self.rate_rows("c32", "req/s, 32 connections", "bare",
                       ["minimal", "router", "router-noexp", "router-nolog", *one], "req/s")
        self.msgs_rows("count", f"ext_proc messages/request, {r.count_requests} sequential requests",
                       ["minimal", "router", "router-noexp", "router-nolog", *one], "router")
        self.latency_rows("c32", "p99, 32 connections", "bare", ["minimal", "router", "router-noexp", "router-nolog", *one],
                          "p99_us")
        self.latency_rows("c1", "p50, 1 connection", "bare", ["minimal", "router", *one], "p50_us",
                          "p50_over_trivial_ms", ("router",))
        self.latency_rows("c1", "p99, 1 connection", "bare", ["minimal", "router", *one], "p99_us",
                          "p99_added_ms", ("router",))
        for case, share in (("open", "½"), ("open-q", "¼")):
            rate = mean([x["rate"] for x in self.res(case, "router")])
            label = f"open loop {rate:,.0f} req/s ({share} saturation)"
            cfgs = ["minimal", "router", "router-nolog"]
            self.latency_rows(case, f"p50, {label}", "bare", cfgs, "p50_us")
            self.latency_rows(case, f"p99, {label}", "bare", cfgs, "p99_us")
        rate = mean([x["rate"] for x in self.res("open", "router")])
        self.access_log_rows("open", f"access log: sidecar CPU per request, open loop {rate:,.0f} req/s")
        self.access_log_rows("c32", "access log: sidecar CPU per request, 32 connections")
        d = r.decision
        als = d.get("rows", {}).get(next((k for k in d.get("rows", {}) if k.startswith("access-log entry")), ""), None)
        self.add("access log: one entry in-process (bench/decision.py)", "model-router", "–",
                 f"{als:.1f} µs/entry" if als is not None else d.get("error", "–"), "–")
        streams = ["minimal-sse", "router-up", "router-up-usage", "router-client", "router-plain"]
        self.rate_rows("sse", "paced SSE streams/s, 32 connections", "bare-sse", streams, "streams/s")
        self.msgs_rows("ttft", "ext_proc messages/stream, paced SSE, sequential", streams, None)
        self.latency_rows("ttft", "TTFT p50, 1 connection", "bare-sse", streams, "ttft_p50_us",
                          "ttft_added_ms", ("router-up", "router-up-usage"))
        self.add("in-process decision (bench/decision.py)", "model-router", "–",
                 f"{d['total_us']:.1f} µs/req" if "total_us" in d else d.get("error", "–"), "–")
        for who, label in (("model-router", "model-router"),
                           ("the contract's own work, no decision", "the contract's own work (no decision)"),
                           ("trivial processor", LABELS["minimal"])):
            us = d.get("rows", {}).get(f"ext_proc handler, 2 messages with protobuf ({who})")
            if us is not None:
                self.add("in-process ext_proc handler, both messages with protobuf (bench/decision.py)",
                         label, "–", f"{us:.1f} µs/req", "–")
        for who, label in (("model-router", "model-router"), ("trivial processor", LABELS["minimal"])):
            us = d.get("rows", {}).get(f"ext_proc handler, caches flushed before each request ({who})")
            if us is not None:
                self.add("in-process ext_proc handler, caches flushed before each request (bench/decision.py)",
                         label, "–", f"{us:.1f} µs/req", "–")

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.HEAD) + " |", "|" + "|".join("---" for _ in self.HEAD) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


# --------------------------------------------------------------------------- main


def start_router_stack(cfg_path: Path, workdir: Path, sidecars: int, stacks: list[Stack]) -> tuple[Stack, dict]:
    d = workdir / f"stack{sidecars}"
    d.mkdir()
    stack = Stack(cfg_path, sidecars=sidecars, workdir=d)
    stacks.append(stack)
    stack.start()
    return stack, {name: p.popen.pid for name, p in stack._procs.items()}


def start_minimal(procs: Procs, backend: str, model: str, n: int = 2) -> tuple[list[str], list[int]]:
    """``n`` trivial processors sending every request to ``backend`` as ``model``."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    names = [f"minimal-{backend}-{i}" for i in range(n)]
    pids = []
    for name, addr in zip(names, addrs):
        p = procs.spawn(name, [sys.executable, str(BENCH / "minimal_extproc.py"), "--listen", addr,
                               "--backend", backend, "--model", model])
        pids.append(p.pid)
    for name, addr in zip(names, addrs):
        wait_tcp(addr, time.monotonic() + 30, lambda name=name: procs.check(name))
    return addrs, pids


def start_trivial(procs: Procs, workdir: Path, cfg, stack: Stack, backend: str, model: str) -> tuple[str, str, int, list[int]]:
    """The trivial processors for ``backend`` behind the router's bootstrap minus its metering."""
    addrs, pids = start_minimal(procs, backend, model)
    boot = envoyconf.bootstrap(cfg, standby=False, sidecar_addresses=addrs, backend_urls=stack.demo_urls,
                               listen="127.0.0.1:1", admin_listen="127.0.0.1:1")
    listen, admin, pid = start_envoy(procs, workdir, f"envoy-minimal-{backend}", trivial_bootstrap(boot))
    return listen, admin, pid, pids


def start_targets(args, procs: Procs, workdir: Path, stacks: list[Stack]) -> dict[str, Target]:
    """Every process of the run; the Envoy listeners keyed by configuration.
    Pieces that do not depend on each other start side by side."""
    nginx = start_nginx(procs, workdir)
    cfg_path = workdir / "router.yaml"
    cfg_path.write_text(router_config(f"http://{nginx}"))
    cfg = config_mod.load(cfg_path).config
    print("starting: nginx, model-router stack (2 sidecars), bare Envoy, trivial ext_proc", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=6) as pool:
        one = pool.submit(start_router_stack, cfg_path, workdir, 1, stacks) if args.one_process else None
        stack, sp = start_router_stack(cfg_path, workdir, 2, stacks)
        t = _start_beside(pool, procs, workdir, cfg, stack, sp)
        if one is not None:
            stack1, sp1 = one.result()
            t["router1"] = Target("router1", LABELS["router1"], stack1.listen, stack1.envoy_admin, sp1["envoy"],
                                  [sp1["sidecar-0"]], procs.items["nginx"].pid, list(stack1.sidecar_admin))
    return t


def _start_beside(pool: ThreadPoolExecutor, procs: Procs, workdir: Path, cfg, stack: Stack,
                  sp: dict[str, int]) -> dict[str, Target]:
    """The Envoys that share the 2-process stack's sidecars or upstreams, and the trivial processors."""
    nginx_pid = procs.items["nginx"].pid
    engine_pid = sp[f"demo-{ENGINE_BACKEND}"]
    sidecars = [sp["sidecar-0"], sp["sidecar-1"]]
    t = {
        "router": Target("router", LABELS["router"], stack.listen, stack.envoy_admin, sp["envoy"], sidecars,
                         nginx_pid, list(stack.sidecar_admin)),
        "router-sse": Target("router", LABELS["router"], stack.listen, stack.envoy_admin, sp["envoy"], sidecars,
                             engine_pid, list(stack.sidecar_admin)),
    }
    boot = envoyconf.bootstrap(cfg, standby=False, sidecar_addresses=stack.sidecar_grpc, backend_urls=stack.demo_urls,
                               listen="127.0.0.1:1", admin_listen="127.0.0.1:1", grpc_secret=stack.grpc_secret)
    nolog = pool.submit(start_envoy, procs, workdir, "envoy-nolog", no_access_log_bootstrap(boot))
    bare = pool.submit(start_envoy, procs, workdir, "envoy-bare", bare_bootstrap(boot, NGINX_BACKEND))
    bare_sse = pool.submit(start_envoy, procs, workdir, "envoy-bare-sse", bare_bootstrap(boot, ENGINE_BACKEND))
    minimal = pool.submit(start_trivial, procs, workdir, cfg, stack, NGINX_BACKEND, "llama-3.1-8b")
    minimal_sse = pool.submit(start_trivial, procs, workdir, cfg, stack, ENGINE_BACKEND, "llama-s")
    listen, admin, pid = nolog.result()
    t["router-nolog"] = Target("router-nolog", LABELS["router-nolog"], listen, admin, pid, sidecars, nginx_pid,
                               list(stack.sidecar_admin))
    listen, admin, pid = bare.result()
    t["bare"] = Target("bare", "bare Envoy", listen, admin, pid, [], nginx_pid)
    listen, admin, pid = bare_sse.result()
    t["bare-sse"] = Target("bare-sse", "bare Envoy", listen, admin, pid, [], engine_pid)
    listen, admin, pid, pids = minimal.result()
    t["minimal"] = Target("minimal", LABELS["minimal"], listen, admin, pid, pids, nginx_pid)
    listen, admin, pid, pids = minimal_sse.result()
    t["minimal-sse"] = Target("minimal-sse", LABELS["minimal"], listen, admin, pid, pids, engine_pid)
    return t


def sanity_checks(t: dict[str, Target], stack: Stack) -> None:
    """Every configuration answers as it should before anything is measured."""
    check_json("bare Envoy", t["bare"].listen, "chat", experiment=False)
    check_json("trivial ext_proc", t["minimal"].listen, "chat", experiment=False)
    check_json("model-router", t["router"].listen, "chat", experiment=True)
    check_json("model-router without access log", t["router-nolog"].listen, "chat", experiment=True)
    check_json("model-router, model without experiment", t["router"].listen, "plain", experiment=False)
    if "router1" in t:
        check_json("model-router (1 process)", t["router1"].listen, "chat", experiment=True)
    check_stream("bare Envoy (SSE)", t["bare-sse"].listen, "llama-s", {"llama-s"})
    check_stream("trivial ext_proc (SSE)", t["minimal-sse"].listen, "llama-s", {"llama-s"})
    check_stream("model-router upstream (SSE)", t["router"].listen, "chat-stream", {"llama-s", "qwen-s"})
    check_stream("model-router upstream, usage asked (SSE)", t["router"].listen, "chat-stream",
                 {"llama-s", "qwen-s"}, usage=True)
    check_stream("model-router client (SSE)", t["router"].listen, "chat-stream-client", {"chat-stream-client"})
    check_stream("model-router without experiment (SSE)", t["router"].listen, "plain-s", {"plain-s"})
    check_metering(stack, {"chat", "plain", "chat-stream", "chat-stream-client"})


def measure_all(runner: Runner, t: dict[str, Target]) -> None:
    def c(key: str, target: str, model: str, usage: bool = False) -> Config:
        return Config(key, LABELS[key], t[target], model, usage)

    ns = [c("bare", "bare", "chat"), c("minimal", "minimal", "chat"), c("router", "router", "chat")]
    one = [c("router1", "router1", "chat")] if "router1" in t else []
    nolog = c("router-nolog", "router-nolog", "chat")
    ss = [c("bare-sse", "bare-sse", "llama-s"), c("minimal-sse", "minimal-sse", "llama-s"),
          c("router-up", "router-sse", "chat-stream"),
          c("router-up-usage", "router-sse", "chat-stream", usage=True),
          c("router-client", "router-sse", "chat-stream-client"), c("router-plain", "router-sse", "plain-s")]
    for cfg in [*ns[1:], c("router-noexp", "router", "plain"), nolog, *one]:
        runner.results[("count", cfg.key)] = [count_messages(cfg.target, cfg.model, runner.count_requests)]
    print(f"measuring: {runner.seconds} s per case after {runner.warmup} s warm-up, {runner.rounds} rounds",
          file=sys.stderr, flush=True)
    runner.run_case(Case("c32", "wrk", ns + [c("router-noexp", "router", "plain"), nolog] + one, connections=32))
    if not runner.quick:  # the same generators as c32 and open: quick runs each once
        runner.run_case(Case("c1", "wrk", ns + one, connections=1))
    saturation = mean([x["rps"] for x in runner.results.get(("c32", "router"), [])])
    runner.openloop_rate = max(round(saturation / 2), 10) if saturation == saturation else 100
    runner.run_case(Case("open", "openloop", ns + [nolog], rate=runner.openloop_rate))
    if not runner.quick:
        runner.run_case(Case("open-q", "openloop", ns, rate=max(round(runner.openloop_rate / 2), 5)))
    runner.run_case(Case("sse", "wrk", ss, connections=32, stream=True))
    runner.run_case(Case("ttft", "ttft", ss))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="harness check: every stack and load generator for a few requests (1 s per case, "
                             "1 round, no 1-connection or quarter-rate case, bench/decision.py --quick); the "
                             "figures mean nothing")
    parser.add_argument("--duration", type=int, default=None, help="measured seconds per case (10; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up seconds per case (2; quick 0)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating order (at least 2; quick 1)")
    parser.add_argument("--one-process", dest="one_process", action="store_true", default=True,
                        help="also measure a stack with 1 sidecar process (default: on)")
    parser.add_argument("--no-one-process", dest="one_process", action="store_false")
    parser.add_argument("--wait-quiet", type=float, default=None, metavar="SECONDS",
                        help="first wait up to this long for a 1-minute load average below 0.7 (600; quick 0)")
    parser.add_argument("--max-minutes", type=float, default=20.0, help="stop starting new measurements after this")
    parser.add_argument("--max-foreign", type=float, default=25.0, metavar="PCT",
                        help="full run: before each measurement wait while processes outside this run use more than "
                             "PCT%% of a core, and repeat a measurement they disturbed once (0: off; off with --quick)")
    parser.add_argument("--wait-budget", type=float, default=240.0, metavar="SECONDS",
                        help="total time the checks of --max-foreign may add (default 240)")
    parser.add_argument("--json", type=Path, default=None, help="also write every measurement as JSON here")
    args = parser.parse_args()
    if args.wait_quiet is None:
        args.wait_quiet = 0.0 if args.quick else 600.0
    return args


def main() -> int:
    args = parse_args()
    if shutil.which("wrk") is None:
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    if nginx_binary() is None:
        print("nginx not found: apt-get install nginx-light", file=sys.stderr)
        return 2

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    runner = Runner(args)
    runner.quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else {
        "load_at_start": os.getloadavg()[0], "quiet": os.getloadavg()[0] < 0.7, "waited_s": 0.0}
    runner.started = time.monotonic()
    runner.deadline = runner.started + args.max_minutes * 60
    info = machine()
    print("decision cost: bench/decision.py ...", file=sys.stderr, flush=True)
    decision = start_decision(args.quick)
    tmp = tempfile.TemporaryDirectory(prefix="model-router-bench-")
    workdir = Path(tmp.name)
    procs = Procs(workdir)
    stacks: list[Stack] = []
    try:
        if not args.quick:
            runner.decision = decision_result(decision)
        t = start_targets(args, procs, workdir, stacks)
        if args.quick:
            runner.decision = decision_result(decision)
        sanity_checks(t, next(s for s in stacks if s.sidecars == 2))
        measure_all(runner, t)
    except KeyboardInterrupt:
        print("interrupted: stopping every process started", file=sys.stderr, flush=True)
        runner.notes.append("interrupted before the end")
    except (BenchError, StackError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr, flush=True)
        runner.notes.append(f"failed: {str(exc).splitlines()[0]}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for s in stacks:
            try:
                s.close()
            except Exception as exc:  # keep stopping the rest
                print(f"stopping a stack: {exc}", file=sys.stderr)
        procs.stop_all()
        if decision.poll() is None:
            decision.kill()
            decision.communicate()
        tmp.cleanup()

    report(runner, info, args)
    return 1 if any(n.startswith(("failed", "interrupted")) for n in runner.notes) else 0


def context_lines(runner: Runner) -> list[str]:
    """Facts needed to read the table: real SSE pacing, upstream load, generator health."""
    out = []
    res = runner.results
    ttft_bare = res.get(("ttft", "bare-sse"), [])
    sse_bare = res.get(("sse", "bare-sse"), [])
    if ttft_bare:
        total = mean([x["total_p50_us"] for x in ttft_bare]) / 1000
        out.append(f"- paced SSE: {STREAM_EVENTS} events, `x-demo-interval-ms: {STREAM_INTERVAL_MS}` (the demo engine's "
                   f"asyncio sleep); through bare Envoy a stream took {total:.1f} ms at 1 connection, about "
                   f"{total / STREAM_EVENTS:.2f} ms per event")
    if sse_bare:
        up = mean([x["upstream_pct"] for x in sse_bare])
        out.append(f"- the demo engine used {up:.0f}% of one core in the bare-Envoy SSE case at 32 connections")
    wrk_bare = res.get(("c32", "bare"), [])
    if wrk_bare:
        out.append(f"- wrk (1 thread) used {mean([x['generator_pct'] for x in wrk_bare]):.0f}% of one core in the bare-Envoy "
                   f"32-connection case, nginx {mean([x['upstream_pct'] for x in wrk_bare]):.0f}%, Envoy "
                   f"{mean([x['envoy_pct'] for x in wrk_bare]):.0f}%")
    logged = [x for (case, cfg), rs in res.items() if cfg in ("router", "router-up", "router-client") for x in rs
              if "als_written_per_req" in x]
    if logged:
        w = [x["als_written_per_req"] for x in logged]
        g = [x["als_received_per_req"] for x in logged if x.get("als_received_per_req") is not None]
        out.append(f"- access log: Envoy wrote {min(w):.3f}–{max(w):.3f} entries per request and the sidecars "
                   f"received {min(g):.3f}–{max(g):.3f} per request in the model-router windows (a window's last "
                   f"flush can fall into the next one)")
    ol = [x for (case, _), rs in res.items() if case == "open" for x in rs]
    if ol:
        out.append(f"- open-loop generator: pacing lag p99 at most {max(x['lag_p99_us'] for x in ol) / 1000:.2f} ms, "
                   f"its CPU at most {max(x['generator_cpu_pct'] for x in ol):.0f}% of one core; latency is counted "
                   f"from the moment the generator took a request up (waiting for a free connection included)")
    return out


def report(runner: Runner, info: dict, args) -> None:
    table = Table(runner)
    table.build()
    any_errors = any(errors_text(x) != "0" for rs in runner.results.values() for x in rs)
    foreign = [x["foreign_pct"] for rs in runner.results.values() for x in rs if "foreign_pct" in x]
    worst = max(foreign) if foreign else 0.0
    worst_top = next((x["foreign_top"] for rs in runner.results.values() for x in rs if x.get("foreign_pct") == worst), [])
    q = runner.quiet
    lines = [
        f"## model-router benchmark ({'quick' if args.quick else 'full'} run)",
        "",
        f"- {info['date']}; {info['nproc']} CPUs ({info['cpu']}), {info['memory']}; Python {info['python']}; {info['wrk']}",
        f"- {runner.seconds} s per case after {runner.warmup} s warm-up; {runner.rounds} rounds, order reversed in even "
        f"rounds; cells under `rounds` are round 1 / round 2; `value` is their mean",
        f"- load average at start {q.get('load_at_start', 0):.2f}"
        + (f" after waiting {q['waited_s']:.0f} s" if q.get("waited_s", 0) >= 1 else "")
        + ("" if q.get("quiet") else " (NOT quiet: above 0.7)")
        + f"; CPU of processes outside this run during measurements: mean {mean(foreign) if foreign else 0:.0f}%, "
        f"at most {worst:.0f}% of one core"
        + (f" ({', '.join(worst_top)})" if worst >= 5 else "")
        + (f"; waited {runner.waited:.0f} s for other work to pause and repeated {runner.repeated} disturbed "
           f"measurements (over {runner.max_foreign:.0f}% of a core outside this run; the less disturbed one is kept)"
           if runner.max_foreign else ""),
        f"- open loop: bench/openloop.py (asyncio + uvloop, 32 keep-alive connections, wrk2-style fixed schedule; "
        f"wrk2 is not packaged) at {runner.openloop_rate:,.0f} req/s = half the 2-process model-router saturation "
        f"measured at 32 connections, and at a quarter of it",
        "- errors: status >= 400, socket errors (connect/read/write) and timeouts, per round",
        "- CPU: utime+stime of the processes from /proc/<pid>/stat over the measured window, divided by completed "
        "requests (streams for SSE); `msgs/req` is the delta of Envoy's `ext_proc.stream_msgs_sent` over the delta of "
        "`http.model_router.downstream_rq_total`, the request filter's first and the response processor's after `+`",
        "- access log: sidecar CPU per request with Envoy's gRPC access log minus the same, at the same load, through "
        "an Envoy whose bootstrap has no `access_log` (the same 2 sidecar processes), round by round",
        "",
        ("**ERRORS: at least one run had errors (see the errors column).**" if any_errors else "All runs: 0 errors."),
        "",
        table.markdown(),
    ]
    lines[-4:-4] = context_lines(runner)
    met = [v for _, v in table.verdicts]
    lines += ["", f"Targets met: {sum(1 for v in met if v)} of {len(met)}."]
    for note in runner.notes:
        lines.append(f"- NOTE: {note}")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "info": info, "quiet": runner.quiet, "openloop_rate": runner.openloop_rate, "decision": runner.decision,
            "seconds": runner.seconds, "warmup": runner.warmup, "notes": runner.notes,
            "results": {f"{k[0]}/{k[1]}": v for k, v in runner.results.items()}, "table": text,
        }, indent=1))


if __name__ == "__main__":
    sys.exit(main())

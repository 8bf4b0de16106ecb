"""Reliability through real Envoy: the sidecar killed, restarted, too slow, and
its config file edited while requests are in flight.

Every loop here is bounded in count and in time; assertions are about
behaviour (statuses, bodies, where requests landed), never about latency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from grpc_health.v1 import health, health_pb2_grpc

from sidecar.devstack.stack import free_port
from sidecar.routing.assignment import assign

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, metric

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def is_openai_error(r: httpx.Response) -> bool:
    if not r.headers.get("content-type", "").startswith("application/json"):
        return False
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]


# --------------------------------------------------------------------------- sidecar killed under load

N_KEYS = 200
KEYS = [f"sk-sticky-{i:04d}" for i in range(N_KEYS)]
ARMS = (("control", 1), ("candidate", 1))
ARM_MODEL = {"control": "model-a", "candidate": "model-b"}

KILL_CONFIG = """
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
api_keys:
%s
model_experiments:
  - name: split
    model: chat
    hide_variant_models: true
    response_headers: true
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 1}
""" % "\n".join(f"  - {{key: {k}, id: caller-{i}}}" for i, k in enumerate(KEYS))

# Every request a client sends carries its kind in the message, so the demo
# engines' request logs show which kinds ever reached a backend.
LEGIT = "legit"
PROBES = {
    "reserved": (404,),  # a valid key asking for a hidden variant model directly
    "nokey": (401,),  # no key at all
    "badkey": (401,),  # a key the config does not know
}


@dataclass
class Outcome:
    kind: str
    status: int
    variant: str | None = None
    model: str | None = None
    json_error: bool = False
    exc: str | None = None


def send(http: httpx.Client, kind: str, key: str) -> Outcome:
    headers = {}
    model = "chat"
    if kind in (LEGIT, "reserved"):
        headers["authorization"] = f"Bearer {key}"
    elif kind == "badkey":
        headers["authorization"] = "Bearer sk-not-configured"
    if kind == "reserved":
        model = "model-a" if int(key[-1]) % 2 else "model-b"
    body = {"model": model, "messages": [{"role": "user", "content": kind}]}
    try:
        r = http.post(CHAT, json=body, headers=headers)
    except httpx.HTTPError as exc:
        return Outcome(kind, 0, exc=repr(exc))
    out = Outcome(kind, r.status_code, variant=r.headers.get("x-continuum-experiment-variant"))
    if r.status_code == 200:
        out.model = r.json().get("model")
    else:
        out.json_error = is_openai_error(r)
    return out


def load(url: str, stop: threading.Event, outcomes: list, seed: int, max_requests: int, max_seconds: float) -> None:
    """One client thread: a fixed mix of request kinds until told to stop (bounded)."""
    kinds = itertools.cycle([LEGIT, LEGIT, "reserved", "nokey", "badkey"])
    keys = itertools.cycle(KEYS[seed::4])
    deadline = time.monotonic() + max_seconds
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(max_requests):
            if stop.is_set() or time.monotonic() > deadline:
                return
            out = send(http, next(kinds), next(keys))
            outcomes.append(out)
            if out.status != 200:
                time.sleep(0.02)  # keep a refused client from spinning


def arms(stack, keys) -> dict[str, str]:
    def one(key):
        r = httpx.post(stack.url + CHAT, json={"model": "chat", "messages": [{"role": "user", "content": LEGIT}]},
                       headers={"authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200, r.text
        variant = r.headers["x-continuum-experiment-variant"]
        assert r.json()["model"] == ARM_MODEL[variant]
        return variant

    with ThreadPoolExecutor(6) as pool:
        return dict(zip(keys, pool.map(one, keys)))


def backend_log_is_clean(stack) -> list[dict]:
    """Every chat request a backend saw; asserts each was a decided, legitimate one."""
    seen = []
    for name in stack.demo_urls:
        for rec in demo_requests(stack, name):
            if rec["path"] != CHAT:
                continue
            seen.append(rec)
            body = rec["json"]
            assert body["messages"][0]["content"] == LEGIT, (name, body)
            assert body["model"] == ARM_MODEL["control" if name == "pool-a" else "candidate"], (name, body)
            assert "authorization" not in rec["headers"] and "x-api-key" not in rec["headers"]
    return seen


@pytest.fixture(scope="module")
def kill_stack(stack_factory):
    return stack_factory(KILL_CONFIG)


def test_sidecar_killed_under_load_fails_closed_and_stays_sticky(kill_stack, capsys):
    """SIGKILL the only sidecar while clients send legitimate requests and
    probes (reserved model, no key, unknown key): every request succeeds or
    gets a JSON 503; no probe ever reaches a backend, before, during or after
    the outage; traffic resumes after a restart and all 200 sticky callers keep
    their arm."""
    stack = kill_stack
    before = arms(stack, KEYS)
    assert before == {k: assign("split", ARMS, k).variant_id for k in KEYS}
    assert set(before.values()) == {"control", "candidate"}
    clear_demo_requests(stack)

    outcomes: list[Outcome] = []
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(stack.url, stop, outcomes, i, 2000, 40)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while sum(o.status == 200 for o in outcomes) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        up_before = len(outcomes)
        stack.stop_sidecar(sig=signal.SIGKILL)
        killed_at = len(outcomes)
        # Requests while the sidecar is down: every one must be refused.
        deadline = time.monotonic() + 10
        while len(outcomes) < killed_at + 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        down = outcomes[killed_at + 6:]  # past those that were in flight at the kill
        t0 = time.monotonic()
        stack.start_sidecar()
        ready = time.monotonic() - t0
        # Traffic resumes: the first success from the load threads after the restart.
        restarted_at = len(outcomes)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(o.status == 200 for o in outcomes[restarted_at:]):
                break
            time.sleep(0.02)
        resumed = time.monotonic() - t0
        # Some more traffic after the restart.
        target = len(outcomes) + 60
        deadline = time.monotonic() + 10
        while len(outcomes) < target and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    with capsys.disabled():
        print(f"\n[sidecar restart] readyz after {ready:.2f}s, first routed request after {resumed:.2f}s;"
              f" {len(outcomes)} requests: {dict(Counter((o.kind, o.status) for o in outcomes))}")

    assert up_before > 0 and len(down) > 0
    assert any(o.status == 200 for o in outcomes[restarted_at:]), "traffic did not resume within 10 s of the restart"
    assert all(o.status == 503 for o in down), Counter((o.kind, o.status) for o in down)
    for o in outcomes:
        assert o.exc is None, o
        if o.status == 200:
            assert o.kind == LEGIT, o
            assert o.model == ARM_MODEL[o.variant], o
        else:
            assert o.json_error, o
            assert o.status == 503 or (o.kind != LEGIT and o.status in PROBES[o.kind]), o
    assert {o.kind for o in outcomes} == {LEGIT, *PROBES}
    seen = backend_log_is_clean(stack)
    assert len(seen) >= sum(o.status == 200 for o in outcomes)

    after = arms(stack, KEYS)
    assert after == before
    backend_log_is_clean(stack)


# --------------------------------------------------------------------------- a sidecar slower than the message timeout

class SlowProcessor(pbg.ExternalProcessorServicer):
    """An ext_proc server that answers every message, too late for one phase."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.slow_phase = "request_headers"
        self.seen: list[str] = []
        self.open_streams = 0

    async def Process(self, request_iterator, context):
        self.open_streams += 1
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("request")
                self.seen.append(kind)
                if kind == self.slow_phase:
                    await asyncio.sleep(self.delay)
                if kind == "request_headers":
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body":
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                elif kind == "response_headers":
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
        finally:
            self.open_streams -= 1


class StubServer:
    """A grpc.aio server on its own event loop thread."""

    def __init__(self, servicer) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = None

    def start(self) -> StubServer:
        self.thread.start()

        async def boot():
            self.server = grpc.aio.server()
            pbg.add_ExternalProcessorServicer_to_server(self.servicer, self.server)
            health_service = health.aio.HealthServicer()  # Envoy health-checks its ext_proc cluster
            health_pb2_grpc.add_HealthServicer_to_server(health_service, self.server)
            assert self.server.add_insecure_port(self.addr) != 0
            await self.server.start()

        asyncio.run_coroutine_threadsafe(boot(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


MESSAGE_TIMEOUT_MS = 300


@pytest.fixture(scope="module")
def slow_stack(stack_factory):
    """Envoy and a demo engine, with the ext_proc cluster pointing at a stub
    that sleeps far past ``server.message_timeout_ms`` (no sidecar process)."""
    stub = StubServer(SlowProcessor(delay=MESSAGE_TIMEOUT_MS / 1000 * 4)).start()
    try:
        stack = stack_factory(f"""
server: {{grpc_listen: "{stub.addr}", message_timeout_ms: {MESSAGE_TIMEOUT_MS}}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
""", sidecars=0)
        # With no sidecar process, the bootstrap's ext_proc cluster is server.grpc_listen: the stub.
        assert f"port_value: {stub.addr.rpartition(':')[2]}" in (stack.workdir / "envoy.yaml").read_text()
        stack.wait_envoy_sees_sidecars([stub.addr], time.monotonic() + 10)
        yield stack, stub.servicer
    finally:
        stub.stop()


@pytest.mark.parametrize("phase", ["request_headers", "request_body"])
@pytest.mark.parametrize("path, family", [(CHAT, "openai"), ("/anthropic/v1/messages", "anthropic")])
def test_sidecar_slower_than_message_timeout_fails_closed(slow_stack, phase, path, family):
    """A sidecar answer later than the message timeout: the client gets a JSON
    5xx in its family's shape well before its own timeout, and the backend
    receives nothing."""
    stack, stub = slow_stack
    stub.slow_phase = phase
    stub.seen.clear()
    clear_demo_requests(stack)
    timeouts = envoy_stat(stack, "ext_proc.message_timeouts")
    r = httpx.post(stack.url + path, json={"model": "model-a", "max_tokens": 5, "messages": []}, timeout=30)
    assert 500 <= r.status_code < 600
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    if family == "openai":
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
        assert body["error"]["type"] == "server_error"
    else:
        assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
    assert "timeout" in str(body).lower()
    assert phase in stub.seen  # Envoy did reach the stub: this is a timeout, not a refused connection
    assert envoy_stat(stack, "ext_proc.message_timeouts") > timeouts
    # Once the stub's streams are over, a late answer can no longer route anything.
    deadline = time.monotonic() + 10
    while stub.open_streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stub.open_streams == 0
    assert demo_requests(stack, "pool-a") == []


def test_slow_sidecar_answer_is_the_documented_504(slow_stack):
    """A sidecar slower than the message timeout gets the documented 504 (JSON)."""
    stack, stub = slow_stack
    stub.slow_phase = "request_headers"
    r = httpx.post(stack.url + CHAT, json={"model": "model-a", "messages": []}, timeout=30)
    assert r.status_code == 504
    assert r.headers["content-type"] == "application/json" and r.json()["error"]["type"] == "server_error"


# --------------------------------------------------------------------------- config reload under load

RELOAD_V1 = """
server: {reload_interval_ms: 100}
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_experiments:
  - name: exp-v1
    model: chat
    response_headers: true
    variants: [{id: first, model: model-a, weight: 1}]
"""
RELOAD_V2 = RELOAD_V1.replace("exp-v1", "exp-v2").replace(
    "{id: first, model: model-a, weight: 1}", "{id: second, model: model-b, weight: 1}")
INVALID_EDITS = [
    RELOAD_V1 + "  - {name: broken\n",  # not YAML
    RELOAD_V1.replace("weight: 1", "weight: -1"),  # YAML, but not a valid config
]
# (experiment header, variant header, served model, engine) of each config.
SHAPE_V1 = ("exp-v1", "first", "model-a", "[pool-a] model-a")
SHAPE_V2 = ("exp-v2", "second", "model-b", "[pool-b] model-b")


@pytest.fixture(scope="module")
def reload_stack(stack_factory):
    return stack_factory(RELOAD_V1)


def reload_load(url: str, stop: threading.Event, out: list, max_requests: int, max_seconds: float) -> None:
    deadline = time.monotonic() + max_seconds
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(max_requests):
            if stop.is_set() or time.monotonic() > deadline:
                return
            try:
                r = http.post(CHAT, json={"model": "chat", "messages": [{"role": "user", "content": "x"}]})
            except httpx.HTTPError as exc:
                out.append(("error", repr(exc)))
                continue
            if r.status_code != 200:
                out.append(("status", r.status_code, r.text[:300]))
                continue
            content = r.json()["choices"][0]["message"]["content"]
            out.append((r.headers.get("x-continuum-experiment"), r.headers.get("x-continuum-experiment-variant"),
                        r.json()["model"], content[: len("[pool-a] model-a")]))
            time.sleep(0.002)


def wait_for_traffic(per_thread: list[list], more: int, at_least_s: float, limit_s: float = 10) -> None:
    """Let every client make ``more`` requests and at least ``at_least_s`` pass (at most ``limit_s``)."""
    target = [len(o) + more for o in per_thread]
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if time.monotonic() - start >= at_least_s and all(len(o) >= n for o, n in zip(per_thread, target)):
            return
        time.sleep(0.05)


def test_reload_under_load_never_fails_and_never_mixes(reload_stack):
    """Invalid edits under load: no request fails, the old config keeps
    serving and the failure counter rises. A valid edit then switches every
    client to the new config, and no response mixes the two."""
    stack = reload_stack
    per_thread: list[list] = [[], [], []]
    stop = threading.Event()
    threads = [threading.Thread(target=reload_load, args=(stack.url, stop, out, 1500, 30)) for out in per_thread]
    for t in threads:
        t.start()
    try:
        wait_for_traffic(per_thread, more=10, at_least_s=0.5)
        failures = metric(stack, "model_router_config_reloads_total", result="failure")
        for i, text in enumerate(INVALID_EDITS, 1):
            stack.config_path.write_text(text)
            deadline = time.monotonic() + 10
            while metric(stack, "model_router_config_reloads_total", result="failure") < failures + i:
                assert time.monotonic() < deadline, "the invalid edit was not noticed"
                time.sleep(0.05)
            # The old config keeps serving for a while after the rejection.
            wait_for_traffic(per_thread, more=10, at_least_s=0.7)
        during_invalid = [o[: len(o)] for o in per_thread]
        successes = metric(stack, "model_router_config_reloads_total", result="success")
        stack.config_path.write_text(RELOAD_V2)
        # Every client sees the new config, then keeps running for a while.
        deadline = time.monotonic() + 10
        while not all(o and o[-1] == SHAPE_V2 for o in per_thread) and time.monotonic() < deadline:
            time.sleep(0.05)
        wait_for_traffic(per_thread, more=20, at_least_s=1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        stack.config_path.write_text(RELOAD_V1)

    assert metric(stack, "model_router_config_reloads_total", result="success") >= successes + 1
    assert "config reload rejected" in stack.log("sidecar-0")
    for o in during_invalid:
        assert o and all(r == SHAPE_V1 for r in o), Counter(map(str, o))
    for o in per_thread:
        # Every response is exactly one config's, and each client moves from
        # the old one to the new one once, never back.
        assert all(r in (SHAPE_V1, SHAPE_V2) for r in o), [r for r in o if r not in (SHAPE_V1, SHAPE_V2)][:5]
        assert SHAPE_V2 in o
        switch = o.index(SHAPE_V2)
        assert all(r == SHAPE_V1 for r in o[:switch]) and all(r == SHAPE_V2 for r in o[switch:])
        assert len(o) - switch >= 20


def test_deeply_nested_edit_is_rejected_and_reloading_continues(reload_stack):
    """Runs last on this stack: a pathological edit is rejected like any
    invalid one, and the next valid edit still takes effect."""
    stack = reload_stack
    failures = metric(stack, "model_router_config_reloads_total", result="failure")
    successes = metric(stack, "model_router_config_reloads_total", result="success")
    try:
        stack.config_path.write_text(RELOAD_V1 + "extra: " + "[" * 2000 + "]" * 2000 + "\n")
        deadline = time.monotonic() + 3
        while metric(stack, "model_router_config_reloads_total", result="failure") <= failures:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        stack.config_path.write_text(RELOAD_V2)
        deadline = time.monotonic() + 3
        while metric(stack, "model_router_config_reloads_total", result="success") <= successes:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        r = httpx.post(stack.url + CHAT, json={"model": "chat", "messages": []}, timeout=10)
    finally:
        stack.config_path.write_text(RELOAD_V1)
    assert metric(stack, "model_router_config_reloads_total", result="failure") > failures
    assert r.headers["x-continuum-experiment"] == "exp-v2"


STRADDLE_A = """
server: {reload_interval_ms: 100}
monitor: {enabled: false}
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b, chat]}
"""
STRADDLE_B = STRADDLE_A + """
model_experiments:
  - name: exp-b
    model: chat
    response_model: client
    response_headers: true
    variants: [{id: only, model: model-a, weight: 1}]
"""


def test_request_straddling_a_reload_is_decided_by_one_config(stack_factory):
    """Headers sent under config A (no experiment, no response phase), body
    after the reload to config B (an experiment rewriting the response). Envoy
    holds the request until its body is complete, so the sidecar sees headers
    and body together, under B: the answer is wholly B's (arm model on
    pool-a, attribution headers, ``model`` rewritten to ``chat``). (The
    sidecar also keeps one config per stream, for gateways without the body
    buffer: a stream's headers fix its snapshot.)"""
    stack = stack_factory(STRADDLE_A)
    body = b'{"model": "chat", "messages": []}'
    host, _, port = stack.listen.rpartition(":")
    answered = envoy_stat(stack, "ext_proc.stream_msgs_received")
    with socket.create_connection((host, int(port)), timeout=15) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        reloads = metric(stack, "model_router_config_reloads_total", result="success")
        stack.config_path.write_text(STRADDLE_B)
        deadline = time.monotonic() + 10
        while metric(stack, "model_router_config_reloads_total", result="success") <= reloads:
            assert time.monotonic() < deadline, "the edit was not applied"
            time.sleep(0.05)
        conn.sendall(body)
        data = b""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.decode("latin-1").partition(":") for line in head.split(b"\r\n")[1:])}
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    shape = (headers.get("x-demo-engine"), headers.get("x-continuum-experiment"), json.loads(payload)["model"])
    assert shape == ("pool-a", "exp-b", "chat"), shape
    assert envoy_stat(stack, "ext_proc.stream_msgs_received") >= answered + 2  # headers and body, after the reload

"""Supervised workers, recycling, overload shedding and fail-open, through the real Envoy."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from sidecar.devstack.stack import Stack
from tests.conftest import routed_again, sidecar_metric, write_config

BASE = """
server: {{workers: {workers}, max_requests_per_worker: {recycle}, max_in_flight: {in_flight}}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
  - {{name: pool-b, url: "demo://", models: [model-b]}}
model_experiments:
  - name: split
    model: chat
    response_model: client
    variants:
      - {{id: control, model: model-a, weight: 50}}
      - {{id: candidate, model: model-b, weight: 50}}
"""


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


class Load:
    """Client threads that check every answer: buffered and streamed chat, rewritten."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.log: list[tuple[float, str]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def wait(self, enough, what: str, timeout: float = 60.0) -> None:
        """Wait until ``enough(log)`` holds: a stretch of load is a number of
        answers, not a span of time, however busy the machine is."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                log = list(self.log)
            if enough(log):
                return
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {Counter(o for _, o in log)}"
            time.sleep(0.05)

    def _run(self, seed: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self.stop.is_set():
                n += 1
                outcome = self._one(http, f"caller-{seed}-{n}", stream=n % 3 == 0)
                with self.lock:
                    self.outcomes[outcome] += 1
                    self.log.append((time.monotonic(), outcome))

    @staticmethod
    def _one(http: httpx.Client, key: str, stream: bool) -> str:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        headers = {"authorization": f"Bearer {key}"}
        try:
            if not stream:
                r = http.post("/v1/chat/completions", json=body, headers=headers)
                return "ok" if r.status_code == 200 and r.json()["model"] == "chat" else f"status {r.status_code} {r.text[:200]}"
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    return f"status {r.status_code} {r.read()[:200]!r}"
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            models = {json.loads(line[6:])["model"] for line in lines if line != "data: [DONE]"}
            return "ok" if lines and lines[-1] == "data: [DONE]" and models == {"chat"} else "bad stream"
        except httpx.HTTPError as exc:
            return type(exc).__name__


def supervised_stack(tmp_path: Path, workers: int, recycle: int = 0, in_flight: int = 256) -> Stack:
    cfg = write_config(tmp_path, BASE.format(workers=workers, recycle=recycle, in_flight=in_flight))
    return Stack(cfg, workdir=tmp_path, sidecars=workers, supervised=True).start()


def worker_metric(stack: Stack, i: int, name: str, **labels) -> float:
    text = httpx.get(f"http://{stack.sidecar_admin[i]}/metrics", timeout=5).text
    return sidecar_metric(text, name, **labels)


def test_a_killed_worker_is_restarted_and_the_others_serve_meanwhile(tmp_path):
    stack = supervised_stack(tmp_path, workers=2)
    restarted: list[int] = []
    try:
        supervisor = stack._procs["sidecar-supervisor"].popen.pid
        before = children(supervisor)
        assert len(before) == 2
        with Load(stack.url) as load:
            load.wait(lambda log: sum(o == "ok" for _, o in log) >= 20, "20 answers before the kill")
            victim = before[0]
            killed_at = time.monotonic()
            subprocess.run(["kill", "-KILL", str(victim)], check=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not restarted:
                restarted = [p for p in children(supervisor) if p not in before]
                time.sleep(0.05)
            assert len(restarted) == 1, "the supervisor did not start a replacement"
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://{stack.sidecar_admin[0]}/readyz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            back_at = time.monotonic()
            load.wait(lambda log: sum(t > back_at + 1 for t, _ in log) > 50, "50 answers once the worker is back")
        outage = [o for t, o in load.log if killed_at < t < back_at]
        settled = [o for t, o in load.log if t > back_at + 1]
        # Envoy ejects the dead worker on its first failed connection: the
        # other one serves while the supervisor restarts it...
        assert outage.count("ok") > 10, Counter(outage)
        # ...and once it is back every request succeeds.
        assert len(settled) > 50 and set(settled) == {"ok"}, Counter(settled)
        crashes = [worker_metric(stack, i, "model_router_worker_restarts", reason="crash") for i in range(2)]
        assert crashes == [1, 0]
    finally:
        stack.close()
    assert all(not Path(f"/proc/{p}").exists() for p in before[1:] + restarted), "a worker outlived the stack"


def test_a_killed_supervisor_takes_its_workers_with_it(tmp_path):
    # SIGKILL cannot be forwarded: the kernel sends each worker SIGTERM when
    # its parent dies, and the worker drains and exits.
    stack = supervised_stack(tmp_path, workers=2)
    workers: list[int] = []
    try:
        supervisor = stack._procs["sidecar-supervisor"].popen.pid
        workers = children(supervisor)
        assert len(workers) == 2
        assert httpx.post(f"{stack.url}/v1/chat/completions", json={"model": "chat", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=30).status_code == 200
        subprocess.run(["kill", "-KILL", str(supervisor)], check=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.1)
        assert [p for p in workers if _alive(p)] == [], "a worker outlived its supervisor"
    finally:
        stack.close()
        for pid in [p for p in workers if _alive(p)]:  # what the test starts, it stops
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_recycling_under_load_fails_no_request(tmp_path):
    stack = supervised_stack(tmp_path, workers=1, recycle=150)
    try:
        with Load(stack.url) as load:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                try:
                    if worker_metric(stack, 0, "model_router_worker_restarts", reason="recycle") >= 3:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            recycled = len(load.log)
            load.wait(lambda log: len(log) >= recycled + 20, "20 answers after the third recycle")
        # (While one drains, old and new worker share the admin port: wait for the old to go.)
        supervisor = stack._procs["sidecar-supervisor"].popen.pid
        deadline = time.monotonic() + 30
        while len(children(supervisor)) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        log = stack.log("sidecar-supervisor")[-3000:]
        assert len(children(supervisor)) == 1, f"a drained worker does not exit:\n{log}"
        recycles = worker_metric(stack, 0, "model_router_worker_restarts", reason="recycle")
        assert recycles >= 3, f"only {recycles} recycles:\n{log}"
        assert worker_metric(stack, 0, "model_router_worker_restarts", reason="crash") == 0
        assert set(load.outcomes) == {"ok"}, load.outcomes
        served = load.outcomes["ok"]
        # Each record follows its access-log entry, flushed by Envoy on its own
        # clock: wait for the count, with room for a loaded machine.
        deadline = time.monotonic() + 60
        records = 0
        while time.monotonic() < deadline:
            records = len(stack.usage_records.read_text().splitlines())
            if records >= served:
                break
            time.sleep(0.2)
        assert records == served, f"{served} requests, {records} usage records"
    finally:
        stack.close()


def test_without_a_supervisor_a_due_process_leaves_drains_and_exits_0(tmp_path):
    """``serve --no-supervisor`` (how a pod runs it): every request up to its
    bound is answered, then the process goes unready, drains and exits 0;
    started again (here by the stack, in a pod by the kubelet) it serves."""
    stack = Stack(write_config(tmp_path, BASE.format(workers=1, recycle=40, in_flight=256)), workdir=tmp_path).start()
    try:
        assert "--no-supervisor" in stack._procs["sidecar-0"].argv
        first = stack._procs["sidecar-0"].popen
        ready = f"http://{stack.sidecar_admin[0]}/readyz"
        outcomes: Counter[str] = Counter()
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            while httpx.get(ready, timeout=5).status_code == 200:
                n = sum(outcomes.values()) + 1
                assert n <= 60, f"still ready after {n - 1} requests; bound 40 within 10 %"
                outcomes[Load._one(http, f"caller-{n}", stream=n % 3 == 0)] += 1
        assert set(outcomes) == {"ok"} and sum(outcomes.values()) >= 36, outcomes
        assert first.wait(timeout=60) == 0
        said: list[str] = []
        deadline = time.monotonic() + 60
        while not any("and ready" in line for line in said) and time.monotonic() < deadline:
            stack.poll(said.append)
            time.sleep(0.2)
        assert any("sidecar-0 exited (code 0)" in line for line in said), said
        assert stack._procs["sidecar-0"].popen.pid != first.pid and any("and ready" in line for line in said), said
        stack.wait_envoy_sees_sidecars(stack.sidecar_grpc, time.monotonic() + 30)
        routed_again(stack)
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            assert Load._one(http, "caller-after", stream=True) == "ok"
    finally:
        stack.close()


def _held_stream(addr: str) -> socket.socket:
    """A streamed answer whose events come 30 s apart: its response stream (the
    model is rewritten) stays open on the sidecar. Envoy buffers request bodies
    before the decision, so a slow upload would hold no stream."""
    host, _, port = addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    body = b'{"model": "chat", "stream": true, "messages": [{"role": "user", "content": "slow"}]}'
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"authorization: Bearer slow\r\nx-demo-events: 3\r\nx-demo-interval-ms: 30000\r\n"
              b"content-length: %d\r\n\r\n" % len(body) + body)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    return s


def test_overload_is_refused_at_once_with_retry_after(tmp_path):
    stack = supervised_stack(tmp_path, workers=1, in_flight=2)
    held: list[socket.socket] = []
    try:
        held = [_held_stream(stack.listen) for _ in range(2)]
        deadline = time.monotonic() + 10
        while worker_metric(stack, 0, "model_router_in_flight_streams") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                       json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "router_overloaded"
        a = httpx.post(f"{stack.url}/anthropic/v1/messages", timeout=10, headers={"anthropic-version": "2023-06-01"},
                       json={"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert a.status_code == 503 and a.json()["error"]["type"] == "overloaded_error"
        assert worker_metric(stack, 0, "model_router_shed_total") == 2
        # Once the held streams end, requests are served again.
        for s in held:
            s.close()
        deadline = time.monotonic() + 30
        while worker_metric(stack, 0, "model_router_in_flight_streams") > 0:
            assert time.monotonic() < deadline, "the held streams never ended"
            time.sleep(0.05)
        ok = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
    finally:
        for s in held:
            s.close()
        stack.close()


FAIL_OPEN = """
server: {{failure_mode: open}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
{extra}
"""


def test_fail_open_is_refused_when_it_would_skip_a_gate(tmp_path):
    keys = 'api_keys:\n  - {key: sk-1, id: team-a, allowed_models: [model-a]}\n'
    hidden = ("model_experiments:\n  - name: e\n    model: chat\n    hide_variant_models: true\n    variants:\n"
              "      - {id: c, model: model-a, weight: 1}\n")
    for extra, words in ((keys, "api_keys"), (hidden, "hides its variant models")):
        path = write_config(tmp_path, FAIL_OPEN.format(extra=extra))
        res = subprocess.run([sys.executable, "-m", "sidecar", "config", "validate", str(path)],
                             capture_output=True, text=True)
        assert res.returncode == 1
        assert "server.failure_mode" in res.stderr and words in res.stderr, res.stderr


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_with_the_sidecar_down_requests_fail_closed_or_pass_untouched(tmp_path, mode):
    cfg = write_config(tmp_path, FAIL_OPEN.format(extra="").replace("failure_mode: open", f"failure_mode: {mode}"))
    with Stack(cfg, workdir=tmp_path) as stack:
        stack.stop_sidecar()
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                       json={"model": "model-a", "messages": [{"role": "user", "content": "hi"}]})
        if mode == "open":
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "model-a"
            assert r.headers["x-demo-engine"] == "pool-a"
        else:
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "upstream_unavailable"


def test_a_recycle_whose_port_is_taken_is_tried_again(tmp_path):
    stack = supervised_stack(tmp_path, workers=1, recycle=100)
    host, _, port = stack.sidecar_grpc[0].rpartition(":")
    squatter = socket.socket()
    squatter.bind((host, int(port) + 1))  # the slot's second port, where the replacement goes
    squatter.listen()
    try:
        with Load(stack.url) as load:
            deadline = time.monotonic() + 60
            while "replacement exited" not in stack.log("sidecar-supervisor") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "replacement exited" in stack.log("sidecar-supervisor")
            squatter.close()
            while time.monotonic() < deadline:
                if "recycled" in stack.log("sidecar-supervisor"):
                    break
                time.sleep(0.1)
        assert "recycled" in stack.log("sidecar-supervisor"), stack.log("sidecar-supervisor")[-3000:]
        assert set(load.outcomes) == {"ok"}, load.outcomes
    finally:
        squatter.close()
        stack.close()

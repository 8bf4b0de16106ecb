"""The backend monitor: model lists, the freshness and admission rules, and live polling of demo engines."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import MappingProxyType

import aiohttp
import orjson
import pytest

from sidecar.backends.monitor import Monitor
from sidecar.backends.state import BackendState, auth_headers, parse_models, poll_url
from sidecar.config.schema import parse
from sidecar.devstack.stack import free_port
from sidecar.metrics import REGISTRY
from sidecar.routing.snapshot import build

from ..conftest import is_monitor_probe
from ..unit.test_engines import page

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- parsing


def test_parse_models():
    body = b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}, {"id": "a"}, {"id": 3}, {"x": 1}, "c", {"id": ""}]}'
    assert parse_models(body) == ("a", "b")
    assert parse_models('{"data": []}') == ()
    # llama-server --alias tiny-b,tiny: one entry, every name in its aliases
    llama = b'{"models": [{"name": "tiny"}], "object": "list", "data": [{"id": "tiny", "aliases": ["tiny", "tiny-b"], "owned_by": "llamacpp"}]}'
    assert parse_models(llama) == ("tiny", "tiny-b")
    odd = rb'{"data": [{"id": "a", "aliases": "b"}, {"id": "c", "aliases": [1, "", "d\u0000", "e", null]}, {"aliases": ["f"]}]}'
    assert parse_models(odd) == ("a", "c", "e", "f")
    # An engine's names are held to the rule request bodies are: a name no
    # request could ask for is not listed.
    unaskable = orjson.dumps({"data": [{"id": n} for n in ("c1\x85", "sep\u2028", "   ", "x" * 257, "x" * 256, "ok")]})
    assert parse_models(unaskable) == ("x" * 256, "ok")
    for bad in (b"[]", b'{"models": []}', b"not json", b'{"data": {}}'):
        with pytest.raises(ValueError):
            parse_models(bad)


# --------------------------------------------------------------------------- admission and freshness


def test_admissible():
    s = BackendState("a", waiting=4.0, scraped_at=100.0)
    assert s.admissible(100.0, None)
    assert s.admissible(100.0, 4)
    assert not s.admissible(100.0, 3)
    assert BackendState("a").admissible(0.0, 0)  # unknown queue never blocks
    assert not BackendState("a", healthy=False).admissible(0.0, None)
    held = BackendState("a", held_out_until=50.0)
    assert not held.admissible(49.9, None)
    assert held.admissible(50.0, None)
    # With a freshness bound, a stale queue figure no longer blocks.
    assert not s.admissible(105.0, 3, freshness_s=5.0)
    assert s.admissible(105.1, 3, freshness_s=5.0)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def snapshot_from(text: str, urls: dict[str, str] | None = None):
    return build(parse(textwrap.dedent(text), env={}).config, url_overrides=urls or {})


def test_freshness_rule_with_fake_clock():
    snap = snapshot_from(
        """
        monitor: {freshness_s: 5}
        backends: [{name: a, url: "http://127.0.0.1:1", type: vllm}]
        """
    )
    clock = FakeClock(100.0)
    mon = Monitor(lambda: snap, clock=clock)
    state = BackendState("a", throughput_tps=50.0, waiting=3.0, running=2.0, scraped_at=100.0)
    assert mon.load(state, 105.0) == (50.0, 3.0, 2.0)
    assert mon.throughput(state, 105.0) == 50.0
    assert mon.load(state, 105.01) == (None, None, None)
    assert mon.throughput(state, 105.01) is None
    assert mon.throughput(BackendState("a"), 100.0) is None


def test_poll_url_and_credentials():
    snap = snapshot_from(
        """
        backends:
          - {name: o, url: "https://api.example.com/proxy/v1", api_key: sk-o}
          - {name: an, url: "https://api.example.com", type: anthropic, api_key: ak-a}
          - {name: plain, url: "http://127.0.0.1:8000/"}
        """
    )
    o, an, plain = snap.backends["o"], snap.backends["an"], snap.backends["plain"]
    assert poll_url(o, "/v1/models") == "https://api.example.com/proxy/v1/models"
    assert poll_url(plain, "/health") == "http://127.0.0.1:8000/health"
    assert auth_headers(o) == {"authorization": "Bearer sk-o"}
    assert auth_headers(an) == {"x-api-key": "ak-a", "anthropic-version": "2023-06-01"}
    assert auth_headers(plain) == {}


# --------------------------------------------------------------------------- live helpers


class Engine:
    """A demo engine subprocess on a free loopback port."""

    def __init__(self, name: str, models: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "sidecar", "demo-engine", "--port", str(self.port), "--name", name]
        for m in models:
            argv += ["--model", m]
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
        )
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"demo engine {name} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"demo engine {name} did not become ready")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


@pytest.fixture
def engines():
    started: list[Engine] = []

    def start(name: str = "e", models: list[str] | None = None) -> Engine:
        e = Engine(name, models or ["demo-model"])
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def wait_for(predicate, what: str, timeout: float = 5.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


async def wait_for_async(read, done, what: str, timeout: float = 10.0, interval: float = 0.05):
    """Poll the coroutine ``read()`` until ``done(value)``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what} (last {value!r})")
        await asyncio.sleep(interval)


async def model_listings(url: str) -> int:
    """How many model listings the monitor has sent a demo engine."""
    return sum(r["path"] == "/v1/models" and is_monitor_probe(r) for r in await demo(url, "GET", "/_demo/requests"))


async def demo(url: str, method: str = "POST", path: str = "/_demo/state", **body):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body if method == "POST" else None) as r:
            assert r.status == 200
            return await r.json()


FAST = """
monitor:
  probe_interval_s: 0.1
  scrape_interval_s: 0.2
  models_interval_s: 0.2
  freshness_s: {freshness}
  timeout_s: 0.5
  passive_holdout_s: 5
backends:
  - {{name: a, url: "demo://", type: vllm}}
"""


def fast(freshness: float = 2.0) -> str:
    return FAST.format(freshness=freshness)


# --------------------------------------------------------------------------- live tests


def test_discovery_finds_models_and_reports_changes(engines):
    eng = engines("a", ["llama-3.1-8b", "qwen3-8b"])
    snap = snapshot_from(fast(), {"a": eng.url})
    seen: list[dict] = []

    async def main():
        mon = Monitor(lambda: snap, on_models_changed=seen.append)
        await mon.start()
        try:
            await wait_for(lambda: mon.states["a"].models_ok, "discovery")
            state = mon.states["a"]
            assert state.models == ("llama-3.1-8b", "qwen3-8b")
            assert state.healthy
            assert seen == [{"a": ("llama-3.1-8b", "qwen3-8b")}]
            # More polls with the same list report nothing new: three more listings.
            listed = await model_listings(eng.url)
            await wait_for_async(lambda: model_listings(eng.url), lambda n: n >= listed + 3, "three more listings")
            assert len(seen) == 1
        finally:
            await mon.stop()

    run(main())


def test_throughput_follows_generated_tokens(engines):
    eng = engines()
    snap = snapshot_from(fast(), {"a": eng.url})
    tokens, interval = 10_000, 0.2

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            # Two scrapes with an unchanged counter: a statement of zero, not "unknown".
            await wait_for(lambda: mon.throughput(mon.states["a"], time.monotonic()) == 0.0, "zero throughput")
            await demo(eng.url, extra_generation_tokens=tokens)
            tps = await wait_for(lambda: mon.throughput(mon.states["a"], time.monotonic()), "throughput > 0")
            assert math.isfinite(tps)
            assert tokens / (interval * 5) <= tps <= tokens / (interval / 5)
            # No more tokens: the next pair says zero again.
            await wait_for(lambda: mon.throughput(mon.states["a"], time.monotonic()) == 0.0, "throughput back to 0")
        finally:
            await mon.stop()

    run(main())


def test_waiting_and_running_follow_the_engine_and_gate_admission(engines):
    eng = engines()
    snap = snapshot_from(fast().replace("passive_holdout_s: 5", "passive_holdout_s: 5\n  max_waiting: 5"), {"a": eng.url})

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(lambda: mon.states["a"].scraped_at is not None, "first scrape")
            assert mon.admissible(mon.states["a"], time.monotonic())
            await demo(eng.url, waiting=7, running=3)
            await wait_for(lambda: mon.load(mon.states["a"], time.monotonic())[1] == 7.0, "waiting == 7")
            state = mon.states["a"]
            _, waiting, running = mon.load(state, time.monotonic())
            assert waiting == 7.0 and running >= 3.0  # running also counts in-flight /v1 requests
            now = time.monotonic()
            assert not mon.admissible(state, now)
            assert not state.admissible(now, 5)
            assert state.admissible(now, 7)
            await demo(eng.url, waiting=0)
            await wait_for(lambda: mon.states["a"].waiting == 0.0, "waiting == 0")
            assert mon.admissible(mon.states["a"], time.monotonic())
        finally:
            await mon.stop()

    run(main())


def test_active_probe_follows_engine_health(engines):
    eng = engines()
    snap = snapshot_from(fast(), {"a": eng.url})

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(lambda: mon.states["a"].models_ok, "discovery")
            assert mon.states["a"].healthy
            await demo(eng.url, healthy=False)
            await wait_for(lambda: not mon.states["a"].healthy, "unhealthy")
            assert not mon.admissible(mon.states["a"], time.monotonic())
            await demo(eng.url, healthy=True)
            await wait_for(lambda: mon.states["a"].healthy, "healthy again")
            await wait_for(lambda: mon.states["a"].models_ok, "models listed again")
        finally:
            await mon.stop()

    run(main())


def test_a_generation_check_marks_down_after_two_failures_in_a_row(engines, caplog):
    eng = engines()
    snap = snapshot_from(fast().replace("type: vllm", "type: sglang"), {"a": eng.url})
    assert snap.backends["a"].config.health_check.kind == "generation"
    caplog.set_level(logging.INFO, logger="model_router.monitor")

    async def checks_arrived(n: int) -> None:
        """Wait until the engine has seen ``n`` health checks (so the one before has been judged)."""
        deadline = time.monotonic() + 10
        while (await demo(eng.url))["health_checks"] < n:
            assert time.monotonic() < deadline, f"the engine never saw {n} health checks"
            await asyncio.sleep(0.02)

    async def main():
        await demo(eng.url, health_fail_next=1)  # before any check passed, one failure is a verdict
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(lambda: "failed 1 time(s) in a row" in caplog.text, "down at the first check")
            await wait_for(lambda: mon.states["a"].healthy, "healthy at the next one")
            caplog.clear()
            n = (await demo(eng.url, health_fail_next=1))["health_checks"]
            await checks_arrived(n + 3)  # the failing check and a passing one were judged
            assert mon.states["a"].healthy and mon.states["a"].probe_failures == 0
            assert "generation health check /health failed (1 of 2 before it is marked down)" in caplog.text
            assert "is down" not in caplog.text
            await demo(eng.url, health_fail_next=2)
            await wait_for(lambda: "is down: its generation health check /health failed 2 time(s)" in caplog.text,
                           "down after two failures")
            await wait_for(lambda: mon.states["a"].healthy and "healthy again" in caplog.text, "healthy again")
        finally:
            await mon.stop()

    run(main())


def missing_gauge(backend: str) -> float | None:
    return REGISTRY.get_sample_value("model_router_backend_engine_metrics_missing", {"backend": backend})


def test_a_backend_without_its_engine_metrics_is_warned_about_once(engines, caplog):
    sglang, vllm = engines("s"), engines("v")
    snap = snapshot_from(
        fast().replace("name: a, url: \"demo://\", type: vllm", "name: s, url: \"demo://\", type: sglang")
        + '  - {name: v, url: "demo://", type: vllm}\n',
        {"s": sglang.url, "v": vllm.url},
    )
    caplog.set_level(logging.INFO, logger="model_router.monitor")

    def warnings(name: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and f"backend {name} shows none" in r.getMessage()]

    async def scraped(url: str, more: int) -> None:
        n = (await demo(url))["metrics_scrapes"] + more
        deadline = time.monotonic() + 10
        while (await demo(url))["metrics_scrapes"] < n:
            assert time.monotonic() < deadline, f"the engine at {url} was not scraped {more} more times"
            await asyncio.sleep(0.02)

    async def main():
        await demo(sglang.url, metrics_enabled=False)  # SGLang without --enable-metrics: 404
        await demo(vllm.url, metrics_page="process_cpu_seconds_total 1\n")  # vLLM with --disable-log-stats
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await scraped(sglang.url, 5)
            await scraped(vllm.url, 5)
            assert warnings("s") == [
                "monitor: backend s shows none of the sglang metrics the router reads at /metrics (status 404), "
                "so :nitro cannot rank it and the max_waiting gate cannot see its queue; "
                "SGLang serves them only when started with --enable-metrics"
            ]
            assert len(warnings("v")) == 1 and "(the page has none of the series read)" in warnings("v")[0]
            assert "--disable-log-stats" in warnings("v")[0]
            assert mon.states["s"].metrics == mon.states["v"].metrics == "missing"
            assert mon.states["s"].engine == "sglang" and mon.load(mon.states["v"], time.monotonic()) == (None,) * 3
            assert missing_gauge("s") == missing_gauge("v") == 1.0

            await demo(sglang.url, metrics_enabled=True, metrics_page=page("sglang-default"))
            await wait_for(lambda: mon.states["s"].metrics == "ok", "metrics seen")
            assert missing_gauge("s") == 0.0 and mon.states["s"].waiting == 6.0
            assert "backend s shows its engine metrics again" in caplog.text
            await demo(sglang.url, metrics_enabled=False)  # lost again: a new warning
            await wait_for(lambda: len(warnings("s")) == 2, "a second warning")
        finally:
            await mon.stop()

    run(main())


class ClosingServer:
    """An HTTP/1.1 server that, like an engine whose keep-alive timer fires as a request
    arrives, drops a request that comes on a connection idle for ``idle_s`` or more."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.answered: list[str] = []
        self.dropped = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        last = None
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                if last is not None and time.monotonic() - last >= self.idle_s:
                    self.dropped += 1
                    return
                path = head.split(b" ", 2)[1].decode()
                body = b'{"data": [{"id": "m"}]}' if path.startswith("/v1/models") else b'{"status": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                self.answered.append(path)
                last = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_polls_never_reuse_a_connection_the_engine_may_be_closing(caplog):
    """Engines close a connection idle for 5 s; the monitor keeps one idle for at most 2.5 s.
    The stand-in closes at 3 s and the monitor polls every 3.5 s: every poll must open a
    new connection rather than meet a closing one."""
    caplog.set_level(logging.INFO, logger="model_router.monitor")

    async def main():
        stub = ClosingServer(idle_s=3.0)
        url = await stub.start()
        snap = snapshot_from(f"""
            monitor: {{probe_interval_s: 3.5, models_interval_s: 3.5}}
            backends: [{{name: a, url: "{url}", health_path: /health}}]
            """)
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(lambda: stub.answered.count("/health") >= 3, "three health checks", timeout=20)
        finally:
            await mon.stop()
            stub.server.close()
        assert stub.dropped == 0
        assert mon.states["a"].healthy and "is down" not in caplog.text

    run(main())


def test_stopped_engine_goes_unhealthy_keeps_models_and_load_goes_stale(engines):
    eng = engines("a", ["m1"])
    freshness = 0.6
    snap = snapshot_from(fast(freshness), {"a": eng.url})

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(
                lambda: mon.states["a"].models_ok and mon.throughput(mon.states["a"], time.monotonic()) is not None,
                "discovery and a throughput figure",
            )
            await asyncio.to_thread(eng.stop)
            await wait_for(lambda: not mon.states["a"].healthy, "unhealthy after stop")
            await wait_for(lambda: not mon.states["a"].models_ok, "models_ok false after stop")
            assert mon.states["a"].models == ("m1",)
            await wait_for(lambda: mon.throughput(mon.states["a"], time.monotonic()) is None, "stale throughput")
            assert mon.load(mon.states["a"], time.monotonic()) == (None, None, None)
            # The published state drops the stale figures too; the scrape time stays.
            await wait_for(lambda: mon.states["a"].waiting is None, "stale waiting dropped")
            state = mon.states["a"]
            assert state.throughput_tps is None and state.running is None
            assert state.scraped_at is not None
        finally:
            await mon.stop()

    run(main())


def test_passive_holdout_with_fake_clock():
    port = free_port()  # nothing listens here
    snap = snapshot_from(
        f"""
        monitor: {{passive_holdout_s: 10, models_interval_s: 0.2, timeout_s: 0.5}}
        backends: [{{name: hosted, url: "http://127.0.0.1:{port}", type: openai}}]
        """
    )
    clock = FakeClock(1000.0)

    async def main():
        mon = Monitor(lambda: snap, clock=clock)
        await mon.start()
        try:
            before = mon.states
            assert before["hosted"].admissible(clock(), None)  # no probe path: healthy until a failure
            for status in (200, 404, 429, 499):
                mon.report_response("hosted", status)
            assert mon.states is before
            mon.report_response("nope", 503)  # unknown backend: ignored
            mon.report_response("hosted", 503)
            state = mon.states["hosted"]
            assert mon.states is not before
            assert state.held_out_until == 1010.0
            assert state.healthy  # the probe result; the hold-out is time-bound
            assert not state.admissible(clock(), None)
            clock.now = 1009.99
            assert not mon.states["hosted"].admissible(clock(), None)
            mon.report_response("hosted", None)  # a reset extends the hold-out
            assert mon.states["hosted"].held_out_until == pytest.approx(1019.99)
            clock.now = 1020.0
            assert mon.states["hosted"].admissible(clock(), None)
            await wait_for(lambda: mon.states["hosted"].models is None and not mon.states["hosted"].models_ok, "failed listing")
            assert mon.states["hosted"].healthy
        finally:
            await mon.stop()

    run(main())


def test_credentials_on_model_listing_and_no_key_in_logs(engines, caplog):
    eng = engines("k", ["m"])
    snap = snapshot_from(
        """
        monitor: {probe_interval_s: 0.1, scrape_interval_s: 0.1, models_interval_s: 0.1}
        backends:
          - {name: o, url: "demo://", type: openai, api_key: sk-secret-openai}
          - {name: an, url: "demo://", type: anthropic, api_key: sk-secret-anthropic}
          - {name: down, url: "http://127.0.0.1:1", type: vllm, api_key: sk-secret-down}
        """,
        {"o": eng.url, "an": eng.url},
    )
    caplog.set_level(logging.DEBUG, logger="model_router.monitor")

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            await wait_for(lambda: mon.states["o"].models_ok and mon.states["an"].models_ok, "discovery")
            await wait_for(lambda: not mon.states["down"].healthy, "unreachable backend unhealthy")
            records = await demo(eng.url, "GET", "/_demo/requests")
        finally:
            await mon.stop()
        return records

    records = run(main())
    listings = [r for r in records if r["path"] == "/v1/models"]
    openai = [r for r in listings if r["headers"].get("authorization") == "Bearer sk-secret-openai"]
    anthropic = [r for r in listings if r["headers"].get("x-api-key") == "sk-secret-anthropic"]
    assert openai and anthropic
    assert all("x-api-key" not in r["headers"] for r in openai)
    assert all(r["headers"].get("anthropic-version") == "2023-06-01" for r in anthropic)
    assert all("authorization" not in r["headers"] for r in anthropic)
    assert "down" in caplog.text
    assert "sk-secret" not in caplog.text


def test_disabled_monitor_polls_nothing_and_reloads_take_effect(engines):
    eng = engines("a", ["m1"])
    disabled = snapshot_from(fast().replace("monitor:", "monitor:\n  enabled: false"), {"a": eng.url})
    enabled = snapshot_from(fast(), {"a": eng.url})
    two = snapshot_from(fast() + '  - {name: b, url: "demo://", type: vllm}\n', {"a": eng.url, "b": eng.url})
    only_b = snapshot_from(fast().replace("name: a", "name: b"), {"b": eng.url})
    current = [disabled]
    seen: list[dict] = []

    async def main():
        mon = Monitor(lambda: current[0], on_models_changed=seen.append)
        await mon.start()
        try:
            assert set(mon.states) == {"a"}
            await asyncio.sleep(0.6)
            assert await demo(eng.url, "GET", "/_demo/requests") == []
            assert mon.states["a"] == BackendState("a")
            mon.report_response("a", 503)
            assert mon.states["a"].admissible(time.monotonic(), 0)
            assert seen == []

            current[0] = enabled
            await wait_for(lambda: mon.states["a"].models == ("m1",), "discovery after enabling")
            assert seen[-1] == {"a": ("m1",)}

            current[0] = two
            await wait_for(lambda: "b" in mon.states and mon.states["b"].models_ok, "added backend discovered")
            assert seen[-1] == {"a": ("m1",), "b": ("m1",)}

            current[0] = only_b
            await wait_for(lambda: "a" not in mon.states, "removed backend dropped")
            assert set(mon.states) == {"b"}
            assert seen[-1] == {"b": ("m1",)}

            current[0] = disabled
            await wait_for(lambda: set(mon.states) == {"a"} and mon.states["a"] == BackendState("a"), "disabled again")
            assert seen[-1] == {}
        finally:
            await mon.stop()

    run(main())


def test_states_is_a_new_immutable_mapping_per_change(engines):
    eng = engines()
    snap = snapshot_from(fast(), {"a": eng.url})

    async def main():
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            first = mon.states
            assert isinstance(first, MappingProxyType)
            with pytest.raises(TypeError):
                first["a"] = BackendState("a")  # type: ignore[index]
            await demo(eng.url, waiting=3)
            await wait_for(lambda: mon.states["a"].waiting == 3.0, "waiting == 3")
            assert first is not mon.states
            assert first.get("a") is None or first["a"].waiting != 3.0
        finally:
            await mon.stop()

    run(main())

"""Shared fixtures: real stacks (demo engines + sidecar + Envoy) on loopback."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.backends.monitor import USER_AGENT
from sidecar.devstack.stack import Stack, StackError
from tests.support import properties
from tests.support.servers import RedisServer

# Hypothesis profiles (derandomized under CI) and example budgets: tests/support/properties.py.
properties.load()


def docker_daemon_problem() -> str | None:
    """Why no Docker daemon can be used here, or None when one answers."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as exc:  # the SDK raises several kinds when there is no daemon
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config, items):
    """Every test under tests/integration/ carries the ``integration`` marker
    (tests/unit/ starts no process: its conftest refuses one).

    With MODEL_ROUTER_ENVOY_IMAGE, Envoy runs in a container (testcontainers):
    without a Docker daemon the integration tests skip, saying why."""
    for item in items:
        if INTEGRATION in Path(item.fspath).resolve().parents and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)
    image = os.environ.get("MODEL_ROUTER_ENVOY_IMAGE")
    if not image:
        return
    problem = docker_daemon_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=f"MODEL_ROUTER_ENVOY_IMAGE={image} needs a Docker daemon, and none answers ({problem})")
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(skip)


def write_config(directory: Path, text: str, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory):
    """Start stacks from config text; every stack started is stopped at module end."""
    stacks: list[Stack] = []

    def make(config_text: str, **kwargs) -> Stack:
        # Free ports are picked by binding and releasing them; on a busy machine
        # another process can take one in between, so a start may be retried.
        for attempt in range(3):
            d = tmp_path_factory.mktemp("stack")
            s = Stack(write_config(d, config_text), workdir=d, **kwargs)
            stacks.append(s)
            try:
                return s.start()
            except StackError as exc:
                text = str(exc).lower()
                if not ("already in use" in text or "cannot listen" in text) or attempt == 2:
                    raise

    yield make
    for s in stacks:
        s.close()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real ``redis-server`` on a free loopback port, stopped at module end."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


# Every request of the backend monitor (health checks, /metrics scrapes, model
# listings) carries this user agent; tests/unit/test_monitor_probes.py holds
# the monitor to it.
MONITOR_USER_AGENT = USER_AGENT


def is_monitor_probe(record: dict) -> bool:
    """Whether a demo engine's request record is one of the monitor's polls."""
    return record["headers"].get("user-agent", "").startswith(MONITOR_USER_AGENT)


def demo_requests(stack: Stack, backend: str) -> list[dict]:
    """The requests a demo engine saw, oldest first, without the monitor's polls.

    The monitor polls on its own clock, so how many of its requests a log
    holds depends on timing and machine load; every count of what an engine
    saw goes through here."""
    records = httpx.get(stack.demo_urls[backend] + "/_demo/requests").json()
    return [r for r in records if not is_monitor_probe(r)]


def clear_demo_requests(stack: Stack) -> None:
    for url in stack.demo_urls.values():
        httpx.delete(url + "/_demo/requests")


def routed_again(stack: Stack, timeout: float = 30.0) -> httpx.Response:
    """The first chat request answered 200 after a sidecar restart.

    Envoy's admin page (which ``Stack.start_sidecar`` reads) reports the
    sidecar healthy as soon as the main thread has the verdict; each worker
    thread takes it in a moment later, and a request landing on one that has
    not yet is refused with 503. Any other status fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": []})
        if r.status_code != 503:
            assert r.status_code == 200, (r.status_code, r.text)
            return r
        assert time.monotonic() < deadline, f"no request routed after the restart: {r.text}"
        time.sleep(0.05)


def envoy_stat(stack: Stack, name: str, exact: bool = False) -> int:
    """An Envoy counter; summed over every stat whose name ends with ``name``
    unless ``exact``."""
    text = httpx.get(f"http://{stack.envoy_admin}/stats", params={"filter": name}).text
    total = 0
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if (key == name if exact else key.endswith(name)) and value.strip().isdigit():
            total += int(value)
    return total


def sidecar_metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def metered(stack: Stack, timeout: float = 3.0) -> bool:
    """Wait until the sidecars have accounted every request Envoy had finished
    when this was called.

    Accounting travels in Envoy's access-log stream, flushed every
    ``metering.flush_interval_ms``; a request's metrics trail its response by
    up to that long. Entries a sidecar never received (it was down, or it
    restarted and its counters began again) are remembered as lost, so later
    calls wait only for what can still arrive. False when entries were missing
    at ``timeout``.
    """
    import time

    # The listener keeps its own copy of this counter: read the HCM's alone.
    done = envoy_stat(stack, "http.model_router.downstream_rq_completed", exact=True)
    lost = _LOST.get(id(stack), 0)
    deadline = time.monotonic() + timeout
    while True:
        seen = sum(sidecar_metric(t, "model_router_access_log_entries_total") for t in stack.metrics_text())
        if seen + lost >= done:
            return True
        if time.monotonic() > deadline:
            _LOST[id(stack)] = done - seen
            return False
        time.sleep(0.05)


_LOST: dict[int, float] = {}


def metric(stack: Stack, name: str, **labels) -> float:
    """A metric summed over every sidecar process, once the requests Envoy
    has finished are accounted."""
    metered(stack)
    return sum(sidecar_metric(text, name, **labels) for text in stack.metrics_text())


def wait_metric(stack: Stack, name: str, expected: float, timeout: float = 10.0, **labels) -> float:
    """A metric once it reaches ``expected`` (or its value at ``timeout``).

    Request accounting reaches the sidecar through Envoy's access-log stream,
    flushed every ``metering.flush_interval_ms``, so it trails the response.
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = metric(stack, name, **labels)
        if value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)

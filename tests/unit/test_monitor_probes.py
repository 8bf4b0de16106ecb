"""The backend monitor's polls are told apart from the requests an engine served.

A demo engine runs in this process (no child process); a monitor polls it
until it has checked health, scraped ``/metrics`` and listed the models. Every
request of the monitor carries the user agent ``tests/conftest.py``'s
``demo_requests`` leaves out, so no count of "requests an engine saw" depends
on how often the monitor polled.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from sidecar.backends.monitor import Monitor
from sidecar.config.schema import parse
from sidecar.devstack.demo.engine import build_app
from sidecar.routing.snapshot import build

from ..conftest import MONITOR_USER_AGENT, is_monitor_probe

CONFIG = """
monitor: {probe_interval_s: 0.1, scrape_interval_s: 0.1, models_interval_s: 0.1, timeout_s: 2}
backends:
  - {name: a, url: "demo://", type: vllm}
"""


def test_every_monitor_poll_is_a_probe_the_request_counts_leave_out():
    seen: list[tuple[str, str, str]] = []  # (method, path, user agent) of every request the engine saw

    @web.middleware
    async def witness(request: web.Request, handler):
        seen.append((request.method, request.path, request.headers.get("user-agent", "")))
        return await handler(request)

    async def main() -> tuple[list[tuple[str, str, str]], list[dict]]:
        app = build_app(name="a", models=["m"])
        app.middlewares.insert(0, witness)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        snap = build(parse(CONFIG, env={}).config, url_overrides={"a": url})
        mon = Monitor(lambda: snap)
        await mon.start()
        try:
            deadline = time.monotonic() + 20
            wanted = {"/health", "/metrics", "/v1/models"}
            while not wanted <= {path for _, path, _ in seen}:
                assert time.monotonic() < deadline, f"the monitor polled only {sorted({p for _, p, _ in seen})}"
                await asyncio.sleep(0.02)
        finally:
            await mon.stop()
        polled = list(seen)
        async with aiohttp.ClientSession() as client, client.get(url + "/_demo/requests") as r:
            records = await r.json()
        await runner.cleanup()
        return polled, records

    polled, records = asyncio.run(main())
    assert all(agent.startswith(MONITOR_USER_AGENT) for _, _, agent in polled), polled
    # The engine's own log holds the monitor's model listings; each reads as a probe.
    assert records and all(r["path"] == "/v1/models" and is_monitor_probe(r) for r in records), records
    # A request from anyone else is not one.
    assert not is_monitor_probe({"headers": {"user-agent": "OpenAI/Python 1.0"}})
    assert not is_monitor_probe({"headers": {}})

"""Slow uploads, through real Envoy: a client that trickles its bodies holds
connections, never the sidecar's decision streams, so other tenants keep
being served; Envoy bounds how long a request may take to arrive."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from ..conftest import envoy_stat, sidecar_metric
from .test_bad_input import check_error

SLOW_KEY = "sk-slow-uploader"
VICTIM_KEY = "sk-other-tenant"
MAX_IN_FLIGHT = 32
SLOW_UPLOADS = 300

CONFIG = f"""
server: {{max_in_flight: {MAX_IN_FLIGHT}}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
api_keys:
  - {{key: {SLOW_KEY}, id: slow}}
  - {{key: {VICTIM_KEY}, id: victim}}
"""


def _head(listen: str, length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"host: {listen}\r\n"
        f"authorization: Bearer {SLOW_KEY}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


async def _open_slow_uploads(listen: str, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """Connections that sent their headers and the first bytes of a 1000-byte body."""
    host, _, port = listen.rpartition(":")
    sockets = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(_head(listen, 1000) + b'{"model": ')
        await writer.drain()
        sockets.append((reader, writer))
    return sockets


async def _wait_for(predicate, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def _still_waiting(reader: asyncio.StreamReader) -> bool:
    """Envoy has neither answered nor closed this upload."""
    return not reader.at_eof() and not reader._buffer  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


@pytest.mark.integration
def test_slow_uploads_of_one_key_do_not_starve_another(stack):
    """Many more trickling uploads than the sidecar admits streams: another
    key's requests are answered while every one of them is still open, and
    the uploads hold no decision stream."""
    active = lambda: envoy_stat(stack, "http.model_router.downstream_rq_active", exact=True)  # noqa: E731
    in_flight = lambda: sum(  # noqa: E731
        sidecar_metric(t, "model_router_in_flight_streams") for t in stack.metrics_text()
    )

    async def run() -> tuple[list[int], float, list[bool]]:
        slow = await _open_slow_uploads(stack.listen, SLOW_UPLOADS)
        try:
            await _wait_for(lambda: active() >= SLOW_UPLOADS, "Envoy never saw every slow upload")
            held = in_flight()
            statuses = []
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                for i in range(20):
                    r = await client.post(
                        "/v1/chat/completions", headers={"authorization": f"Bearer {VICTIM_KEY}"},
                        json={"model": "model-a", "messages": [{"role": "user", "content": f"hi {i}"}]},
                    )
                    statuses.append(r.status_code)
            await asyncio.sleep(0)  # let any answer Envoy sent meanwhile reach the readers
            open_after = [_still_waiting(reader) for reader, _ in slow]
            return statuses, held, open_after
        finally:
            for _, writer in slow:
                writer.close()

    statuses, held, open_after = asyncio.run(run())
    assert statuses == [200] * 20, statuses
    # The uploads were all still waiting for their bodies when the last answer came.
    assert all(open_after), open_after.count(False)
    # And none of them held one of the sidecar's streams.
    assert held < MAX_IN_FLIGHT, held


@pytest.fixture(scope="module")
def strict(stack_factory):
    return stack_factory(CONFIG + "envoy: {request_timeout_s: 2}\n")


@pytest.mark.integration
def test_a_request_that_takes_too_long_to_arrive_gets_408(strict):
    """Past ``envoy.request_timeout_s`` Envoy answers a body still trickling in
    with a 408 in the ingress's error shape, and the sidecar never saw it."""

    async def run() -> bytes:
        reader, writer = (await _open_slow_uploads(strict.listen, 1))[0]
        try:
            return await asyncio.wait_for(reader.read(), timeout=60)
        finally:
            writer.close()

    raw = asyncio.run(run())
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert status == 408, raw[:300]
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    doc = check_error(status, headers, body, "openai")
    assert doc["error"]["code"] == "request_timeout", doc
    assert "upstream" not in json.dumps(doc), doc


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        data = rest[n + 2:]
    return out


def test_a_request_timeout_that_would_cut_the_online_loop_is_refused():
    """The request timeout covers the decision, and the :online loop answers
    within it."""
    from sidecar.config.schema import ConfigError, parse

    online = """
backends: [{name: a, url: "http://127.0.0.1:1", models: [m]}]
proxy: {variant_suffixes: {enabled: true}}
web_search: {enabled: true, url: "http://127.0.0.1:2/search", deadline_s: 60}
"""
    with pytest.raises(ConfigError, match=r"envoy\.request_timeout_s: 30 s would cut the ':online' loop short"):
        parse(online + "envoy: {request_timeout_s: 30}\n", env={})
    parse(online + "envoy: {request_timeout_s: 66}\n", env={})
    parse(online + "envoy: {request_timeout_s: 0}\n", env={})

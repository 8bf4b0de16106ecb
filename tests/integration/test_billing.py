"""Token budgets cannot be skipped: through real Envoy and demo engines, a
background Responses create and a stream the client cuts are charged (their
estimate, marked in the usage record; the create is settled to its usage by
its first retrieve that reports it, once), and two sidecars sharing a budget
in a real redis-server overshoot it under concurrent load by at most one
request's reservation."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import redis

from ..conftest import metered

pytestmark = pytest.mark.integration

CONFIG = """
metering: {flush_interval_ms: 100}
api_keys:
  - {id: team, key: sk-team}
backends:
  - {name: pool, url: "demo://", models: [m-up]}
model_experiments:
  - name: bill
    model: chat
    variants: [{id: only, model: m-up, weight: 1}]
limits:
  - {model: chat, key_id: team, tokens: 100000000, token_window: 1h}
"""
TEAM = {"authorization": "Bearer sk-team"}
HOUR = 3600


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def records(stack) -> dict[str, dict]:
    lines = stack.usage_records.read_text().splitlines()
    return {r["request_id"]: r for r in map(json.loads, lines)}


def tokens(record: dict) -> int:
    return (record["prompt_tokens"] or 0) + (record["completion_tokens"] or 0)


def probe(stack) -> tuple[int, str]:
    """The budget's remaining tokens as a request sees them, and its request id."""
    r = httpx.post(stack.url + "/v1/chat/completions", headers=TEAM, timeout=30,
                   json={"model": "chat", "max_tokens": 5, "messages": [{"role": "user", "content": "one two"}]})
    assert r.status_code == 200, r.text
    return int(r.headers["x-ratelimit-remaining-tokens"]), r.headers["x-request-id"]


def settled(stack, request_ids: list[str]) -> dict[str, dict]:
    """Wait until the requests' usage records are written: their entries
    reached the sidecar, which settled their reservations before writing them."""
    deadline = time.monotonic() + 10
    while not set(request_ids) <= (seen := records(stack)).keys():
        assert time.monotonic() < deadline, f"no usage record for {set(request_ids) - seen.keys()}"
        time.sleep(0.05)
    return seen


def charged_between(stack, run) -> tuple[int, dict[str, dict], list[str]]:
    """What ``run`` (returning the request ids it made) took from the budget,
    measured by two probes in one budget window.

    A finished request holds its reservation until its access-log entry
    arrives, so nothing may be left unsettled across a probe: every request
    before the first, and every request between the two, is settled first.
    """
    for _ in range(3):
        assert metered(stack)
        window = time.time() // HOUR
        before, first = probe(stack)
        ids = run()
        assert metered(stack)
        settled(stack, [first, *ids])
        after, last = probe(stack)
        seen = settled(stack, [last])
        if time.time() // HOUR == window:
            return before - after - tokens(seen[first]), seen, ids
    pytest.fail("three budget windows ended mid-run")


def test_a_background_create_is_charged_its_estimate_then_settled_by_its_retrieve(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-team", max_retries=0, timeout=60)
    made: dict[str, str] = {}

    def create() -> list[str]:
        raw = client.responses.with_raw_response.create(
            model="chat", input="word " * 150, background=True, max_output_tokens=200)
        made["id"] = raw.parse().id
        assert raw.parse().status in ("queued", "in_progress")
        return [raw.headers["x-request-id"]]

    taken, seen, (rid,) = charged_between(stack, create)
    record = seen[rid]
    assert record["estimated"] is True and record["status"] == 200
    assert record["completion_tokens"] == 200 and record["prompt_tokens"] >= 150 * 5 // 4
    assert taken == tokens(record)
    usage: dict[str, int] = {}

    def retrieve_twice() -> list[str]:
        first = client.responses.with_raw_response.retrieve(made["id"])
        done = first.parse()
        assert done.status == "completed" and done.usage is not None
        usage["total"] = done.usage.total_tokens
        again = client.responses.with_raw_response.retrieve(made["id"])
        assert again.parse().usage.total_tokens == usage["total"]
        return [first.headers["x-request-id"], again.headers["x-request-id"]]

    taken, _, _ = charged_between(stack, retrieve_twice)
    # The first retrieve that reports usage replaces the estimate with it; the second charges nothing.
    assert usage["total"] < tokens(record)
    assert taken == usage["total"] - tokens(record)


def test_a_stream_the_client_cuts_is_charged_its_estimate(stack):
    body = {"model": "chat", "stream": True, "max_tokens": 40, "messages": [{"role": "user", "content": "a b c"}]}
    paced = {**TEAM, "x-demo-interval-ms": "200", "x-demo-events": "40"}

    def run() -> list[str]:
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", stack.url + "/v1/chat/completions", json=body, headers=paced) as r:
                rid = r.headers["x-request-id"]
                for chunk in r.iter_raw():
                    if b'"content":"' in chunk and b'"content":""' not in chunk:
                        break  # the first word: leave before the usage event
        return [rid]

    taken, seen, (rid,) = charged_between(stack, run)
    record = seen[rid]
    assert record["estimated"] is True
    assert record["completion_tokens"] == 40
    assert taken == tokens(record) > 40


def test_a_stream_read_to_its_end_is_charged_its_usage_not_the_estimate(stack):
    body = {"model": "chat", "stream": True, "max_tokens": 40, "messages": [{"role": "user", "content": "a b c"}]}

    def run() -> list[str]:
        with httpx.Client(timeout=60) as http:
            r = http.post(stack.url + "/v1/chat/completions", json=body, headers={**TEAM, "x-demo-events": "7"})
        assert r.status_code == 200 and "[DONE]" in r.text
        return [r.headers["x-request-id"]]

    taken, seen, (rid,) = charged_between(stack, run)
    assert seen[rid]["estimated"] is False
    assert seen[rid]["prompt_tokens"] == 3 and seen[rid]["completion_tokens"] == 7
    assert taken == 10


SHARED = """
metering: {flush_interval_ms: 100}
redis: {url: "%(url)s", key_prefix: "billing-%(run)s:", timeout_ms: 1000}
backends:
  - {name: pool, url: "demo://", models: [base]}
  - {name: store, url: "demo://", models: [bg]}
limits:
  - {model: base, tokens: 1200, token_window: 1h}
  - {model: bg, tokens: 100000000, token_window: 1h}
"""
LIMIT = 1200
WORKERS = 12


@pytest.fixture(scope="module")
def shared(stack_factory, redis_server):
    run = time.time_ns()
    return stack_factory(SHARED % {"url": redis_server.url, "run": run}, sidecars=2), f"billing-{run}:"


def test_a_background_create_is_settled_once_by_a_retrieve_on_either_sidecar(shared, redis_server):
    s, prefix = shared
    db = redis.Redis.from_url(redis_server.url)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=60)
    window = time.time() // HOUR
    counter = f"{prefix}budget:*/bg:{int(window)}"
    created = client.responses.with_raw_response.create(model="bg", input="one two three", background=True,
                                                        max_output_tokens=500)
    assert metered(s)
    estimate = tokens(records(s)[created.headers["x-request-id"]])
    wait_counter(db, counter, estimate)
    total = client.responses.retrieve(created.parse().id).usage.total_tokens
    for _ in range(3):  # Envoy spreads these over both sidecars; only one claim finds the create
        client.responses.retrieve(created.parse().id)
    assert metered(s)
    if time.time() // HOUR != window:
        pytest.skip("the budget's window ended mid-run")
    wait_counter(db, counter, total)
    assert total < estimate


def wait_counter(db, key: str, expected: int) -> None:
    deadline = time.monotonic() + 10
    while int(db.get(key) or 0) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    assert int(db.get(key) or 0) == expected


def test_two_sidecars_under_concurrent_load_overshoot_by_at_most_one_reservation(shared, redis_server):
    s, prefix = shared
    body = {"model": "base", "max_tokens": 100, "messages": [{"role": "user", "content": "one two three"}]}
    reservation = -(-len(json.dumps(body, separators=(",", ":"))) // 4) + 100 + 8  # the body, a little slack for spacing
    served: list[str] = []
    refused = []
    window = time.time() // HOUR
    start = threading.Barrier(WORKERS)

    def worker() -> None:
        with httpx.Client(timeout=60) as http:
            start.wait()
            for _ in range(LIMIT // 100):  # enough to spend the budget alone: a budget that never refuses fails below
                r = http.post(s.url + "/v1/chat/completions", json=body, headers={"x-demo-events": "100"})
                if r.status_code != 200:
                    refused.append(r.status_code)
                    return
                served.append(r.headers["x-request-id"])

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if time.time() // HOUR != window:
        pytest.skip("the budget's window ended mid-run")
    assert set(refused) == {429} and len(refused) == WORKERS
    assert metered(s)
    seen = records(s)
    used = sum(tokens(seen[rid]) for rid in served)
    assert all(seen[rid]["estimated"] is False for rid in served)
    assert LIMIT - reservation * WORKERS < used <= LIMIT + reservation, (used, len(served))
    # Every reservation is settled to what was used: Redis holds exactly that.
    wait_counter(redis.Redis.from_url(redis_server.url), f"{prefix}budget:*/base:{int(window)}", used)

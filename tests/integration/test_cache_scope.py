"""A shared response cache cannot be planted, through real Envoy: one
caller's no-cache does not replace the entry everyone reads, and a request
whose headers or query could change the answer has its own entry."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.integration

CONFIG = """
api_keys:
  - {id: victim, key: sk-victim}
  - {id: planter, key: sk-planter}
backends:
  - {name: pool, url: "demo://", models: [model-a]}
cache: {scope: shared}
"""
VICTIM = {"authorization": "Bearer sk-victim"}
PLANTER = {"authorization": "Bearer sk-planter"}
BODY = {"model": "model-a", "messages": [{"role": "user", "content": "what is the answer"}]}
MARK = "héllo→✓"  # the demo engine ends its reply with this when asked with x-demo-split


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def ask(stack, headers: dict, query: str = "") -> httpx.Response:
    r = httpx.post(stack.url + "/v1/chat/completions" + query, json=BODY, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def until_hit(stack, headers: dict, query: str = "") -> httpx.Response:
    deadline = time.monotonic() + 15
    while True:
        r = ask(stack, headers, query)
        if r.headers.get("x-model-router-cache") == "hit":
            return r
        assert time.monotonic() < deadline, "the answer was never stored"
        time.sleep(0.05)


def test_one_caller_cannot_set_the_answer_others_get(stack):
    first = ask(stack, VICTIM)
    assert first.headers["x-model-router-cache"] == "miss"
    until_hit(stack, VICTIM)
    # The planter forces a fresh answer shaped by a header the engine reads...
    forced = ask(stack, PLANTER | {"cache-control": "no-cache", "x-demo-split": "1"})
    assert MARK in forced.json()["choices"][0]["message"]["content"]
    assert "x-model-router-cache" not in forced.headers  # neither read nor stored
    # ...and the same header without no-cache is another entry, stored under its own key.
    shaped = ask(stack, PLANTER | {"x-demo-split": "1"})
    assert shaped.headers["x-model-router-cache"] == "miss"
    assert MARK in until_hit(stack, PLANTER | {"x-demo-split": "1"}).json()["choices"][0]["message"]["content"]
    # Everyone else still gets the first answer.
    again = ask(stack, VICTIM)
    assert again.headers["x-model-router-cache"] == "hit"
    assert again.json()["choices"] == first.json()["choices"]


def test_the_query_string_has_its_own_entries(stack):
    until_hit(stack, VICTIM)
    assert ask(stack, PLANTER, "?api-version=2024-10-21").headers["x-model-router-cache"] == "miss"

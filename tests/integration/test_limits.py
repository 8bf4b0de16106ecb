"""Limits through real Envoy: request rates in Envoy's local rate-limit
filter on the descriptor the decision names, token budgets in the sidecar
from the access log, OpenAI's x-ratelimit-* headers on both."""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai
import pytest

from ..conftest import envoy_stat, metered, sidecar_metric, wait_metric

pytestmark = pytest.mark.integration

CONFIG = """
metering: {flush_interval_ms: 100}
proxy: {variant_suffixes: {enabled: true}}
api_keys:
  - {id: team-a, key: sk-a}
  - {id: team-b, key: sk-b}
backends:
  - {name: pool-a, url: "demo://", models: [base, lit, "lit:nitro", model-a, free]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_experiments:
  - name: split
    model: chat
    response_headers: true
    sticky_key: "header:x-caller"
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 1}
limits:
  - {model: base, requests_per_minute: 3}
  - {model: lit, requests_per_minute: 3}
  - {model: "lit:nitro", requests_per_minute: 5}
  - {model: chat, key_id: team-b, tokens: 5, token_window: 3s}
  - {model: free, key_id: team-a, requests_per_minute: 1000, tokens: 1000000}
"""

CHAT = "/v1/chat/completions"
A = {"authorization": "Bearer sk-a"}
B = {"authorization": "Bearer sk-b"}


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def ask(stack, model: str, headers=A, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "one two three"}], **extra}
    return httpx.post(stack.url + CHAT, json=body, headers=headers, timeout=30)


def remaining(r: httpx.Response) -> int:
    return int(r.headers["x-ratelimit-remaining-requests"])


def test_a_suffix_draws_from_its_base_models_limit(stack):
    """base and base:nitro share one bucket: each request takes one from it.
    (A bucket refill between the two shows as a count that went up, and a
    spent bucket as a 429; then the pair is tried again after the refill.)"""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        first = ask(stack, "base")
        second = ask(stack, "base:nitro")
        if first.status_code == 429 or second.status_code == 429 or remaining(second) >= remaining(first):
            time.sleep(1)
            continue
        assert first.headers["x-ratelimit-limit-requests"] == second.headers["x-ratelimit-limit-requests"] == "3"
        assert remaining(second) == remaining(first) - 1
        assert second.headers["x-continuum-model-variant"] == "nitro"
        return
    pytest.fail("base and base:nitro never showed one shared count")


def test_a_model_served_as_base_nitro_has_its_own_limit(stack):
    literal = ask(stack, "lit:nitro")
    assert literal.status_code == 200
    assert literal.headers["x-ratelimit-limit-requests"] == "5"
    assert "x-continuum-model-variant" not in literal.headers  # the exact name wins: no suffix read
    plain = ask(stack, "lit")
    assert plain.headers["x-ratelimit-limit-requests"] == "3"


def test_a_spent_request_rate_refuses_with_429_in_each_shape(stack):
    before = sidecar_metric_sum(stack, model="lit", key_id="team-a", kind="requests")
    refused = None
    for _ in range(10):
        r = ask(stack, "lit")
        if r.status_code == 429:
            refused = r
            break
        assert r.status_code == 200
    assert refused is not None, "3 requests a minute, yet 10 in a row were served"
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "'lit'" in err["message"]
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert re.fullmatch(r"[0-9]+s", refused.headers["x-ratelimit-reset-requests"])
    client = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="sk-a", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as exc:
        client.messages.create(model="lit", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"]["type"] == "rate_limit_error"
    assert "'lit'" in exc.value.body["error"]["message"]
    assert wait_metric(stack, "model_router_limit_refusals_total", before + 2, model="lit", key_id="team-a",
                       kind="requests") == before + 2


def sidecar_metric_sum(stack, **labels) -> float:
    metered(stack)
    return sum(sidecar_metric(t, "model_router_limit_refusals_total", **labels) for t in stack.metrics_text())


def test_a_request_under_no_limit_gets_no_ratelimit_headers(stack):
    r = ask(stack, "model-a", headers=B)
    assert r.status_code == 200
    assert not [h for h in r.headers if h.startswith("x-ratelimit")]


def test_served_responses_carry_request_and_token_headers(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-a", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="free", messages=[{"role": "user", "content": "x"}])
    h = raw.headers
    assert h["x-ratelimit-limit-requests"] == "1000"
    assert int(h["x-ratelimit-remaining-requests"]) < 1000
    assert h["x-ratelimit-limit-tokens"] == "1000000"
    assert int(h["x-ratelimit-remaining-tokens"]) <= 1000000
    assert re.fullmatch(r"([0-9]+h)?([0-9]+m)?[0-9]+s", h["x-ratelimit-reset-tokens"])
    assert "x-model-router-limit-model" not in str(raw.parse())  # nothing internal leaks


def callers_by_arm(stack) -> dict[str, str]:
    """One sticky caller per arm (team-a has no budget on chat)."""
    arms: dict[str, str] = {}
    for i in range(40):
        r = ask(stack, "chat", headers={**A, "x-caller": f"c{i}"})
        arms.setdefault(r.headers["x-continuum-experiment-variant"], f"c{i}")
        if len(arms) == 2:
            return arms
    pytest.fail("40 callers all drew one arm")


def test_a_spent_token_budget_covers_both_arms_refuses_and_resets(stack):
    arms = callers_by_arm(stack)
    control, candidate = arms["control"], arms["candidate"]
    deadline = time.monotonic() + 30
    refused = None
    while refused is None and time.monotonic() < deadline:
        # Spend on the control arm, then ask on the candidate arm.
        ask(stack, "chat", headers={**B, "x-caller": control})
        metered(stack)
        r = ask(stack, "chat", headers={**B, "x-caller": candidate})
        if r.status_code == 429:
            refused = r
    assert refused is not None, "the 5-token budget on chat never refused team-b"
    err = refused.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
    assert "'chat'" in err["message"] and "resets at" in err["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refused.headers["x-ratelimit-limit-tokens"] == "5"
    assert int(refused.headers["retry-after"]) <= 3
    # team-a has no budget on chat: still served.
    assert ask(stack, "chat", headers={**A, "x-caller": candidate}).status_code == 200
    # The 3-second window ends: served again.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if ask(stack, "chat", headers={**B, "x-caller": candidate}).status_code == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the token budget never reset")
    assert sidecar_metric_sum(stack, model="chat", key_id="team-b", kind="tokens") >= 1


def test_limited_requests_still_cost_two_ext_proc_messages(stack):
    before = envoy_stat(stack, "ext_proc.stream_msgs_sent")
    for model in ("free", "lit:nitro", "free"):
        r = ask(stack, model)
        assert r.status_code in (200, 429)
    assert envoy_stat(stack, "ext_proc.stream_msgs_sent") - before == 6


SHARED = """
metering: {flush_interval_ms: 100}
redis: {url: "%(url)s", key_prefix: "limits-test-%(run)s:", timeout_ms: 1000}
backends:
  - {name: pool-a, url: "demo://", models: [base, rated]}
limits:
  - {model: base, tokens: 20, token_window: 1h}
  - {model: rated, requests_per_minute: 4, shared: true}
"""


@pytest.fixture(scope="module")
def shared_stack(stack_factory, redis_server):
    return stack_factory(SHARED % {"url": redis_server.url, "run": time.time_ns()}, sidecars=2)


def test_two_sidecars_sharing_redis_enforce_one_budget(shared_stack):
    s = shared_stack

    def refusals(i: int) -> float:
        return sidecar_metric(s.metrics_text()[i], "model_router_decisions_total", outcome="429")

    deadline = time.monotonic() + 60
    served = 0
    while time.monotonic() < deadline and not (refusals(0) and refusals(1)):
        if ask(s, "base", headers={}).status_code == 200:
            served += 1
        metered(s)
    assert refusals(0) and refusals(1), "both sidecars should refuse once the shared budget is spent"
    # Every served request but the last few admitted before the charges arrived stayed
    # within the budget: the demo engine answers 3 prompt tokens and a few completion.
    assert served < 20


def test_a_shared_rate_is_one_count_across_sidecars(shared_stack):
    """Envoy asks the sidecars' rate-limit service (round robin over both);
    they count in one Redis key per minute: 4 served, then 429. A minute
    boundary crossed mid-run starts a new count, so the run is tried again."""
    for _ in range(3):
        minute = int(time.time() // 60)
        before = envoy_stat(shared_stack, "ext_proc.stream_msgs_sent")
        refusals = sidecar_metric_sum(shared_stack, model="rated", kind="requests")
        answers = [ask(shared_stack, "rated", headers={}) for _ in range(6)]
        assert envoy_stat(shared_stack, "ext_proc.stream_msgs_sent") - before == 12  # the service is no ext_proc work
        if int(time.time() // 60) != minute:
            continue
        codes = [r.status_code for r in answers]
        assert codes == [200] * 4 + [429] * 2, codes
        assert [r.headers["x-ratelimit-remaining-requests"] for r in answers[:4]] == ["3", "2", "1", "0"]
        assert {r.headers["x-ratelimit-limit-requests"] for r in answers} == {"4"}
        assert all(re.fullmatch(r"[0-9]+s", r.headers["x-ratelimit-reset-requests"]) for r in answers)
        err = answers[-1].json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "'rated'" in err["message"]
        assert wait_metric(shared_stack, "model_router_limit_refusals_total", refusals + 2, model="rated",
                           key_id="", kind="requests") == refusals + 2
        return
    pytest.fail("three runs in a row crossed a minute boundary")

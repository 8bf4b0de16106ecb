"""The response cache through real Envoy: hits answered by the sidecar with
no upstream call, entries isolated per experiment arm and per key, shared
across sidecar processes through a real redis-server, and never a failure
when Redis goes away."""

from __future__ import annotations

import itertools

import anthropic
import httpx
import openai
import orjson
import pytest

from ..conftest import demo_requests, envoy_stat, metric, sidecar_metric, wait_metric

pytestmark = pytest.mark.integration

CONFIG = """
metering: {flush_interval_ms: 100}
proxy: {variant_suffixes: {enabled: true}}
web_search: {enabled: true, url: "http://127.0.0.1:9/search", timeout_s: 1, deadline_s: 10}
api_keys:
  - {id: team-a, key: sk-team-a}
  - {id: team-b, key: sk-team-b}
backends:
  - {name: pool, url: "demo://", models: [model-a, plain]}
model_experiments:
  - name: twin
    model: chat
    response_headers: true
    sticky_key: "header:x-caller"
    variants:
      - {id: left, model: model-a, weight: 1}
      - {id: right, model: model-a, weight: 1}
cache: {models: [chat, model-a]%(extra)s}
"""

KEY_A = {"authorization": "Bearer sk-team-a"}
KEY_B = {"authorization": "Bearer sk-team-b"}
_unique = itertools.count()


def prompt(tag: str) -> str:
    return f"{tag} {next(_unique)} three words"


def chat(stack, model: str, text: str, headers: dict, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **extra}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def served(stack, text: str) -> int:
    """Requests carrying ``text`` that reached the demo engine."""
    return sum(text in orjson.dumps(r).decode() for r in demo_requests(stack, "pool"))


def stores(stack) -> float:
    return metric(stack, "model_router_cache_stores_total")


def stored(stack, before: float) -> None:
    """Wait for the answer just sent to be kept (the store follows the response)."""
    assert wait_metric(stack, "model_router_cache_stores_total", before + 1) >= before + 1


def callers(stack) -> dict[str, str]:
    """One sticky caller per arm, found by asking (no-store: probes leave no entry)."""
    found: dict[str, str] = {}
    for i in range(64):
        caller = f"caller-{i}"
        r = chat(stack, "chat", prompt("probe"), {**KEY_A, "x-caller": caller, "cache-control": "no-store"})
        assert "x-model-router-cache" not in r.headers
        found.setdefault(r.headers["x-continuum-experiment-variant"], caller)
        if len(found) == 2:
            return found
    raise AssertionError("64 callers all landed on one arm")


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG % {"extra": ""})
    s.arms = callers(s)
    return s


def test_the_same_request_twice_is_served_once_by_the_upstream(stack):
    text = prompt("twice")
    who = {**KEY_A, "x-caller": stack.arms["left"]}
    before, hits = stores(stack), metric(stack, "model_router_cache_hits_total", experiment="twin", variant="left")
    arm_requests = metric(stack, "model_experiment_requests_total", experiment="twin", variant="left")
    first = chat(stack, "chat", text, who)
    assert first.headers["x-model-router-cache"] == "miss"
    stored(stack, before)
    second = chat(stack, "chat", text, who)
    assert second.headers["x-model-router-cache"] == "hit"
    assert served(stack, text) == 1
    assert second.json() == first.json()
    assert second.headers["content-type"].startswith("application/json")
    assert second.headers["x-continuum-experiment-variant"] == "left"
    assert "x-demo-engine" in first.headers and "x-demo-engine" not in second.headers
    # The hit counts on its arm (intent to treat), and apart as a hit.
    assert metric(stack, "model_router_cache_hits_total", experiment="twin", variant="left") == hits + 1
    assert wait_metric(stack, "model_experiment_requests_total", arm_requests + 2,
                       experiment="twin", variant="left") == arm_requests + 2
    assert metric(stack, "model_experiment_cache_hits_total", experiment="twin", variant="left") >= 1


def test_key_order_and_whitespace_do_not_change_the_key(stack):
    text = prompt("canonical")
    who = {**KEY_A, "x-caller": stack.arms["left"], "content-type": "application/json"}
    before = stores(stack)
    body = {"model": "chat", "messages": [{"role": "user", "content": text}], "temperature": 0}
    r = httpx.post(stack.url + "/v1/chat/completions", content=orjson.dumps(body), headers=who)
    assert r.headers["x-model-router-cache"] == "miss"
    stored(stack, before)
    respelled = b'{ "temperature" : 0,\n  "messages": [{"content": %s, "role": "user"}], "model": "chat", "stream": false }'
    r = httpx.post(stack.url + "/v1/chat/completions", content=respelled % orjson.dumps(text), headers=who)
    assert r.status_code == 200 and r.headers["x-model-router-cache"] == "hit"
    assert served(stack, text) == 1


def test_two_arms_on_the_same_model_and_backend_never_share(stack):
    text = prompt("arms")
    left = {**KEY_A, "x-caller": stack.arms["left"]}
    right = {**KEY_A, "x-caller": stack.arms["right"]}
    before = stores(stack)
    assert chat(stack, "chat", text, left).headers["x-model-router-cache"] == "miss"
    stored(stack, before)
    r = chat(stack, "chat", text, right)
    assert r.headers["x-continuum-experiment-variant"] == "right"
    assert r.headers["x-model-router-cache"] == "miss"
    assert served(stack, text) == 2
    stored(stack, before + 1)
    assert chat(stack, "chat", text, right).headers["x-model-router-cache"] == "hit"
    assert chat(stack, "chat", text, left).headers["x-model-router-cache"] == "hit"
    assert served(stack, text) == 2


def test_a_key_cannot_read_another_keys_entry(stack):
    text = prompt("tenant")
    caller = stack.arms["left"]
    before = stores(stack)
    assert chat(stack, "chat", text, {**KEY_A, "x-caller": caller}).headers["x-model-router-cache"] == "miss"
    stored(stack, before)
    assert chat(stack, "chat", text, {**KEY_B, "x-caller": caller}).headers["x-model-router-cache"] == "miss"
    assert served(stack, text) == 2


def test_a_suffix_shares_its_routes_entry_and_gets_its_own_model_name(stack):
    """model-a:nitro and model-a resolve to the same route: one upstream call,
    and each answer names the model as its own request would be answered."""
    text = prompt("suffix")
    before = stores(stack)
    plain = chat(stack, "model-a", text, KEY_A)
    assert plain.headers["x-model-router-cache"] == "miss"
    assert plain.json()["model"] == "model-a"
    stored(stack, before)
    nitro = chat(stack, "model-a:nitro", text, KEY_A)
    assert nitro.headers["x-model-router-cache"] == "hit"
    assert nitro.headers["x-continuum-model-variant"] == "nitro"
    assert nitro.json()["model"] == "model-a:nitro"
    assert nitro.json()["choices"] == plain.json()["choices"]
    assert served(stack, text) == 1


def test_online_is_never_cached(stack):
    text = prompt("online")
    before = stores(stack)
    for _ in range(2):
        r = chat(stack, "model-a:online", text, KEY_A)
        assert "x-model-router-cache" not in r.headers
        assert r.headers["x-continuum-model-variant"] == "online"
    assert served(stack, text) == 2
    assert stores(stack) == before


def test_cache_control_from_the_client(stack):
    text = prompt("directives")
    before = stores(stack)
    r = chat(stack, "model-a", text, {**KEY_A, "cache-control": "no-store"})
    assert "x-model-router-cache" not in r.headers
    r = chat(stack, "model-a", text, KEY_A)
    assert r.headers["x-model-router-cache"] == "miss"  # no-store left no entry
    stored(stack, before)
    r = chat(stack, "model-a", text, {**KEY_A, "cache-control": "no-cache"})
    assert r.headers["x-model-router-cache"] == "bypass"  # not read: upstream again, and stored afresh
    assert served(stack, text) == 3
    stored(stack, before + 1)
    assert chat(stack, "model-a", text, KEY_A).headers["x-model-router-cache"] == "hit"
    assert served(stack, text) == 3


def test_errors_streams_and_models_not_opted_in_are_not_cached(stack):
    text = prompt("errors")
    before = stores(stack)
    for _ in range(2):
        r = httpx.post(stack.url + "/v1/chat/completions", headers={**KEY_A, "x-demo-status": "500"},
                       json={"model": "model-a", "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 500
        assert r.headers["x-model-router-cache"] == "miss"
    for _ in range(2):
        assert "x-model-router-cache" not in chat(stack, "model-a", text, KEY_A, stream=True).headers
        assert "x-model-router-cache" not in chat(stack, "plain", text, KEY_A).headers
    assert served(stack, text) == 6
    assert stores(stack) == before


def test_official_clients_get_a_valid_cached_answer(stack):
    oa = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-team-a", max_retries=0, timeout=30)
    an = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="sk-team-a", max_retries=0, timeout=30)
    text = prompt("sdk")
    before = stores(stack)
    first = oa.embeddings.create(model="model-a", input=text)
    stored(stack, before)
    raw = oa.embeddings.with_raw_response.create(model="model-a", input=text)
    assert raw.headers["x-model-router-cache"] == "hit"
    assert raw.parse().data[0].embedding == first.data[0].embedding
    msgs = [{"role": "user", "content": text}]
    m1 = an.messages.create(model="model-a", max_tokens=16, messages=msgs)
    stored(stack, before + 1)
    raw = an.messages.with_raw_response.create(model="model-a", max_tokens=16, messages=msgs)
    assert raw.headers["x-model-router-cache"] == "hit"
    assert raw.parse().content == m1.content
    assert served(stack, text) == 2


def test_only_cacheable_requests_pay_for_the_response(stack):
    """A request the cache cannot serve stays at two ext_proc messages; a
    hit too. Only a cacheable miss opens the response stream (its own filter)."""

    def sent() -> tuple[int, int]:
        return (envoy_stat(stack, "http.model_router.ext_proc.stream_msgs_sent", exact=True),
                envoy_stat(stack, "ext_proc.response.stream_msgs_sent"))

    text = prompt("messages")
    before = sent()
    chat(stack, "plain", text, KEY_A)
    chat(stack, "model-a", text, KEY_A, stream=True)
    chat(stack, "model-a", text, {**KEY_A, "cache-control": "no-store"})
    assert sent() == (before[0] + 6, before[1])
    stores_before = stores(stack)
    chat(stack, "model-a", text, KEY_A)  # a miss: request headers, body; response headers, body
    stored(stack, stores_before)
    assert sent() == (before[0] + 8, before[1] + 2)
    assert chat(stack, "model-a", text, KEY_A).headers["x-model-router-cache"] == "hit"
    assert sent() == (before[0] + 10, before[1] + 2)


# ------------------------------------------------------------------ redis


@pytest.fixture(scope="module")
def shared(stack_factory, redis_server):
    extra = ", store: redis, scope: shared}\nredis: {url: \"%s\", timeout_ms: 100" % redis_server.url
    s = stack_factory(CONFIG % {"extra": extra}, sidecars=2)
    return s


def per_sidecar(stack, name: str, **labels) -> list[float]:
    metric(stack, name)  # wait for the access log
    return [sidecar_metric(t, name, **labels) for t in stack.metrics_text()]


def test_two_sidecars_share_entries_through_redis(shared, redis_server):
    """Envoy spreads streams over both sidecar processes: whichever stored
    the answer, both answer hits from Redis. Scope shared: another key hits too."""
    text = prompt("replicas")
    r = chat(shared, "model-a", text, KEY_A)
    assert r.headers["x-model-router-cache"] == "miss"
    stored(shared, 0)
    for _ in range(40):
        hit = chat(shared, "model-a", text, KEY_B)
        assert hit.headers["x-model-router-cache"] == "hit"
        assert hit.json() == r.json()
        if all(n > 0 for n in per_sidecar(shared, "model_router_cache_hits_total")):
            break
    else:
        raise AssertionError(f"hits per sidecar: {per_sidecar(shared, 'model_router_cache_hits_total')}")
    assert served(shared, text) == 1


def test_redis_killed_mid_run_serves_uncached(shared, redis_server):
    text = prompt("redis-down")
    errors = metric(shared, "model_router_cache_errors_total")
    redis_errors = metric(shared, "model_router_redis_errors_total", feature="cache")
    redis_server.kill()
    try:
        for _ in range(3):
            r = chat(shared, "model-a", text, KEY_A)
            assert r.headers["x-model-router-cache"] == "miss"
        assert served(shared, text) == 3
        # Three failed reads, and three failed writes after the answers.
        assert wait_metric(shared, "model_router_cache_errors_total", errors + 6) == errors + 6
        assert metric(shared, "model_router_cache_errors_total", op="get") >= 3
        assert metric(shared, "model_router_redis_errors_total", feature="cache") == redis_errors + 6
    finally:
        redis_server.start()
    before = stores(shared)
    chat(shared, "model-a", text, KEY_A)
    stored(shared, before)  # Redis is back: the next answer is kept again
    assert chat(shared, "model-a", text, KEY_A).headers["x-model-router-cache"] == "hit"

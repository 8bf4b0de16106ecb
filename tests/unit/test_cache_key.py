"""The response cache's pure parts: the key stage of the decision, the
in-memory store, and the config rules."""

from __future__ import annotations

import orjson
import pytest

from sidecar.config.schema import ConfigError, parse
from sidecar.routing import Caller, Request, decide, snapshot
from sidecar.routing.ingress import lookup
from sidecar.routing.route import CachePlan, Route
from sidecar.stores.cache import Entry, MemoryStore, storable

CONFIG = """
proxy: {variant_suffixes: {enabled: true}}
api_keys:
  - {id: a, key: k-a}
  - {id: b, key: k-b}
  - {id: pinned, key: k-pinned, allowed_backends: [one]}
backends:
  - {name: one, url: "http://127.0.0.1:1", models: [m, other]}
  - {name: two, url: "http://127.0.0.1:2", models: [m, other]}
model_experiments:
  - name: twin
    model: chat
    sticky_key: "header:x-caller"
    variants:
      - {id: left, model: m, weight: 1}
      - {id: right, model: m, weight: 1}
  - name: windowed
    model: chat-ttl
    sticky_key: "header:x-caller"
    sticky_ttl: 60
    variants:
      - {id: only, model: m, weight: 1}
cache: %s
"""


def snap_of(cache: str = "{}"):
    return snapshot.build(parse(CONFIG % cache, env={}).config)


@pytest.fixture(scope="module")
def snap():
    return snap_of()


def plan(snap, body: dict | bytes, key: str = "k-a", path: str = "/v1/chat/completions", headers=None,
         **kw) -> CachePlan | None:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    request = Request(ingress=lookup(path), path=path, headers=headers or {}, body=raw,
                      caller=Caller(key, snap.keys.get(key) if key else None), **kw)
    route = decide(snap, request)
    assert isinstance(route, Route), route
    assert route.plan is not None
    return route.plan.cache


def key(snap, body, **kw) -> str:
    p = plan(snap, body, **kw)
    assert p is not None
    return p.key


MSG = [{"role": "user", "content": "hello"}]


def test_key_ignores_order_whitespace_and_what_does_not_change_the_answer(snap):
    base = key(snap, {"model": "m", "messages": MSG, "temperature": 0})
    spelled = b'{"temperature":0 ,\n "messages":[{"content":"hello","role":"user"}], "model":"m", "stream": false, "user": "u1"}'
    assert key(snap, spelled) == base
    assert key(snap, {"model": "m", "messages": MSG, "temperature": 1}) != base
    assert key(snap, {"model": "m", "messages": MSG}, pick=1) == key(snap, {"model": "m", "messages": MSG}, pick=2)


def test_arms_keys_and_pins_each_get_their_own_entries(snap):
    body = {"model": "chat", "messages": MSG}
    by_arm: dict[str, str] = {}
    for i in range(40):
        request_key = key(snap, body, headers={"x-caller": f"c{i}"})
        r = decide(snap, Request(ingress=lookup("/v1/chat/completions"), path="/v1/chat/completions",
                                 headers={"x-caller": f"c{i}"}, body=orjson.dumps(body),
                                 caller=Caller("k-a", snap.keys["k-a"])))
        by_arm.setdefault(r.plan.variant, request_key)
        assert by_arm[r.plan.variant] == request_key  # one arm, one key, whoever the caller
    assert len(set(by_arm.values())) == 2
    plain = {"model": "m", "messages": MSG}
    assert key(snap, plain, key="k-a") != key(snap, plain, key="k-b")
    assert key(snap, plain, key="k-pinned") != key(snap, plain, key="k-a")  # the backend set differs
    assert key(snap, {"model": "m", "messages": MSG}) != key(snap, {"model": "other", "messages": MSG})


def test_the_sticky_window_is_not_part_of_the_key(snap):
    body = {"model": "chat-ttl", "messages": MSG}
    assert key(snap, body, headers={"x-caller": "c"}, now=0.0) == key(snap, body, headers={"x-caller": "c"}, now=1e6)


def test_suffixes_share_the_route_and_online_streams_and_directives_are_not_cached(snap):
    body = {"model": "m", "messages": MSG}
    assert key(snap, {**body, "model": "m:nitro"}) == key(snap, body) == key(snap, {**body, "model": "m:floor"})
    assert plan(snap, {**body, "stream": True}) is None
    assert plan(snap, body, headers={"cache-control": "no-store"}) is None
    no_cache = plan(snap, body, headers={"cache-control": "max-age=0, No-Cache"})
    assert no_cache is not None and not no_cache.read and no_cache.key == key(snap, body)


def test_shared_scope_and_opt_in_lists():
    shared = snap_of("{scope: shared}")
    body = {"model": "m", "messages": MSG}
    assert key(shared, body, key="k-a") == key(shared, body, key="k-b")
    only = snap_of("{experiments: [twin]}")
    assert plan(only, body) is None
    assert plan(only, {"model": "chat", "messages": MSG}) is not None
    assert plan(snap_of("{models: [m]}"), {"model": "chat", "messages": MSG}) is None
    assert plan(snap_of("{enabled: false}"), body) is None
    no_section = snapshot.build(parse(CONFIG.replace("cache: %s\n", ""), env={}).config)
    assert plan(no_section, body) is None


def test_only_the_model_endpoints_are_cached(snap):
    assert plan(snap, {"model": "m", "input": "x"}, path="/v1/embeddings") is not None
    assert plan(snap, {"model": "m", "messages": MSG, "max_tokens": 5}, path="/anthropic/v1/messages") is not None
    assert plan(snap, {"model": "m", "messages": MSG}, path="/anthropic/v1/messages/count_tokens") is None
    assert plan(snap, {"model": "m", "prompt": "x"}, path="/v1/images/generations") is None


def test_config_rules():
    with pytest.raises(ConfigError, match=r"cache\.store: 'redis' needs the top-level redis section"):
        snap_of("{store: redis}")
    with pytest.raises(ConfigError, match=r"cache\.experiments\[0\]: unknown experiment 'nope'"):
        snap_of("{experiments: [nope]}")
    with pytest.raises(ConfigError, match=r"cache\.ttl: unknown field"):
        snap_of("{ttl: 5}")
    ok = parse((CONFIG % "{store: redis}") + "redis: {url: 'redis://127.0.0.1:6379/0'}\n", env={})
    assert ok.config.cache.store == "redis"


def test_memory_store_is_an_lru_within_its_budget_and_ttl():
    store = MemoryStore(max_bytes=3 * (len("k0") + 100 + len("application/json") + 200))
    entry = Entry(200, "application/json", b"x" * 100)
    for i in range(3):
        store.put(f"k{i}", entry, ttl_s=10, now=0)
    assert store.get("k0", now=1) == entry  # k0 is now the most recent
    store.put("k3", entry, ttl_s=10, now=1)
    assert store.get("k1", now=1) is None and store.get("k0", now=1) == entry and len(store) == 3
    assert store.get("k3", now=11) is None  # expired
    store.put("big", Entry(200, "application/json", b"y" * 10_000), ttl_s=10, now=1)
    assert store.get("big", now=1) is None
    store.resize(0)
    assert len(store) == 0 and store.bytes == 0


def test_what_may_be_stored_and_how_it_travels():
    ok = {":status": "200", "content-type": "application/json"}
    assert storable(ok)
    assert not storable({**ok, ":status": "500"})
    assert not storable({**ok, "content-type": "text/event-stream"})
    assert not storable({**ok, "set-cookie": "s=1"})
    assert not storable({**ok, "cache-control": "private"})
    assert not storable({**ok, "content-encoding": "gzip"})
    e = Entry(201, "application/json; charset=utf-8", b'{"a":\n1}')
    assert Entry.decode(e.encode()) == e
    assert Entry.decode(b"garbage") is None


def test_the_trace_says_what_the_cache_stage_decided(snap):
    from sidecar.routing.trace import Trace

    for headers, verdict in (({}, "lookup, then store a miss"), ({"cache-control": "no-store"}, "no-store")):
        trace = Trace()
        plan(snap, {"model": "m", "messages": MSG}, headers=headers, trace=trace)
        stage = next(s for s in trace.stages if s["stage"] == "cache")
        assert verdict in stage["verdict"]
        assert stage["cached"] is (not headers)


def test_a_request_that_may_move_to_another_hop_is_not_cached():
    """With fallback_attempts, a failed attempt moves to the chain's next model
    inside the same request: its answer could belong to another route."""
    chained = snapshot.build(parse((CONFIG % "{}") + "fallback_chains: {other: [m]}\n", env={}).config)
    assert plan(chained, {"model": "other", "messages": MSG}) is None
    assert plan(chained, {"model": "m", "messages": MSG}) is not None
    no_attempts = snapshot.build(parse((CONFIG % "{}") + "fallback_chains: {other: [m]}\nfallback_attempts: 0\n",
                                       env={}).config)
    assert plan(no_attempts, {"model": "other", "messages": MSG}) is not None


def test_the_key_covers_the_query_and_the_headers_an_engine_reads(snap):
    body = {"model": "m", "messages": MSG}
    base = key(snap, body)
    assert key(snap, body, path="/v1/chat/completions?api-version=2024-10-21") != base
    for name, value in (("anthropic-version", "2023-06-01"), ("anthropic-beta", "tools-2024"),
                        ("openai-beta", "assistants=v2"), ("x-engine-knob", "1")):
        assert key(snap, body, headers={name: value}) != base, name
    # Transport, tracing and SDK telemetry change no answer: clients differing in them share entries.
    neutral = {"user-agent": "OpenAI/Python 1.99", "x-stainless-retry-count": "1", "traceparent": "00-ab-cd-01",
               "x-request-id": "r1", "accept-encoding": "gzip", "x-forwarded-for": "203.0.113.7",
               "content-type": "application/json"}
    assert key(snap, body, headers=neutral) == base


def test_a_shared_entry_is_never_replaced_by_one_callers_no_cache():
    """With scope shared, no-cache reads through and stores nothing: one
    tenant cannot set the answer the others get."""
    shared = snap_of("{scope: shared}")
    body = {"model": "m", "messages": MSG}
    assert plan(shared, body, headers={"cache-control": "no-cache"}) is None
    assert plan(shared, body) is not None
    keyed = plan(snap_of(), body, headers={"cache-control": "no-cache"})  # scope key: the caller's own entry
    assert keyed is not None and not keyed.read

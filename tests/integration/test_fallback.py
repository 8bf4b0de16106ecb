"""Fallback chains: the pure decision (hops, pins, reservation, suffixes), the
config rules, and a dead arm through real Envoy."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from sidecar.backends.state import BackendState
from sidecar.config.schema import ConfigError, parse
from sidecar.errors import Reply
from sidecar.routing import Caller, Request, decide, snapshot
from sidecar.routing.ingress import lookup

from ..conftest import metric, wait_metric

CONFIG = """
proxy: {variant_suffixes: {enabled: true}}
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a]}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b]}
  - {name: c, url: "http://127.0.0.1:3", models: [m-c, m-b]}
  - {name: x, url: "http://127.0.0.1:4", models: [m-x]}
  - {name: h, url: "http://127.0.0.1:5", models: [hidden-m]}
  - {name: h2, url: "http://127.0.0.1:6", models: [hidden-2]}
model_metadata:
  - {id: m-a, reasoning_efforts: [low, high]}
fallback_chains:
  m-a: [m-b, m-c]
  m-x: [hidden-m, m-c]
  hidden-m: [hidden-2, m-c]
model_experiments:
  - name: within
    model: chat-w
    variants: [{id: only, model: m-a, weight: 1}]
  - name: cross
    model: chat-x
    fallback: cross_variant
    variants: [{id: only, model: m-a, weight: 1}]
  - name: pinned
    model: chat-p
    fallback: cross_variant
    variants: [{id: only, model: m-a, weight: 1, backends: [a, c]}]
  - name: hid
    model: chat-h
    fallback: cross_variant
    hide_variant_models: true
    variants: [{id: only, model: hidden-m, weight: 1}, {id: spare, model: hidden-2, weight: 0}]
"""


@pytest.fixture(scope="module")
def snap():
    return snapshot.build(parse(CONFIG, env={}).config)


def down(*names: str) -> dict[str, BackendState]:
    return {n: BackendState(n, healthy=False) for n in names}


def route(snap, model: str, states=None, headers=None, body=None):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **(body or {})}
    return decide(snap, Request(
        ingress=lookup("/v1/chat/completions"), path="/v1/chat/completions", headers=headers or {},
        body=orjson.dumps(body), caller=Caller(None, None), states=states or {},
    ))


def test_within_variant_answers_503_naming_the_client_model(snap):
    r = route(snap, "chat-w", down("a"))
    assert isinstance(r, Reply) and r.status == 503
    err = orjson.loads(r.body)["error"]
    assert err["code"] == "no_backend_available" and "'chat-w'" in err["message"]
    assert r.meta.variant == "only"  # still counted on the arm


def test_cross_variant_walks_the_chain_and_stays_on_the_arm(snap):
    r = route(snap, "chat-x", down("a"))
    assert (r.backend.name, r.upstream_model) == ("b", "m-b")
    assert orjson.loads(r.body)["model"] == "m-b"
    md = r.metadata()
    assert (md["experiment"], md["variant"]) == ("cross", "only")
    assert (md["fallback_from"], md["fallback_to"], md["x_fallback_model"]) == ("m-a", "m-b", "m-b")
    assert "fallback_to" not in route(snap, "chat-x").metadata()  # a healthy arm does not fall back


def test_the_chain_goes_on_while_hops_have_no_admissible_backend(snap):
    r = route(snap, "chat-x", down("a", "b", "c"))
    assert isinstance(r, Reply) and r.status == 503
    r = route(snap, "chat-x", down("a", "b"))
    assert (r.backend.name, r.upstream_model) == ("c", "m-b")  # m-b is also on c


def test_the_pin_bounds_every_hop(snap):
    r = route(snap, "chat-p", down("a"))
    assert (r.backend.name, r.upstream_model) == ("c", "m-b")  # b is outside the pin
    r = route(snap, "chat-p", down("a", "c"))
    assert isinstance(r, Reply) and r.status == 503


def test_a_model_outside_experiments_walks_its_chain(snap):
    r = route(snap, "m-a", down("a"))
    assert r.upstream_model == "m-b" and r.metadata()["fallback_from"] == "m-a"
    assert "experiment" not in r.metadata()


def test_an_ordinary_chain_skips_reserved_hops(snap):
    r = route(snap, "m-x", down("x"))
    assert r.upstream_model == "m-c"  # hidden-m is reserved by 'hid' and skipped


def test_a_reserved_origin_may_dispatch_reserved_hops_without_naming_them(snap):
    r = route(snap, "chat-h", down("h"))
    assert (r.backend.name, r.upstream_model) == ("h2", "hidden-2")
    md = r.metadata()
    assert md["fallback_to"] == "hidden-2" and "x_fallback_model" not in md  # the response never names it
    assert route(snap, "chat-h", down("h", "h2")).upstream_model == "m-c"


def test_a_hop_inherits_no_suffix(snap):
    r = route(snap, "m-a:thinking", down("a"))
    body = orjson.loads(r.body)
    assert body["model"] == "m-b" and "reasoning_effort" not in body
    md = r.metadata()
    assert md["suffix"] == "thinking" and md["x_model_variant_applied"] == "false"
    first = route(snap, "m-a:thinking")
    assert orjson.loads(first.body)["reasoning_effort"] == "high" and first.metadata()["suffix_applied"] is True


def test_x_backend_wins_the_first_attempt_only(snap):
    assert route(snap, "m-b", headers={"x-backend": "c"}).backend.name == "c"
    r = route(snap, "m-a", down("a"), headers={"x-backend": "c"})
    assert (r.backend.name, r.upstream_model) == ("b", "m-b")  # the hop is picked as any other request


@pytest.mark.parametrize("chains, needle", [
    ("{m-a: [m-a]}", "fallback_chains.m-a[0]: 'm-a' falls back to itself"),
    ("{m-a: [m-b], m-b: [m-c], m-c: [m-a]}", "fallback_chains: the chains form a cycle: m-a -> m-b -> m-c -> m-a"),
    ("{m-a: [nope]}", "fallback_chains.m-a[0]: unknown model 'nope'"),
    ("{m-a: [m-b, m-b]}", "fallback_chains.m-a[1]: 'm-b' is already in this chain"),
    ("{m-a: []}", "fallback_chains.m-a: a chain needs at least one fallback model"),
    ("{m-a: [chat]}", "fallback_chains.m-a[0]: 'chat' is an experiment's client model"),
    ("{chat: [m-b]}", "fallback_chains.chat: 'chat' is an experiment's client model"),
])
def test_bad_chains_are_rejected_with_their_path(chains, needle):
    text = f"""
backends: [{{name: a, url: "http://127.0.0.1:1", models: [m-a, m-b, m-c]}}]
model_experiments: [{{name: e, model: chat, variants: [{{id: v, model: m-a, weight: 1}}]}}]
fallback_chains: {chains}
"""
    with pytest.raises(ConfigError) as exc:
        parse(text, env={})
    assert any(e.startswith(needle) for e in exc.value.errors), exc.value.errors


def test_a_reserved_target_of_an_ordinary_chain_is_a_warning():
    loaded = parse(CONFIG, env={})
    assert any(w.startswith("fallback_chains.m-x[0]: 'hidden-m' is reserved by experiment 'hid'")
               for w in loaded.warnings), loaded.warnings
    assert not any(w.startswith("fallback_chains.hidden-m") for w in loaded.warnings)


# --------------------------------------------------------------------------- through Envoy

STACK = """
metering: {flush_interval_ms: 100}
monitor: {probe_interval_s: 0.2, timeout_s: 0.2}
backends:
  - {name: dead, url: "http://127.0.0.1:9", models: [model-dead], health_path: /health}  # nothing listens
  - {name: pool-b, url: "demo://", models: [model-b]}
fallback_chains:
  model-dead: [model-b]
model_experiments:
  - name: stay
    model: chat-stay
    response_headers: true
    variants: [{id: only, model: model-dead, weight: 1}]
  - name: move
    model: chat-move
    response_headers: true
    fallback: cross_variant
    variants: [{id: only, model: model-dead, weight: 1}]
"""


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(STACK)
    deadline = time.monotonic() + 10  # until the probe has seen the dead backend
    while time.monotonic() < deadline:

        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "chat-stay", "messages": []})
        if r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available":
            return s
        time.sleep(0.1)
    raise AssertionError("the monitor never marked the dead backend down")


@pytest.mark.integration
def test_a_dead_arm_under_within_variant_is_a_503(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-stay", "messages": []})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available"
    assert "'chat-stay'" in r.json()["error"]["message"]
    assert r.headers["x-continuum-experiment-variant"] == "only"
    assert "x-continuum-fallback-model" not in r.headers


@pytest.mark.integration
def test_a_dead_arm_under_cross_variant_is_served_by_the_hop_and_counted(stack):
    before = metric(stack, "model_router_fallbacks_total", experiment="move", variant="only",
                    from_model="model-dead", to_model="model-b")
    arm = metric(stack, "model_experiment_requests_total", experiment="move", variant="only", status="success")
    for _ in range(3):
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-move", "messages": []})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "model-b"
        assert r.headers["x-continuum-fallback-model"] == "model-b"
        assert r.headers["x-continuum-experiment-variant"] == "only"  # intent to treat: the arm it was assigned
    assert wait_metric(stack, "model_router_fallbacks_total", before + 3, experiment="move", variant="only",
                       from_model="model-dead", to_model="model-b") == before + 3
    assert metric(stack, "model_experiment_requests_total", experiment="move", variant="only",
                  status="success") == arm + 3

"""Fallback after a failed first attempt: the decision names the hops, Envoy's
composite cluster carries the request through them, each hop's filter has the
sidecar rewrite it. Pure checks first, then real Envoy with a stub that answers
500, a dead port and demo engines."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import orjson
import pytest

from sidecar.backends.state import BackendState
from sidecar.config.schema import parse
from sidecar.deploy import envoy as envoyconf
from sidecar.devstack.stack import envoy_binary, free_port
from sidecar.routing import Caller, Request, decide, snapshot
from sidecar.routing.ingress import lookup
from sidecar.routing.retarget import retarget

from ..conftest import demo_requests, envoy_stat, metric, wait_metric

PURE = """
proxy: {variant_suffixes: {enabled: true}}
backends:
  - {name: a, url: "http://127.0.0.1:1/base", models: [m-a], api_key: sk-a}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b]}
  - {name: c, url: "http://127.0.0.1:3", models: [m-c, m-b], api_key: sk-c}
  - {name: h, url: "http://127.0.0.1:5", models: [hidden-m]}
model_metadata:
  - {id: m-a, reasoning_efforts: [low, high]}
fallback_chains:
  m-a: [hidden-m, m-b, m-c]
model_experiments:
  - name: pinned
    model: chat-p
    fallback: cross_variant
    variants: [{id: only, model: m-a, weight: 1, backends: [a, c]}]
  - name: within
    model: chat-w
    variants: [{id: only, model: m-a, weight: 1}]
  - name: hid
    model: chat-h
    hide_variant_models: true
    variants: [{id: only, model: hidden-m, weight: 1}, {id: spare, model: m-c, weight: 0}]
"""


@pytest.fixture(scope="module")
def snap():
    return snapshot.build(parse(PURE, env={}).config)


def route(snap, model: str, states=None, headers=None, pick=0):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return decide(snap, Request(
        ingress=lookup("/v1/chat/completions"), path="/v1/chat/completions", headers=headers or {},
        body=orjson.dumps(body), caller=Caller(None, None), states=states or {}, pick=pick,
    ))


def test_the_decision_names_the_next_hop_and_skips_a_reserved_one(snap):
    r = route(snap, "m-a")
    assert r.backend.name == "a"
    assert [(h.upstream_model, h.backend) for h in r.hops] == [("m-b", "b")]  # hidden-m is reserved: skipped
    assert r.cluster == "fallback1~a~b"
    md = r.metadata()
    assert orjson.loads(md["retry"]) == {"hops": [["b", "m-b"]], "origin": "m-a", "path": "/v1/chat/completions",
                                         "drop_effort": False, "limits": [[""]]}
    assert md["auth_replaced"] is True


def test_the_pin_bounds_the_hop_and_x_backend_only_the_first_attempt(snap):
    for pick in range(4):
        assert [(h.upstream_model, h.backend) for h in route(snap, "chat-p", pick=pick).hops] == [("m-b", "c")]
    r = route(snap, "m-b", headers={"x-backend": "c"})
    assert r.backend.name == "c" and r.hops == ()  # m-b has no chain of its own
    assert route(snap, "chat-w").hops == ()  # within_variant never moves


def test_a_hop_without_an_admissible_backend_is_skipped(snap):
    r = route(snap, "m-a", {"b": BackendState("b", healthy=False)})
    assert [(h.upstream_model, h.backend) for h in r.hops] == [("m-b", "c")]
    r = route(snap, "m-a", {"b": BackendState("b", healthy=False), "c": BackendState("c", healthy=False)})
    assert r.hops == () and r.cluster == "a"


KEYED = """
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a]}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b]}
  - {name: c, url: "http://127.0.0.1:3", models: [m-c]}
fallback_chains:
  m-a: [m-b, m-c]
api_keys:
  - {key: k-all, id: all}
  - {key: k-narrow, id: narrow, allowed_models: [m-a, m-c]}
limits:
  - {model: m-c, key_id: narrow, tokens: 1000}
  - {model: m-a, tokens: 5000}
"""


def test_a_hop_outside_allowed_models_is_skipped_and_a_hop_is_charged_to_its_own_budget():
    snap = snapshot.build(parse(KEYED, env={}).config)
    body = orjson.dumps({"model": "m-a", "messages": []})

    def keyed(key: str):
        return decide(snap, Request(
            ingress=lookup("/v1/chat/completions"), path="/v1/chat/completions", headers={}, body=body,
            caller=Caller(key, snap.keys[key]), states={},
        ))

    assert [h.upstream_model for h in keyed("k-all").hops] == ["m-b"]
    r = keyed("k-narrow")  # may not use m-b: its hop is m-c, charged to m-c's budget for the key
    assert [(h.upstream_model, h.backend) for h in r.hops] == [("m-c", "c")]
    md = r.metadata()
    assert md["budgets"] == "*/m-a"  # the first attempt: the origin's budget
    hop = retarget(snap, md, 2, body)
    assert hop is not None
    (rule,) = snap.limits["m-c"]
    assert hop.meta["limit_model"] == "m-c" and hop.meta["budgets"] == rule.id
    assert retarget(snap, keyed("k-all").metadata(), 2, body).meta["budgets"] == ""  # m-b: no budget


def test_every_cluster_a_decision_names_is_in_the_bootstrap(snap):
    names = {c["name"] for c in envoyconf.bootstrap(snap.config)["static_resources"]["clusters"]}
    downs = [{}, {"a": BackendState("a", healthy=False)}, {"b": BackendState("b", healthy=False)}]
    for model in ("m-a", "chat-p", "chat-h", "m-b"):
        for states in downs:
            for pick in range(3):
                r = route(snap, model, states, pick=pick)
                assert r.cluster in names, r.cluster


def test_two_hops_are_two_retries_through_a_three_member_composite(tmp_path):
    snap = snapshot.build(parse("""
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m-a]}
  - {name: b, url: "http://127.0.0.1:2", models: [m-b]}
  - {name: c, url: "http://127.0.0.1:3", models: [m-c]}
fallback_chains: {m-a: [m-b, m-c]}
fallback_attempts: 2
""", env={}).config)
    r = route(snap, "m-a")
    assert [(h.upstream_model, h.backend) for h in r.hops] == [("m-b", "b"), ("m-c", "c")]
    boot = envoyconf.bootstrap(snap.config)
    composite = next(c for c in boot["static_resources"]["clusters"] if c["name"] == r.cluster)
    members = composite["cluster_type"]["typed_config"]["clusters"]
    assert [m["name"] for m in members] == ["attempt~a", "attempt~b", "attempt~c"]
    routes = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    retries = {r["name"]: r["route"].get("retry_policy", {}).get("num_retries") for r in routes}
    assert retries["default_fallback2"] == 2 and retries["default_fallback1"] == 1 and retries["default"] == 1
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(boot))
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_the_hop_gets_its_model_path_and_credentials_and_no_suffix_edit(snap):
    r = route(snap, "m-a:thinking")
    assert orjson.loads(r.body)["reasoning_effort"] == "high"
    decision = dict(r.metadata())
    assert retarget(snap, decision, 1, r.body) is None  # the first attempt is the decision's own
    out = retarget(snap, decision, 2, r.body)
    body = orjson.loads(out.body)
    assert body["model"] == "m-b" and "reasoning_effort" not in body
    assert out.path == "/v1/chat/completions"  # b's own base path, not a's /base
    assert ("authorization" in out.remove_headers) and not any(k == "authorization" for k, _ in out.set_headers)
    assert ("content-length", str(len(out.body))) in out.set_headers
    assert (out.meta["fallback_from"], out.meta["fallback_to"], out.meta["fallback_reason"]) == ("m-a", "m-b", "upstream_error")
    assert out.meta["x_fallback_model"] == "m-b" and out.meta["x_model_variant_applied"] == "false"
    retry = orjson.loads(decision["retry"])
    keyed = retarget(snap, decision | {"retry": orjson.dumps(retry | {"hops": [["c", "m-b"]]}).decode()}, 2, r.body)
    assert ("authorization", "Bearer sk-c") in keyed.set_headers
    assert retarget(snap, {}, 2, r.body) is None  # a decision that named no hops
    assert retarget(snap, decision, 3, r.body) is None  # past the last hop


def test_a_reserved_hop_is_never_named_in_the_response(snap):
    r = route(snap, "m-a")
    decision = dict(r.metadata())
    retry = orjson.loads(decision["retry"]) | {"hops": [["h", "hidden-m"]]}
    out = retarget(snap, decision | {"retry": orjson.dumps(retry).decode()}, 2, orjson.dumps({"model": "m-a"}))
    assert out.meta["fallback_to"] == "hidden-m" and out.meta["x_fallback_model"] == ""


# --------------------------------------------------------------------------- through Envoy


class _Broken(BaseHTTPRequestHandler):
    """Answers every request 500 (or the status in ``x-stub-status``, or
    closes the connection for ``reset``) and remembers each body."""

    seen: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).seen.append({"path": self.path, "body": json.loads(body or b"{}"),
                                "authorization": self.headers.get("authorization")})
        status = self.headers.get("x-stub-status", "500")
        if status == "reset":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        out = b'{"error": {"message": "broken", "type": "server_error"}}'
        self.send_response(int(status))
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def broken():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


STACK = """
metering: {{flush_interval_ms: 100}}
monitor: {{enabled: false}}
backends:
  - {{name: broken, url: "http://127.0.0.1:{broken}", models: [model-x], api_key: sk-broken}}
  - {{name: gone, url: "http://127.0.0.1:{gone}", models: [model-gone, model-y]}}
  - {{name: pool-b, url: "demo://", models: [model-b]}}
  - {{name: pool-c, url: "demo://", models: [model-b, model-ok]}}
fallback_chains:
  model-x: [model-b]
  model-gone: [model-b]
  model-ok: [model-b]
  model-y: [model-x, model-b]
fallback_attempts: 2
model_experiments:
  - name: move
    model: chat-move
    response_headers: true
    fallback: cross_variant
    variants: [{{id: only, model: model-x, weight: 1}}]
  - name: pinned
    model: chat-pinned
    response_headers: true
    fallback: cross_variant
    variants: [{{id: only, model: model-x, weight: 1, backends: [broken, pool-c]}}]
  - name: fine
    model: chat-fine
    fallback: cross_variant
    variants: [{{id: only, model: model-ok, weight: 1}}]
  - name: client-named
    model: chat-client
    response_model: client
    fallback: cross_variant
    variants: [{{id: only, model: model-x, weight: 1}}]
"""


@pytest.fixture(scope="module")
def stack(stack_factory, broken):
    return stack_factory(STACK.format(broken=broken.server_address[1], gone=free_port()))


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def fallbacks(stack, **labels) -> float:
    return metric(stack, "model_router_fallbacks_total", **labels)


@pytest.mark.integration
def test_a_500_moves_to_the_next_hop_within_the_same_request(stack, broken):
    labels = {"experiment": "move", "variant": "only", "from_model": "model-x", "to_model": "model-b",
              "reason": "upstream_error"}
    before, seen = fallbacks(stack, **labels), len(_Broken.seen)
    arm = metric(stack, "model_experiment_requests_total", experiment="move", variant="only", status="success")
    msgs = envoy_stat(stack, "stream_msgs_sent")
    raw = client(stack).chat.completions.with_raw_response.create(
        model="chat-move", messages=[{"role": "user", "content": "hi"}])
    assert raw.status_code == 200
    assert raw.parse().model == "model-b"
    assert raw.headers["x-continuum-fallback-model"] == "model-b"
    assert raw.headers["x-continuum-experiment-variant"] == "only"  # intent to treat
    assert [r["body"]["model"] for r in _Broken.seen[seen:]] == ["model-x"]  # one first attempt, then the hop
    assert _Broken.seen[-1]["authorization"] == "Bearer sk-broken"
    assert wait_metric(stack, "model_router_fallbacks_total", before + 1, **labels) == before + 1
    assert metric(stack, "model_experiment_requests_total", experiment="move", variant="only",
                  status="success") == arm + 1
    # Two messages for the decision, two for the hop's retarget (every ext_proc
    # filter's counter: the decision's, the response's, the composite's hop filter).
    assert envoy_stat(stack, "stream_msgs_sent") - msgs == 4


@pytest.mark.integration
def test_the_pin_bounds_the_hop_of_a_failed_attempt(stack):
    before = len(demo_requests(stack, "pool-b")), len(demo_requests(stack, "pool-c"))
    for _ in range(2):
        raw = client(stack).chat.completions.with_raw_response.create(
            model="chat-pinned", messages=[{"role": "user", "content": "hi"}])
        assert raw.status_code == 200 and raw.headers["x-continuum-fallback-model"] == "model-b"
    assert len(demo_requests(stack, "pool-b")) == before[0]  # outside the pin
    served = demo_requests(stack, "pool-c")[before[1]:]
    assert len(served) == 2 and all(r["json"]["model"] == "model-b" for r in served), served


@pytest.mark.integration
def test_a_connect_failure_falls_over(stack):
    before = fallbacks(stack, from_model="model-gone", to_model="model-b")
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "model-gone", "messages": []}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "model-b" and r.headers["x-continuum-fallback-model"] == "model-b"
    assert wait_metric(stack, "model_router_fallbacks_total", before + 1, from_model="model-gone",
                       to_model="model-b") == before + 1


@pytest.mark.integration
def test_a_request_that_does_not_fail_stays_at_two_messages(stack):
    msgs = envoy_stat(stack, "stream_msgs_sent")
    before = fallbacks(stack, experiment="fine")
    for _ in range(5):
        raw = client(stack).chat.completions.with_raw_response.create(
            model="chat-fine", messages=[{"role": "user", "content": "hi"}])
        assert raw.status_code == 200 and raw.parse().model == "model-ok"
        assert "x-continuum-fallback-model" not in raw.headers
    assert envoy_stat(stack, "stream_msgs_sent") - msgs == 10
    assert fallbacks(stack, experiment="fine") == before
    # The route was a fallback one: the decision named a hop for it.
    snap = snapshot.build(parse(stack.config_path.read_text(), env={}).config)
    assert [h.upstream_model for h in route(snap, "chat-fine").hops] == ["model-b"]


@pytest.mark.integration
def test_the_hop_answer_is_rewritten_like_any_other(stack):
    """The composite's filter chain keeps the response processor: the client
    name goes back into the hop's answer, streamed or not."""
    c = client(stack)
    raw = c.chat.completions.with_raw_response.create(model="chat-client", messages=[{"role": "user", "content": "hi"}])
    assert raw.status_code == 200 and raw.parse().model == "chat-client"
    chunks = list(c.chat.completions.create(model="chat-client", messages=[{"role": "user", "content": "hi"}],
                                            stream=True))
    assert chunks and all(ch.model == "chat-client" for ch in chunks)


@pytest.mark.integration
@pytest.mark.parametrize("status", ["429", "503", "reset"])
def test_a_429_a_503_and_a_reset_move_on_too(stack, status):
    seen = len(_Broken.seen)
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-move", "messages": []},
                   headers={"x-stub-status": status}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "model-b" and r.headers["x-continuum-fallback-model"] == "model-b"
    assert len(_Broken.seen) == seen + 1


@pytest.mark.integration
def test_two_failed_attempts_reach_the_second_hop(stack):
    """A connect failure, then the first hop's 500 (its body already names the
    hop's model), then the second hop serves."""
    seen = len(_Broken.seen)
    before = fallbacks(stack, from_model="model-y", to_model="model-b", reason="upstream_error")
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "model-y", "messages": []}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "model-b" and r.headers["x-continuum-fallback-model"] == "model-b"
    assert [x["body"]["model"] for x in _Broken.seen[seen:]] == ["model-x"]
    assert _Broken.seen[-1]["authorization"] == "Bearer sk-broken"  # the hop's own key
    assert wait_metric(stack, "model_router_fallbacks_total", before + 1, from_model="model-y", to_model="model-b",
                       reason="upstream_error") == before + 1

"""`envoy.routing: header_match`: the portable route form (one route per
backend matching the sidecar's routing header, as Gateway API HTTPRoute rules
express it), run through the real Envoy against demo engines."""

from __future__ import annotations

import subprocess
import time

import anthropic
import httpx
import openai
import pytest
import yaml

from sidecar.config import schema as config_mod
from sidecar.deploy import envoy as envoyconf
from sidecar.deploy import k8s
from sidecar.devstack.stack import Stack, envoy_binary, free_port

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, write_config

pytestmark = pytest.mark.integration

CONFIG = """
envoy: {routing: header_match}
backends:
  - {name: alpha, url: "demo://", models: [m-alpha]}
  - {name: beta, url: "demo://", models: [m-beta]}
  - {name: gamma, url: "demo://", type: anthropic, models: [m-gamma]}
model_experiments:
  - name: renamed
    model: chat
    response_model: client
    variants: [{id: only, model: m-beta, weight: 1}]
"""
MODELS = {"alpha": "m-alpha", "beta": "m-beta", "gamma": "m-gamma"}


def _served(stack, backend: str) -> list[dict]:
    """The client requests a demo engine saw (not the monitor's polls)."""
    return [r for r in demo_requests(stack, backend) if r["path"] in ("/v1/chat/completions", "/v1/messages")]


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def _routes(stack) -> list[dict]:
    boot = yaml.safe_load((stack.workdir / "envoy.yaml").read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def test_the_route_table_matches_the_header_per_backend(stack):
    routes = _routes(stack)
    assert not [r for r in routes if "cluster_header" in r.get("route", {})]
    chosen = {(h["string_match"]["exact"], r["route"]["cluster"]) for r in routes for h in r["match"].get("headers", [])
              if h["name"] == envoyconf.BACKEND_HEADER}
    assert chosen == {(b, b) for b in MODELS}
    assert routes[-1]["name"] == "unrouted" and "headers" not in routes[-1]["match"]


def test_every_backend_is_reached_through_its_route(stack):
    clear_demo_requests(stack)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="caller-1", max_retries=0)
    for backend, model in MODELS.items():
        if backend == "gamma":
            msg = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="caller-1", max_retries=0).messages.create(
                model=model, max_tokens=16, messages=[{"role": "user", "content": "hi"}])
            assert msg.model == model and msg.content[0].text.startswith(f"[{backend}]")
        else:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            assert r.model == model and r.choices[0].message.content.startswith(f"[{backend}] {model}")
    for backend in MODELS:
        seen = _served(stack, backend)
        assert len(seen) == 1, (backend, seen)
        assert envoyconf.BACKEND_HEADER not in seen[0]["headers"]  # the routing header stays at the proxy


def test_a_streamed_answer_and_a_rewritten_one_take_their_routes(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="caller-1", max_retries=0)
    chunks = list(client.chat.completions.create(model="m-alpha", messages=[{"role": "user", "content": "a b"}], stream=True))
    assert {c.model for c in chunks} == {"m-alpha"}
    before = envoy_stat(stack, "response.streams_started")
    r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    assert r.model == "chat" and r.choices[0].message.content.startswith("[beta] m-beta")  # beta/rewrite route
    assert envoy_stat(stack, "response.streams_started") == before + 1


def test_a_client_cannot_pick_the_backend(stack):
    clear_demo_requests(stack)
    resp = httpx.post(stack.url + "/v1/chat/completions", headers={envoyconf.BACKEND_HEADER: "gamma"},
                      json={"model": "m-alpha", "messages": []}, timeout=30)
    assert resp.status_code == 200 and resp.json()["model"] == "m-alpha"
    assert len(_served(stack, "alpha")) == 1 and _served(stack, "gamma") == []


def test_unknown_model_is_refused_by_the_sidecar(stack):
    resp = httpx.post(stack.url + "/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=30)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_the_httproute_rules_are_the_same_table(tmp_path):
    """The HTTPRoute the Kubernetes generator writes has, per backend, the
    header match the Envoy route above has, and a catch-all rule last."""
    path = write_config(tmp_path, CONFIG)
    cfg = config_mod.load(path).config
    # The route alone: response_model: client keeps `model-router k8s` from writing the whole set.
    route = k8s.httproute(cfg, k8s.Options(), k8s.backend_refs(cfg, {}))[0]
    table = {}
    for rule in route["spec"]["rules"]:
        for m in rule["matches"]:
            for h in m.get("headers", []):
                assert h["type"] == "Exact" and h["name"] == envoyconf.BACKEND_HEADER
                table[h["value"]] = rule["backendRefs"][0]["name"]
    refs = k8s.backend_refs(cfg, {})
    assert table == {value: refs[cluster].service for value, cluster in envoyconf.backend_routes(cfg)}
    assert set(table) == set(MODELS)
    assert "headers" not in route["spec"]["rules"][-1]["matches"][0]


def test_an_envoy_routing_by_the_httproute_reaches_every_backend(stack, tmp_path):
    """A second Envoy whose routes are the HTTPRoute's rules (as a gateway
    makes them), with a plain router as a gateway has, in front of the same
    sidecar and demo engines: each backend's requests reach that backend."""
    from .test_k8s import httproute_routes

    path = write_config(tmp_path, CONFIG)
    cfg = config_mod.load(path).config
    route = k8s.httproute(cfg, k8s.Options(), k8s.backend_refs(cfg, {}))[0]
    services = {r.service: name for name, r in k8s.backend_refs(cfg, {}).items()}
    boot = yaml.safe_load((stack.workdir / "envoy.yaml").read_text())
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    boot["admin"]["address"] = envoyconf._addr(admin)
    listener = boot["static_resources"]["listeners"][0]
    listener["address"] = envoyconf._addr(listen)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    router = hcm["http_filters"][-1]
    router["typed_config"] = {"@type": router["typed_config"]["@type"]}
    hcm["route_config"]["virtual_hosts"][0]["routes"] = httproute_routes(route, services)
    (tmp_path / "envoy.yaml").write_text(envoyconf.render(boot))
    log = (tmp_path / "envoy.log").open("w")
    proc = subprocess.Popen([envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--use-dynamic-base-id",
                             "--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://{admin}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "envoy.log").read_text()
            time.sleep(0.1)
        clear_demo_requests(stack)
        for backend, model in MODELS.items():
            for _ in range(30):  # until Envoy's health check has found the sidecar serving
                resp = httpx.post(f"http://{listen}/v1/chat/completions", headers={"authorization": "Bearer caller-1"},
                                  json={"model": model, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
                if resp.status_code != 503:
                    break
                time.sleep(0.2)
            assert resp.status_code == 200, (backend, resp.status_code, resp.text)
        for backend in MODELS:
            seen = _served(stack, backend)
            assert len(seen) == 1, (backend, seen)
            assert envoyconf.BACKEND_HEADER not in seen[0]["headers"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_a_plain_request_still_costs_two_ext_proc_messages(stack):
    before = envoy_stat(stack, "ext_proc.stream_msgs_sent")
    for _ in range(5):
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "m-alpha", "messages": []}, timeout=30)
        assert r.status_code == 200
    assert envoy_stat(stack, "ext_proc.stream_msgs_sent") - before == 10


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_with_the_sidecar_down_header_match_fails_closed_or_passes_untouched(tmp_path, mode):
    cfg = write_config(tmp_path, f"""
server: {{failure_mode: {mode}}}
envoy: {{routing: header_match}}
backends:
  - {{name: pool-a, url: "demo://", models: [model-a]}}
  - {{name: pool-b, url: "demo://", models: [model-b]}}
""")
    with Stack(cfg, workdir=tmp_path) as stack:
        stack.stop_sidecar()
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                       json={"model": "model-b", "messages": [{"role": "user", "content": "hi"}]})
        if mode == "open":  # untouched, to the first enabled backend (which does not serve model-b)
            assert r.status_code == 404 and "does not exist on demo engine pool-a" in r.text, r.text
            assert len(_served(stack, "pool-a")) == 1 and _served(stack, "pool-b") == []
        else:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "upstream_unavailable"


def test_header_match_with_fallback_attempts_is_a_valid_bootstrap(tmp_path):
    """Decisions that name a composite cluster (a fallback after a failed
    attempt) keep their routes, by the routing header, in header_match mode."""
    path = write_config(tmp_path, """
envoy: {routing: header_match}
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m]}
  - {name: b, url: "http://127.0.0.1:2", models: [n]}
fallback_chains: {m: [n]}
""")
    boot = envoyconf.bootstrap(config_mod.load(path).config)
    routes = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    fallback = [r for r in routes if "_fallback" in r["name"]]
    assert fallback and all(r["route"]["cluster_header"] == envoyconf.BACKEND_HEADER for r in fallback)
    assert {r["route"]["cluster"] for r in routes if "cluster" in r.get("route", {})} == {"a", "b"}
    out = tmp_path / "envoy.yaml"
    out.write_text(envoyconf.render(boot))
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr

"""Decision explain: POST /admin/explain, ``model-router explain`` and the
x-model-router-explain header, through real Envoy, the sidecar and demo engines."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.backends.state import BackendState
from sidecar.commands.main import main
from sidecar.config.schema import parse
from sidecar.deploy.envoy import _namespace_matchers
from sidecar.experiments.service import answer
from sidecar.routing import Caller, Request, authenticate, decide, snapshot
from sidecar.routing.explain import RequestSpec, SpecError, explain
from sidecar.routing.ingress import lookup
from sidecar.routing.snapshot import CLIENT_ROUTER_HEADERS, ROUTER_HEADER_PREFIXES
from sidecar.routing.trace import Trace

from ..conftest import clear_demo_requests, demo_requests
from .test_suffixes import Generator, admin_backends, wait_for

CONFIG = """
server: {admin_token: adm}
proxy: {variant_suffixes: {enabled: true}}
monitor: {probe_interval_s: 0.2, scrape_interval_s: 0.2, models_interval_s: 1, freshness_s: 1.5}
backends:
  - {name: e1, url: "demo://", type: vllm, models: [base]}
  - {name: e2, url: "demo://", type: vllm, models: [base]}
  - {name: e3, url: "demo://", type: vllm, models: [base]}
model_experiments:
  - name: split
    model: chat
    response_headers: true
    variants:
      - {id: control, model: base, weight: 70}
      - {id: candidate, model: base, weight: 30, backends: [e3]}
      - {id: paused, model: base, weight: 0}
  - name: weekly
    model: chat-weekly
    sticky_key: header:x-user
    sticky_ttl: 7d
    variants:
      - {id: a, model: base, weight: 1}
      - {id: b, model: base, weight: 1}
"""
ADMIN = {"authorization": "Bearer adm"}


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def admin_explain(stack, request: dict, headers=ADMIN) -> httpx.Response:
    return httpx.post(f"http://{stack.sidecar_admin[0]}/admin/explain", json=request, headers=headers)


def chat(model: str, key: str | None = None, **headers) -> dict:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return {"method": "POST", "path": "/v1/chat/completions", "headers": {**auth, **headers},
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}


def stage(doc: dict, name: str) -> dict:
    return next(s for s in doc["stages"] if s["stage"] == name)


def chat_requests(stack) -> int:
    return sum(r["path"] == "/v1/chat/completions" for b in ("e1", "e2", "e3") for r in demo_requests(stack, b))


# --------------------------------------------------------------------------- POST /admin/explain


@pytest.mark.integration
@pytest.mark.parametrize("key", ["user-7", "user-8", "user-1001"])
def test_explained_arm_and_scores_are_what_experiments_assign_says(stack, key, capsys):
    doc = admin_explain(stack, chat("chat", key)).json()
    exp = stage(doc, "experiment")
    assert main(["experiments", "assign", "--config", str(stack.config_path), "--experiment", "split",
                 "--key", key, "--json"]) == 0
    assigned = json.loads(capsys.readouterr().out)
    assert exp["experiment"] == "split" and exp["assignment"] == "sticky"
    assert exp["arm"] == assigned["variant_id"]
    assert [(s["variant_id"], s["weight"], s["u"], s["score"]) for s in exp["scores"]] == [
        (s["variant_id"], s["weight"], s["u"], s["score"]) for s in assigned["scores"]
    ]
    assert exp["sticky_value"] is None  # an API key is never echoed
    want = {"control": "e1 e2 e3", "candidate": "e3"}[exp["arm"]]
    assert doc["outcome"]["backend"] in want.split() and doc["dispatched"] is False


@pytest.mark.integration
def test_explained_ttl_arm_matches_assign_at_the_same_instant(stack):
    doc = admin_explain(stack, chat("chat-weekly", **{"x-user": "session-0"})).json()
    exp = stage(doc, "experiment")
    config = parse(stack.config_path.read_text(), env={}).config
    a = answer(config, "weekly", "session-0", exp["unix_time"])
    assert (exp["arm"], exp["window"], exp["sticky_value"]) == (a.variant_id, a.window, "session-0")
    assert [(s["u"], s["score"]) for s in exp["scores"]] == [(s.u, s.score) for s in a.scores]


@pytest.mark.integration
def test_explain_never_dispatches(stack):
    clear_demo_requests(stack)
    before = chat_requests(stack)
    for request in (chat("chat", "user-7"), chat("base:nitro"), chat("base:floor"), chat("nope")):
        assert admin_explain(stack, request).status_code == 200
    assert chat_requests(stack) == before == 0
    # A real request is seen: the count could have moved.
    assert httpx.post(stack.url + "/v1/chat/completions", json=chat("base")["body"]).status_code == 200
    assert chat_requests(stack) == 1


@pytest.mark.integration
def test_explain_needs_the_admin_token_and_a_usable_request(stack):
    assert admin_explain(stack, chat("chat"), headers={}).status_code == 401
    assert admin_explain(stack, chat("chat"), headers={"authorization": "Bearer nope"}).status_code == 401
    url = f"http://{stack.sidecar_admin[0]}/admin/explain"
    r = httpx.post(url, content=b"{not json", headers=ADMIN)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    for bad, words in (([], "JSON object"), ({"body": {}}, "'path' is required"), ({"path": "/v1", "x": 1}, "unknown field 'x'"),
                       ({"path": "/v1", "headers": {"a": 1}}, "'headers'"), ({"path": "/v1", "method": 3}, "'method'")):
        r = admin_explain(stack, bad)
        assert r.status_code == 400 and words in r.json()["error"], (bad, r.text)


@pytest.mark.integration
def test_explained_refusals_name_the_stage(stack):
    doc = admin_explain(stack, chat("nope")).json()
    assert doc["outcome"] == {"verdict": "refused: 404 model_not_found", "status": 404, "code": "model_not_found"}
    doc = admin_explain(stack, {"path": "/v1/chat/completions", "body": "{"}).json()
    assert stage(doc, "parse")["verdict"].startswith("refused") and doc["outcome"]["code"] == "invalid_json"
    doc = admin_explain(stack, {"method": "GET", "path": "/v1/models"}).json()
    assert doc["outcome"]["status"] == 200 and stage(doc, "listing")
    # A path an engine would decode again is refused before any stage, as the data plane refuses it.
    doc = admin_explain(stack, {**chat("chat"), "path": "/v1/chat/%2563ompletions"}).json()
    assert doc["outcome"]["code"] == "invalid_request" and stage(doc, "ingress")["verdict"].startswith("refused")
    # Router headers a client sends never reach the decision, as Envoy drops them.
    doc = admin_explain(stack, chat("base", **{"x-model-router-backend": "e3"})).json()
    assert doc["dropped_headers"] == ["x-model-router-backend"]


# --------------------------------------------------------------------------- x-model-router-explain


def summary_of(r: httpx.Response) -> dict[str, str]:
    return dict(part.split("=", 1) for part in r.headers["x-model-router-explain"].split("; "))


@pytest.mark.integration
def test_explain_header_with_the_admin_token_returns_the_summary(stack):
    clear_demo_requests(stack)
    body = chat("chat")["body"]
    asked = {"authorization": "Bearer user-7", "x-model-router-explain": "1", "x-model-router-admin-token": "adm"}
    r = httpx.post(stack.url + "/v1/chat/completions", json=body, headers=asked)
    assert r.status_code == 200
    doc = admin_explain(stack, chat("chat", "user-7")).json()
    s = summary_of(r)
    assert s["experiment"] == "split" and s["arm"] == f"{stage(doc, 'experiment')['arm']} (sticky)"
    assert s["backend"] == r.json()["choices"][0]["message"]["content"].split("]")[0].lstrip("[")
    assert s["scores"] == doc["summary"].split("scores=")[1].split(";")[0]
    # Neither the ask nor the token travels upstream.
    (seen,) = [x for b in ("e1", "e2", "e3") for x in demo_requests(stack, b) if x["path"] == "/v1/chat/completions"]
    assert not {"x-model-router-explain", "x-model-router-admin-token"} & set(seen["headers"])
    # A refusal carries it too.
    r = httpx.post(stack.url + "/v1/chat/completions", json=chat("nope")["body"], headers=asked)
    assert r.status_code == 404 and summary_of(r)["refused"] == "404 model_not_found"


@pytest.mark.integration
@pytest.mark.parametrize("headers", [
    {"x-model-router-explain": "1"},
    {"x-model-router-explain": "1", "x-model-router-admin-token": "wrong"},
    {"x-model-router-explain": "1", "authorization": "Bearer adm"},
    {"x-model-router-admin-token": "adm"},
])
def test_explain_header_without_the_admin_token_is_ignored(stack, headers):
    clear_demo_requests(stack)
    for model in ("chat", "nope"):
        r = httpx.post(stack.url + "/v1/chat/completions", json=chat(model)["body"], headers=headers)
        assert r.status_code in (200, 404) and "x-model-router-explain" not in r.headers
    (seen,) = [x for b in ("e1", "e2", "e3") for x in demo_requests(stack, b) if x["path"] == "/v1/chat/completions"]
    assert not {"x-model-router-explain", "x-model-router-admin-token"} & set(seen["headers"])


# --------------------------------------------------------------------------- :nitro with a stale engine


@pytest.mark.integration
def test_nitro_explain_names_the_fastest_fresh_engine_and_excludes_the_stale_one(stack):
    """Last: stops e3's metrics for the rest of the module."""
    with Generator(stack, {"e1": 50, "e2": 500, "e3": 5000}):
        wait_for(lambda: all((b := admin_backends(stack))[n]["throughput_tps"] for n in ("e1", "e2", "e3"))
                 and b["e3"]["throughput_tps"] > b["e2"]["throughput_tps"] > 3 * b["e1"]["throughput_tps"],
                 "e3 fastest, then e2, then e1")
        # e3's metrics stop answering: its last, highest, figure goes stale.
        stack.config_path.write_text(CONFIG.replace(
            '{name: e3, url: "demo://", type: vllm, models: [base]}',
            '{name: e3, url: "demo://", type: vllm, models: [base], metrics_path: /gone}'))
        wait_for(lambda: (b := admin_backends(stack))["e3"]["scrape_age_s"] > 3
                 and b["e2"]["throughput_tps"] and b["e2"]["throughput_tps"] > 3 * (b["e1"]["throughput_tps"] or 0),
                 "e3 stale, e2 fastest of the fresh", timeout=20)
        doc = admin_explain(stack, chat("base:nitro")).json()
        r = httpx.post(stack.url + "/v1/chat/completions", json=chat("base:nitro")["body"],
                       headers={"x-model-router-explain": "1", "x-model-router-admin-token": "adm"})
    served, summary = r.json(), summary_of(r)
    (attempt,) = doc["selection"]
    by = {c["backend"]: c for c in attempt["candidates"]}
    assert attempt["chosen"] == "e2" and attempt["ranker"] == {"name": "throughput", "applied": True}
    assert by["e2"]["verdict"] == "chosen"
    assert by["e3"]["verdict"] == "excluded by the throughput ranker: stale"
    assert by["e3"]["filters"] == {"health": "pass", "holdout": "pass", "saturation": "pass"}
    assert by["e3"]["ranker"]["throughput_tps"] is None and by["e3"]["ranker"]["scrape_age_s"] > 1.5
    assert by["e1"]["verdict"] == "excluded by the throughput ranker: lower throughput"
    assert by["e2"]["ranker"]["throughput_tps"] > by["e1"]["ranker"]["throughput_tps"]
    assert "excluded=e1:lower throughput,e3:stale" in doc["summary"]
    # The request itself went where explain said, and its own trace says why.
    assert served["choices"][0]["message"]["content"].startswith("[e2]")
    assert (summary["backend"], summary["ranker"], summary["excluded"]) == (
        "e2", "throughput applied", "e1:lower throughput,e3:stale")


# --------------------------------------------------------------------------- offline, and the pure parts


def test_offline_explain_says_no_monitor_data_was_used(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    request = tmp_path / "r.json"
    request.write_text(json.dumps(chat("chat", "user-7")), encoding="utf-8")
    assert main(["explain", "--config", str(config), "--request", str(request)]) == 0
    out = capsys.readouterr().out
    assert "without live monitor data" in out and "nothing was dispatched" in out
    arm = answer(parse(CONFIG, env={}).config, "split", "user-7").variant_id
    assert f"experiment    split: arm {arm} (sticky)" in out
    assert main(["explain", "--config", str(config), "--request", str(request), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["monitor"].startswith("none: explained offline") and stage(doc, "experiment")["arm"] == arm
    request.write_text("[1]", encoding="utf-8")
    assert main(["explain", "--config", str(config), "--request", str(request)]) == 2
    assert "JSON object" in capsys.readouterr().err


DECIDE = """
proxy: {variant_suffixes: {enabled: true}, selection: random}
monitor: {max_waiting: 3, freshness_s: 5}
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m, m-b]}
  - {name: b, url: "http://127.0.0.1:2", models: [m, m-b]}
  - {name: c, url: "http://127.0.0.1:3", models: [m]}
api_keys:
  - {key: sk-secret-1, id: kid, allowed_backends: [a, b]}
fallback_chains: {m: [m-b]}
model_metadata:
  - {id: m, pricing: {input: 1, output: 2}, backend_pricing: {b: {input: 1, output: 1}}}
model_experiments:
  - name: e
    model: chat
    fallback: cross_variant
    variants: [{id: x, model: m, weight: 3}, {id: y, model: m-b, weight: 1}]
"""
STATES = {
    "a": BackendState("a", throughput_tps=10.0, waiting=1, scraped_at=99.0),
    "b": BackendState("b", throughput_tps=20.0, waiting=9, scraped_at=99.0),
    "c": BackendState("c", healthy=False),
}


@pytest.mark.parametrize("model", ["chat", "m", "m:nitro", "m:floor", "m-b", "nope", "chat:nitro"])
@pytest.mark.parametrize("key", ["sk-secret-1", "bad", None])
def test_a_trace_never_changes_the_decision(model, key):
    snap = snapshot.build(parse(DECIDE, env={}).config)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    results = []
    for trace in (None, Trace()):
        caller = authenticate(snap, headers, "openai", trace)
        if not isinstance(caller, Caller):
            results.append(caller)
            continue
        req = Request(ingress=lookup("/v1/chat/completions"), path="/v1/chat/completions", headers=headers,
                      body=json.dumps({"model": model, "user": "u"}).encode(), caller=caller, now=5.0, pick=3,
                      rand=0.4, random_bytes=lambda n: b"\x42" * n, states=STATES, mono=100.0, trace=trace)
        results.append(decide(snap, req))
    assert results[0] == results[1]


def test_trace_of_filters_and_fallback():
    snap = snapshot.build(parse(DECIDE, env={}).config)
    states = {**STATES, "a": BackendState("a", healthy=False)}
    doc = explain(snap, RequestSpec.from_json({"path": "/v1/chat/completions", "headers": {"x-api-key": "sk-secret-1"},
                                               "body": {"model": "m"}}), states, 5.0, 100.0, live=True)
    first, hop = doc["selection"]
    by = {c["backend"]: c for c in first["candidates"]}
    assert by["a"]["filters"]["health"] == "fail" and by["a"]["verdict"] == "excluded by the health filter"
    assert by["b"]["filters"]["saturation"] == "fail" and by["b"]["monitor"]["waiting"] == 9
    assert by["c"]["verdict"] == "not a candidate: outside the allowed backends"
    assert first["chosen"] is None and hop["role"] == "fallback hop 1" and hop["model"] == "m-b"
    assert stage(doc, "authenticate")["verdict"] == "admitted as key id kid"
    assert doc["outcome"]["verdict"].startswith("refused: 503")
    assert stage(doc, "fallback")["verdict"] == "every hop failed"
    assert "sk-secret" not in json.dumps(doc)


def test_spec_rejects_what_it_cannot_send():
    with pytest.raises(SpecError, match="Unicode"):
        RequestSpec.from_json({"path": "/v1", "body": "\ud800"})
    assert RequestSpec.from_json({"path": "/v1", "body": {"a": 1}}).body == b'{"a":1}'
    assert RequestSpec.from_json({"path": "/v1", "headers": {"X-A": "b"}}).headers == {"x-a": "b"}


names = st.text(alphabet="abdeiklmnoprtux-", max_size=16)


@given(st.sampled_from(ROUTER_HEADER_PREFIXES + ("x-model-router-e", "x-model-router-a", "x-", "")), names)
def test_envoy_strips_every_router_header_but_the_operator_ones(prefix, rest):
    header = prefix + rest
    patterns = [m for p in ROUTER_HEADER_PREFIXES for m in _namespace_matchers(p)]
    stripped = any(re.fullmatch(m["safe_regex"]["regex"], header) if "safe_regex" in m
                   else header.startswith(m["prefix"]) for m in patterns)
    assert stripped == (header.startswith(ROUTER_HEADER_PREFIXES) and header not in CLIENT_ROUTER_HEADERS)


def test_envoy_strips_near_misses_of_the_operator_headers():
    patterns = _namespace_matchers("x-model-router-")
    for header in ("x-model-router-explai", "x-model-router-explainx", "x-model-router-admin-toke",
                   "x-model-router-admin-tokens", "x-model-router-", "x-model-router-backend"):
        assert any(re.fullmatch(m["safe_regex"]["regex"], header) for m in patterns), header
    for header in CLIENT_ROUTER_HEADERS:
        assert not any(re.fullmatch(m["safe_regex"]["regex"], header) for m in patterns), header


def test_summary_quotes_what_a_header_cannot_carry():
    t = Trace()
    t.stage("names", "x", base="modèle; a=b", suffix=None)
    assert t.summary() == "model=mod%C3%A8le%3B a=b"

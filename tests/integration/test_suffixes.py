"""Variant suffixes (:nitro, :floor, :thinking, :online) through real Envoy."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from ..conftest import metric

pytestmark = pytest.mark.integration

CONFIG = """
server: {admin_token: adm}
proxy: {variant_suffixes: {enabled: true}}
monitor: {probe_interval_s: 0.2, scrape_interval_s: 0.2, models_interval_s: 1, freshness_s: 1.5,
          passive_holdout_s: 30, max_waiting: 5}
backends:
  - {name: e1, url: "demo://", type: vllm, models: [base, think-model, "lit:nitro"]}
  - {name: e2, url: "demo://", type: vllm, models: [base, think-model]}
  - {name: e3, url: "demo://", type: vllm, models: [base]}
  - {name: blind, url: "demo://", type: vllm, metrics_path: "", models: [unrated]}
model_metadata:
  - id: base
    pricing: {input: 1.0, output: 2.0}
    backend_pricing:
      e2: {input: 1.0, output: 1.0}
      e3: {input: 2.0, output: 0.5}
  - id: think-model
    reasoning_efforts: [low, medium, high]
"""


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG)
    s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
    return s


def admin_backends(stack) -> dict:
    r = httpx.get(f"http://{stack.sidecar_admin[0]}/admin/backends", headers={"authorization": "Bearer adm"})
    return r.json()["backends"]


def wait_for(pred, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Generator:
    """Feeds generated tokens into demo engines so the monitor sees throughput."""

    def __init__(self, stack, rates: dict[str, int]):
        self.stack, self.rates, self.stop = stack, dict(rates), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        with httpx.Client() as c:
            while not self.stop.is_set():
                for name, tokens in self.rates.items():
                    c.post(self.stack.demo_urls[name] + "/_demo/state", json={"extra_generation_tokens": tokens})
                self.stop.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def served_by(resp) -> str:
    return resp.choices[0].message.content.split("]")[0].lstrip("[")


def set_state(stack, name, **state):
    httpx.post(stack.demo_urls[name] + "/_demo/state", json=state).raise_for_status()


def test_nitro_picks_the_fastest_fresh_engine_and_follows_changes(stack):
    with Generator(stack, {"e1": 50, "e2": 500, "e3": 5}) as gen:
        wait_for(lambda: (b := admin_backends(stack))["e2"]["throughput_tps"] and b["e1"]["throughput_tps"]
                 and b["e2"]["throughput_tps"] > 3 * b["e1"]["throughput_tps"], "e2 to be fastest")
        for _ in range(6):
            raw = stack.oa.chat.completions.with_raw_response.create(model="base:nitro", messages=[])
            assert served_by(raw.parse()) == "e2"
            assert raw.headers["x-continuum-model-variant"] == "nitro"
            assert "x-continuum-model-variant-applied" not in raw.headers
            assert raw.parse().model == "base:nitro"
        gen.rates.update(e1=5000)
        wait_for(lambda: (b := admin_backends(stack))["e1"]["throughput_tps"]
                 and b["e1"]["throughput_tps"] > 3 * b["e2"]["throughput_tps"], "e1 to be fastest")
        assert {served_by(stack.oa.chat.completions.create(model="base:nitro", messages=[])) for _ in range(4)} == {"e1"}


def test_saturated_or_unhealthy_engine_is_never_chosen(stack):
    with Generator(stack, {"e1": 5, "e2": 5000, "e3": 50}):
        wait_for(lambda: (b := admin_backends(stack))["e2"]["throughput_tps"] and b["e3"]["throughput_tps"]
                 and b["e2"]["throughput_tps"] > 3 * b["e3"]["throughput_tps"], "e2 to be fastest")
        set_state(stack, "e2", waiting=50)
        try:
            wait_for(lambda: not admin_backends(stack)["e2"]["admissible"], "e2 to be saturated")
            seen = {served_by(stack.oa.chat.completions.create(model="base:nitro", messages=[])) for _ in range(6)}
            assert "e2" not in seen
            seen = {served_by(stack.oa.chat.completions.create(model="base", messages=[])) for _ in range(9)}
            assert seen == {"e1", "e3"}
        finally:
            set_state(stack, "e2", waiting=0)
        set_state(stack, "e3", healthy=False)
        try:
            wait_for(lambda: not admin_backends(stack)["e3"]["healthy"], "e3 to be unhealthy")
            seen = {served_by(stack.oa.chat.completions.create(model="base", messages=[])) for _ in range(9)}
            assert "e3" not in seen
        finally:
            set_state(stack, "e3", healthy=True)
        wait_for(lambda: admin_backends(stack)["e3"]["admissible"], "e3 to recover")


def test_stale_or_missing_metrics_report_not_applied(stack):
    raw = stack.oa.chat.completions.with_raw_response.create(model="unrated:nitro", messages=[])
    assert raw.headers["x-continuum-model-variant-applied"] == "false"
    assert raw.parse().model == "unrated:nitro"
    # No generator running: every engine's rate is zero, not unknown, so the
    # ranking applies; with no price for 'unrated', :floor cannot apply.
    raw = stack.oa.chat.completions.with_raw_response.create(model="unrated:floor", messages=[])
    assert raw.headers["x-continuum-model-variant-applied"] == "false"


def test_floor_picks_the_cheapest_and_breaks_ties_by_output_price(stack):
    # 200 characters ~ 50 prompt tokens; with max_tokens 100: e1 = 50*1 + 100*2 = 250,
    # e2 = 50*1 + 100*1 = 150, e3 = 50*2 + 100*0.5 = 150: a tie that e3's lower output price wins.
    msgs = [{"role": "user", "content": "x" * 200}]
    for _ in range(4):
        r = stack.oa.chat.completions.with_raw_response.create(model="base:floor", messages=msgs, max_tokens=100)
        assert served_by(r.parse()) == "e3" and r.parse().model == "base:floor"
        assert "x-continuum-model-variant-applied" not in r.headers
    # A long prompt moves it: 4000 characters ~ 1000 tokens, max_tokens 10 -> e1 = 1020, e2 = 1010, e3 = 2005.
    r = stack.oa.chat.completions.create(model="base:floor", messages=[{"role": "user", "content": "y" * 4000}],
                                         max_tokens=10)
    assert served_by(r) == "e2"


def test_thinking_sets_effort_only_when_unset_and_refuses_without_support(stack):
    r = stack.oa.chat.completions.create(model="think-model:thinking", messages=[{"role": "user", "content": "q"}])
    assert "(effort=high)" in r.choices[0].message.content and r.model == "think-model:thinking"
    r = stack.oa.chat.completions.create(model="think-model:thinking", reasoning_effort="low",
                                         messages=[{"role": "user", "content": "q"}])
    assert "(effort=low)" in r.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as info:
        stack.oa.chat.completions.create(model="base:thinking", messages=[])
    body = info.value.body
    assert body["code"] == "unsupported_model_variant" and body["type"] == "invalid_request_error"
    assert "base:thinking" in body["message"] and ":thinking" in body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_online_is_refused_until_web_search_exists(stack, stream):
    with pytest.raises(openai.NotFoundError) as info:
        r = stack.oa.chat.completions.create(model="base:online", messages=[], stream=stream)
        list(r) if stream else None
    assert info.value.body["code"] == "unsupported_model_variant"


def test_streaming_carries_the_requested_name(stack):
    chunks = list(stack.oa.chat.completions.create(model="base:nitro", messages=[], stream=True,
                                                   extra_headers={"x-demo-split": "1"}))
    assert chunks and {c.model for c in chunks} == {"base:nitro"}


def test_exact_first_and_never_split(stack):
    r = stack.oa.chat.completions.with_raw_response.create(model="lit:nitro", messages=[])
    assert r.parse().model == "lit:nitro" and served_by(r.parse()) == "e1"
    assert "x-continuum-model-variant" not in r.headers
    for name in ("base:cheap", "base:free", "base:extended", "nope:nitro", "base:nitro:floor"):
        with pytest.raises(openai.NotFoundError) as info:
            stack.oa.chat.completions.create(model=name, messages=[])
        assert info.value.body["code"] == "model_not_found" and f"'{name}'" in info.value.body["message"]
    # Only chat completions reads suffixes.
    r = httpx.post(stack.url + "/v1/completions", json={"model": "base:nitro", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("name, served", [
    ("base:nitro", True), ("base:floor", True), ("think-model:thinking", True), ("lit:nitro", True),
    ("base:thinking", False),  # no reasoning support declared
    ("base:online", False),  # no search provider
    ("base:bogus", False), ("nope:nitro", False),
])
def test_a_model_lookup_answers_as_chat_completions_would(stack, name, served):
    """GET /v1/models/{name} agrees with what chat completions serves."""
    r = httpx.get(f"{stack.url}/v1/models/{name}", headers={"authorization": "Bearer k"})
    if served:
        assert r.status_code == 200, r.text
        assert r.json()["id"] == name and r.json()["object"] == "model"
        assert stack.oa.chat.completions.create(model=name, messages=[]).model == name
    else:
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_x_backend_wins_and_reports_not_applied(stack):
    r = stack.oa.chat.completions.with_raw_response.create(model="base:floor", messages=[],
                                                           extra_headers={"x-backend": "e1"})
    assert served_by(r.parse()) == "e1"
    assert r.headers["x-continuum-model-variant-applied"] == "false"


def test_variant_metric_counts(stack):
    before = {(v, a): metric(stack, "continuum_model_variant_requests_total", variant=v, applied=a)
              for v in ("nitro", "floor") for a in ("true", "false")}
    stack.oa.chat.completions.create(model="unrated:nitro", messages=[])
    stack.oa.chat.completions.create(model="base:floor", messages=[], max_tokens=5)
    stack.oa.chat.completions.create(model="base:floor", messages=[], max_tokens=5)
    after = {k: metric(stack, "continuum_model_variant_requests_total", variant=k[0], applied=k[1]) for k in before}
    assert after[("nitro", "false")] - before[("nitro", "false")] == 1
    assert after[("floor", "true")] - before[("floor", "true")] == 2
    assert after[("nitro", "true")] == before[("nitro", "true")]


def test_passive_health_holds_out_a_failing_backend(stack):
    """Last: e1 is held out for the rest of the module."""
    with pytest.raises(openai.InternalServerError):
        stack.oa.chat.completions.create(model="base", messages=[], extra_headers={"x-backend": "e1", "x-demo-status": "503"})
    # The 503 reaches the sidecar in Envoy's access log, within a flush interval.
    deadline = time.monotonic() + 5
    while admin_backends(stack)["e1"]["held_out_s"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert admin_backends(stack)["e1"]["held_out_s"] > 0
    seen = {served_by(stack.oa.chat.completions.create(model="base", messages=[])) for _ in range(6)}
    assert seen == {"e2", "e3"}

"""The router in front of a real inference engine: llama.cpp's ``llama-server``.

Three engines serve tiny random-weight models written by the test
(:mod:`tests.support.gguf_model`): ``llama-a`` a fast one, ``llama-b`` one an order of
magnitude slower (and cheaper, for ``:floor``), ``llama-dark`` one started
without ``--metrics``. The real Envoy and sidecar sit in front; the official
OpenAI SDK and httpx are the clients. Every answer runs to exactly
``max_tokens``, so token counts are exact. The binary is built once by
``python -m tests.support.servers``; without it the module skips.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import orjson
import pytest

from tests.support import gguf_model, llama_build
from tests.support.llama_server import LlamaServer

from ..conftest import metered, metric, sidecar_metric

pytestmark = pytest.mark.integration

ADMIN = "adm"
EXPLAIN = {"x-model-router-explain": "1", "x-model-router-admin-token": ADMIN}
USERS_A = ("u1", "u2", "u3", "u5")  # sticky on x-user: these land in arm a
USERS_B = ("u4",)  # and this one in arm b

CONFIG = """
server: {admin_token: adm}
proxy: {variant_suffixes: {enabled: true}}
monitor: {probe_interval_s: 0.5, scrape_interval_s: 0.25, models_interval_s: 0.5, freshness_s: 4, timeout_s: 2,
          passive_holdout_s: 2,
          max_waiting: 1}
backends:
  - {name: llama-a, url: "%(a)s", type: llamacpp, models: [tiny-a, tiny]}
  - {name: llama-b, url: "%(b)s", type: llamacpp}
  - {name: llama-dark, url: "%(dark)s", type: llamacpp, models: [dark]}
model_metadata:
  - id: tiny
    pricing: {input: 1.0, output: 2.0}
    backend_pricing: {llama-b: {input: 0.1, output: 0.2}}
model_experiments:
  - name: chat
    model: chat
    sticky_key: header:x-user
    response_model: client
    response_headers: true
    variants:
      - {id: a, model: tiny-a, weight: 50, backends: [llama-a]}
      - {id: b, model: tiny, weight: 50, backends: [llama-b]}
"""


def wait_for(pred: Callable[[], object], what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    binary = llama_build.find()
    if binary is None:
        why = f"no llama-server: run `python -m tests.support.servers` to build it into {llama_build.cache_dir()}"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI builds it first: a missing binary there is a broken setup, not a skip
        pytest.skip(why)
    d = tmp_path_factory.mktemp("llama")
    tiny = gguf_model.write(d / "tiny.gguf", gguf_model.TINY)
    slow = gguf_model.write(d / "slow.gguf", gguf_model.SLOW)
    started = {
        "a": LlamaServer(binary, tiny, ("tiny-a",), d),
        "b": LlamaServer(binary, slow, ("tiny-b", "tiny"), d, ctx=8192),  # room for long generations
        "dark": LlamaServer(binary, tiny, ("dark",), d, parallel=1, metrics=False),
    }
    try:
        for server in started.values():
            server.start()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def stack(stack_factory, engines):
    s = stack_factory(CONFIG % {k: e.url for k, e in engines.items()})
    s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=120)
    wait_for(lambda: all(v["models_ok"] for v in backends(s).values()), "every engine's model list")
    return s


def backends(stack) -> dict:
    r = httpx.get(f"http://{stack.sidecar_admin[0]}/admin/backends", headers={"authorization": f"Bearer {ADMIN}"})
    return r.json()["backends"]


def chat(stack, model: str, user: str = "u0", max_tokens: int = 4, **kw):
    return stack.oa.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens,
        extra_headers={"x-user": user, **kw.pop("extra_headers", {})}, **kw)


def served_by(stack, model: str, **body) -> str:
    payload = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(stack.url + "/v1/chat/completions", json=payload, headers=EXPLAIN, timeout=120)
    assert r.status_code == 200, r.text
    return dict(p.split("=", 1) for p in r.headers["x-model-router-explain"].split("; "))["backend"]


def sse_events(body: bytes) -> list[bytes]:
    return [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]


def counters(engine: LlamaServer) -> dict[str, float]:
    raw = engine.raw_metrics()
    return {k: raw[f"llamacpp:{k}"] for k in ("tokens_predicted_total", "prompt_tokens_total",
                                              "prompt_tokens_cached_total")}


@contextmanager
def busy(engine: LlamaServer, streams: int) -> Iterator[None]:
    """``streams`` long generations (tens of seconds on the slow engine) sent to the
    engine directly, cancelled on exit."""
    stop = threading.Event()

    def run() -> None:
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": True}
        try:
            with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


# --------------------------------------------------------------------------- discovery and names


def test_every_alias_of_an_engine_is_discovered_and_routable(stack, engines):
    assert backends(stack)["llama-b"]["models"] == ["tiny", "tiny-b"]  # llama-server lists "tiny" as the id
    listed = {m.id for m in stack.oa.models.list()}
    assert {"chat", "tiny", "tiny-a", "tiny-b"} <= listed
    before = counters(engines["b"])["tokens_predicted_total"]
    r = chat(stack, "tiny-b", max_tokens=3)
    assert r.model == "tiny-b" and r.usage.completion_tokens == 3
    assert counters(engines["b"])["tokens_predicted_total"] == before + 3


def test_the_response_names_the_model_asked_for_whichever_engine_answers(stack):
    # llama-a answers with its own name (tiny-a) and llama-b with "tiny", whatever was asked.
    seen = {}
    for _ in range(4):
        r = httpx.post(stack.url + "/v1/chat/completions", headers=EXPLAIN, timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        backend = dict(p.split("=", 1) for p in r.headers["x-model-router-explain"].split("; "))["backend"]
        seen[backend] = r.json()["model"]
    assert seen == {"llama-a": "tiny", "llama-b": "tiny"}
    assert chat(stack, "chat", user=USERS_A[0]).model == "chat"
    assert chat(stack, "tiny-a").model == "tiny-a"


# --------------------------------------------------------------------------- accounting


def test_per_arm_tokens_equal_the_engines_own_counters(stack, engines):
    metered(stack)
    before = {k: counters(e) for k, e in engines.items() if k != "dark"}
    arm = {v: {kind: metric(stack, "model_experiment_tokens_total", experiment="chat", variant=v, kind=kind)
               for kind in ("prompt", "completion")} for v in ("a", "b")}
    sent = {"a": 0, "b": 0}
    for i, user in enumerate(USERS_A + USERS_B):
        variant = "a" if user in USERS_A else "b"
        tokens = 3 + i
        stream = i % 2 == 1
        if stream:
            got = chat(stack, "chat", user=user, max_tokens=tokens, stream=True)
            chunks = list(got)
            assert all(c.model == "chat" for c in chunks)
        else:
            assert chat(stack, "chat", user=user, max_tokens=tokens).usage.completion_tokens == tokens
        sent[variant] += tokens
    assert metered(stack)
    after = {k: counters(engines[k]) for k in before}
    for variant, engine in (("a", "a"), ("b", "b")):
        completion = metric(stack, "model_experiment_tokens_total", experiment="chat", variant=variant,
                            kind="completion") - arm[variant]["completion"]
        prompt = metric(stack, "model_experiment_tokens_total", experiment="chat", variant=variant,
                        kind="prompt") - arm[variant]["prompt"]
        generated = after[engine]["tokens_predicted_total"] - before[engine]["tokens_predicted_total"]
        assert completion == generated == sent[variant], variant
        # usage.prompt_tokens counts the tokens the engine reused from its cache; its counter does not.
        evaluated = sum(after[engine][k] - before[engine][k] for k in ("prompt_tokens_total", "prompt_tokens_cached_total"))
        assert prompt == evaluated > 0, variant


def test_a_stream_keeps_the_engine_s_timings_and_the_usage_the_client_asked_for(stack):
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    plain = httpx.post(stack.url + "/v1/chat/completions", json=body, headers={"x-user": USERS_A[0]}, timeout=120)
    events = sse_events(plain.content)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["model"] == "chat" and c["choices"] and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] == 3
    asked = {**body, "stream_options": {"include_usage": True}}
    events = sse_events(httpx.post(stack.url + "/v1/chat/completions", json=asked, headers={"x-user": USERS_A[0]},
                                   timeout=120).content)
    last = orjson.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 and "timings" in last


# --------------------------------------------------------------------------- the monitor against the raw page


def test_admin_backends_figures_are_the_engine_s_own(stack, engines):
    def matches(name: str, engine: LlamaServer) -> bool:
        view = backends(stack)[name]
        raw = engine.raw_metrics()
        speed = raw["llamacpp:tokens_predicted_total"] / raw["llamacpp:tokens_predicted_seconds_total"]
        # Idle past the freshness window: the lifetime speed, the queue empty.
        return (view["metrics"] == "ok" and view["engine"] == "llamacpp"
                and view["waiting"] == raw["llamacpp:requests_deferred"]
                and view["running"] == raw["llamacpp:requests_processing"]
                and view["throughput_tps"] == pytest.approx(speed, rel=1e-9))

    chat(stack, "tiny-a", max_tokens=2)
    wait_for(lambda: matches("llama-a", engines["a"]) and matches("llama-b", engines["b"]), "the raw figures")


def test_an_engine_without_metrics_is_reported_missing_with_the_flag_named(stack):
    # llama-server without --metrics answers /metrics with 501 Not Implemented.
    view = wait_for(lambda: (v := backends(stack)["llama-dark"])["metrics"] == "missing" and v, "metrics missing")
    assert view["healthy"] and view["throughput_tps"] is None
    texts = stack.metrics_text()
    assert sum(sidecar_metric(t, "model_router_backend_engine_metrics_missing", backend="llama-dark") for t in texts) == 1
    warned = [line for line in stack.log("sidecar-0").splitlines() if "backend llama-dark shows none" in line]
    assert len(warned) == 1 and "(status 501)" in warned[0] and "--metrics" in warned[0]
    assert chat(stack, "dark", max_tokens=2).choices[0].finish_reason == "length"


# --------------------------------------------------------------------------- suffixes and the gate


def test_nitro_prefers_the_idle_fast_engine_to_the_busy_slow_one(stack, engines):
    chat(stack, "tiny-a", max_tokens=2)  # both engines have decoded: both are rated
    chat(stack, "tiny-b", max_tokens=2)
    wait_for(lambda: all(backends(stack)[n]["throughput_tps"] for n in ("llama-a", "llama-b")), "both rated")
    with busy(engines["b"], 2):
        wait_for(lambda: backends(stack)["llama-b"]["running"] == 2, "llama-b busy")
        view = backends(stack)
        assert view["llama-a"]["throughput_tps"] > view["llama-b"]["throughput_tps"]
        assert {served_by(stack, "tiny:nitro") for _ in range(4)} == {"llama-a"}
    assert {served_by(stack, "tiny:floor") for _ in range(2)} == {"llama-b"}  # cheaper there
    assert chat(stack, "tiny:nitro").model == "tiny:nitro"


def test_a_full_queue_takes_the_engine_out_of_rotation(stack, engines):
    with busy(engines["b"], 6):  # two slots: two run, four wait, over max_waiting (1)
        wait_for(lambda: (backends(stack)["llama-b"]["waiting"] or 0) >= 2, "llama-b's queue")

        def as_raw() -> bool:
            raw, view = engines["b"].raw_metrics(), backends(stack)["llama-b"]
            return raw["llamacpp:requests_deferred"] >= 2 and (view["waiting"], view["running"]) == (
                raw["llamacpp:requests_deferred"], raw["llamacpp:requests_processing"])

        wait_for(as_raw, "the queue as the engine's own page shows it")
        assert not backends(stack)["llama-b"]["admissible"]
        with pytest.raises(openai.APIStatusError) as info:
            chat(stack, "chat", user=USERS_B[0])  # arm b is pinned to llama-b
        assert info.value.status_code == 503 and info.value.body["code"] == "no_backend_available"
        assert {served_by(stack, "tiny") for _ in range(3)} == {"llama-a"}
    wait_for(lambda: backends(stack)["llama-b"]["admissible"], "llama-b back in rotation")
    assert chat(stack, "chat", user=USERS_B[0]).model == "chat"


# --------------------------------------------------------------------------- an engine killed mid-stream


def test_an_engine_killed_mid_stream_is_an_error_on_the_arm_and_comes_back(stack, engines):
    engine = engines["a"]
    failed = metric(stack, "model_experiment_requests_total", experiment="chat", variant="a", status="server_error")
    body = {"model": "chat", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900, "stream": True}
    received = b""
    cut: Exception | None = None
    try:
        with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, headers={"x-user": USERS_A[0]},
                          timeout=120) as r:
            assert r.status_code == 200
            for piece in r.iter_bytes():
                received += piece
                if received.count(b"\n\n") >= 5 and engine.proc is not None and engine.proc.poll() is None:
                    engine.kill()
    except httpx.HTTPError as exc:
        cut = exc
    events = sse_events(received)
    assert b"[DONE]" not in events and len(events) < 1900
    assert cut is not None or b'"error"' in events[-1], "the client was not told the stream failed"
    assert metered(stack)
    wait_for(lambda: metric(stack, "model_experiment_requests_total", experiment="chat", variant="a",
                            status="server_error") == failed + 1, "the cut stream counted as a server error")
    assert "Task exception was never retrieved" not in stack.log("sidecar-0")
    engine.start()
    wait_for(lambda: backends(stack)["llama-a"]["admissible"], "llama-a back")
    assert chat(stack, "chat", user=USERS_A[0]).model == "chat"

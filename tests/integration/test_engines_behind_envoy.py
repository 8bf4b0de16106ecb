"""The monitor against stand-ins for each engine, behind the real Envoy.

Demo engines serve the sample pages of ``tests/data/engines`` (and SGLang's
404 and slow health check); the tests read what the monitor made of them in
``/admin/backends`` and send requests through Envoy to see the saturation
gate and ``:nitro`` act on those figures.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from ..conftest import sidecar_metric
from ..unit.test_engines import page

pytestmark = pytest.mark.integration

CONFIG = """
server: {admin_token: adm}
proxy: {variant_suffixes: {enabled: true}}
monitor: {probe_interval_s: 0.25, scrape_interval_s: 0.25, models_interval_s: 2, freshness_s: 6, max_waiting: 8,
          timeout_s: 1}
backends:
  - {name: vllm-v1, url: "demo://", type: vllm, models: [m-vllm-v1]}
  - {name: vllm-v1-dp, url: "demo://", type: vllm, models: [m-vllm-v1-dp]}
  - {name: vllm-v0, url: "demo://", type: vllm, models: [m-vllm-v0]}
  - {name: sglang, url: "demo://", type: sglang, models: [fast]}
  - {name: sglang-priority, url: "demo://", type: sglang, models: [prio]}
  - {name: sglang-dp, url: "demo://", type: sglang, models: [fast]}
  - {name: sglang-tp, url: "demo://", type: sglang, models: [fast]}
  - {name: tgi, url: "demo://", type: tgi, models: [local]}
  - {name: llamacpp, url: "demo://", type: llamacpp, models: [local]}
  - {name: sglang-slow, url: "demo://", type: sglang, models: [slow]}
  - {name: sglang-off, url: "demo://", type: sglang, models: [dark, fast]}
  - {name: vllm-slow, url: "demo://", type: vllm, models: [slow-too]}
"""

# backend -> (sample page, throughput_tps, waiting, running) as /admin/backends should show them.
# A counter that does not move is a throughput of 0: two fresh scrapes say so.
SERVED = {
    "vllm-v1": ("vllm-v1", 0.0, 2.0, 7.0),
    "vllm-v1-dp": ("vllm-v1-dp-api-servers", 0.0, 4.0, 9.0),
    "vllm-v0": ("vllm-v0", 0.0, 1.0, 3.0),
    "sglang": ("sglang-default", 800.0, 6.0, 9.0),
    "sglang-priority": ("sglang-priority-buckets", 800.0, 6.0, 9.0),
    "sglang-dp": ("sglang-dp", 772.5, 5.0, None),
    "sglang-tp": ("sglang-tp-all-schedulers", 800.0, 6.0, None),
    "tgi": ("tgi", 0.0, 4.0, 12.0),
    "llamacpp": ("llamacpp", 93.0, 1.0, 3.0),  # one request's speed: 6789 tokens in 73 s of decoding
}


def set_state(stack, name: str, **state) -> dict:
    r = httpx.post(stack.demo_urls[name] + "/_demo/state", json=state)
    r.raise_for_status()
    return r.json()


def admin_backends(stack) -> dict:
    r = httpx.get(f"http://{stack.sidecar_admin[0]}/admin/backends", headers={"authorization": "Bearer adm"})
    return r.json()["backends"]


def wait_for(pred, what: str, timeout: float = 15.0, fail: bool = True):
    """``pred()`` once truthy; at ``timeout`` a failure, or with ``fail`` False its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            assert value or not fail, f"timed out waiting for {what}"
            return value
        time.sleep(0.05)


def figures(view: dict) -> tuple:
    return view["throughput_tps"], view["waiting"], view["running"]


def served_by(resp) -> str:
    return resp.choices[0].message.content.split("]")[0].lstrip("[")


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG)
    for name, (sample, *_) in SERVED.items():
        set_state(s, name, metrics_page=page(sample))
    set_state(s, "sglang-slow", metrics_page=page("sglang-default"))
    set_state(s, "sglang-off", metrics_enabled=False)  # SGLang started without --enable-metrics
    s.oa = openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0)
    wanted = {name: tuple(expected) for name, (_, *expected) in SERVED.items()}
    # Settle: the switch from the demo engine's own page moves its counter once. The tests
    # themselves say what differs when the figures never come right.
    wait_for(lambda: {n: figures(v) for n, v in admin_backends(s).items() if n in wanted} == wanted,
             "the monitor to read every sample page", fail=False)
    return s


def test_the_monitor_reads_each_page_as_its_engine_means_it(stack):
    view = admin_backends(stack)
    for name, (_, tps, waiting, running) in SERVED.items():
        assert figures(view[name]) == (tps, waiting, running), name
        assert view[name]["healthy"] and view[name]["admissible"], name
        assert view[name]["metrics"] == "ok" and view[name]["engine"] == name.split("-")[0], name


def test_the_gate_counts_sglang_s_priority_total_once(stack):
    # max_waiting is 8: the total of 6 admits the backend (total plus its buckets, 12, would not).
    assert admin_backends(stack)["sglang-priority"]["admissible"]
    assert served_by(stack.oa.chat.completions.create(model="prio", messages=[])) == "sglang-priority"
    busier = page("sglang-priority-buckets").replace('priority="",tp_rank="0"} 6.0', 'priority="",tp_rank="0"} 9.0')
    set_state(stack, "sglang-priority", metrics_page=busier)
    try:
        wait_for(lambda: not admin_backends(stack)["sglang-priority"]["admissible"], "a queue of 9 to saturate")
        assert admin_backends(stack)["sglang-priority"]["waiting"] == 9.0
        with pytest.raises(openai.APIStatusError) as info:
            stack.oa.chat.completions.create(model="prio", messages=[])
        assert info.value.status_code == 503 and info.value.body["code"] == "no_backend_available"
    finally:
        set_state(stack, "sglang-priority", metrics_page=page("sglang-priority-buckets"))
    wait_for(lambda: admin_backends(stack)["sglang-priority"]["admissible"], "the queue to drop back")


def test_nitro_counts_a_batch_seen_by_every_tp_rank_once(stack):
    # sglang and sglang-tp both generate 800 tokens/s (sglang-tp's two ranks report the same
    # batch), sglang-dp 772.5 over two DP ranks: :nitro keeps the two tied at 800.
    # sglang-off serves fast too, but without metrics :nitro has no figure for it.
    seen = {served_by(stack.oa.chat.completions.create(model="fast:nitro", messages=[])) for _ in range(6)}
    assert seen == {"sglang", "sglang-tp"}


def test_nitro_rates_llama_cpp_by_one_request_s_speed_and_tgi_by_finished_tokens(stack):
    """llama.cpp's figure is one request's decode speed, kept while the engine is idle (93 tokens/s
    on its sample page); TGI counts a request's tokens when it finishes, so it is rated 0 until
    6000 tokens finish inside the freshness window (6 s here), then at least 1000 tokens/s."""
    seen = {served_by(stack.oa.chat.completions.create(model="local:nitro", messages=[])) for _ in range(4)}
    assert seen == {"llamacpp"}
    # 100 more tokens that took 10 s to decode: the window's speed, 10 tokens/s.
    slower = (page("llamacpp").replace("llamacpp:tokens_predicted_total 6789", "llamacpp:tokens_predicted_total 6889")
              .replace("llamacpp:tokens_predicted_seconds_total 73", "llamacpp:tokens_predicted_seconds_total 83"))
    set_state(stack, "llamacpp", metrics_page=slower)
    finished = page("tgi").replace("tgi_request_generated_tokens_sum 51234", "tgi_request_generated_tokens_sum 57234")
    try:
        wait_for(lambda: admin_backends(stack)["llamacpp"]["throughput_tps"] == 10.0, "the slower window")
        set_state(stack, "tgi", metrics_page=finished)
        wait_for(lambda: (admin_backends(stack)["tgi"]["throughput_tps"] or 0) >= 1000, "the finished request to count")
        seen = {served_by(stack.oa.chat.completions.create(model="local:nitro", messages=[])) for _ in range(4)}
        assert seen == {"tgi"}
    finally:
        set_state(stack, "llamacpp", metrics_page=page("llamacpp"))
        set_state(stack, "tgi", metrics_page=page("tgi"))


def test_a_backend_without_metrics_is_warned_about_once(stack):
    first = set_state(stack, "sglang-off")["metrics_scrapes"]
    wait_for(lambda: set_state(stack, "sglang-off")["metrics_scrapes"] >= first + 5, "five more scrapes")
    view = admin_backends(stack)["sglang-off"]
    assert view["metrics"] == "missing" and view["engine"] == "sglang"
    assert figures(view) == (None, None, None) and view["healthy"] and view["admissible"]
    warned = [line for line in stack.log("sidecar-0").splitlines()
              if "WARNING" in line and "backend sglang-off shows none of the sglang metrics" in line]
    # One warning, whether its first scrape met the 404 or the demo engine's page before it.
    assert len(warned) == 1 and "--enable-metrics" in warned[0]
    text = stack.metrics_text()[0]
    assert sidecar_metric(text, "model_router_backend_engine_metrics_missing", backend="sglang-off") == 1.0
    assert sidecar_metric(text, "model_router_backend_engine_metrics_missing", backend="sglang") == 0.0
    # It still serves; :nitro has nothing to rank it by.
    raw = stack.oa.chat.completions.with_raw_response.create(model="dark:nitro", messages=[])
    assert served_by(raw.parse()) == "sglang-off" and raw.headers["x-continuum-model-variant-applied"] == "false"


def test_a_slow_generation_check_is_no_failure(stack):
    """SGLang's /health generates a token: 1.5 s is a healthy answer, where a liveness check
    (vLLM's, bounded by monitor.timeout_s: 1 s here) that slow fails."""
    assert admin_backends(stack)["sglang-slow"]["health_check"] == "generation"
    assert admin_backends(stack)["vllm-slow"]["health_check"] == "liveness"
    for name in ("sglang-slow", "vllm-slow"):
        set_state(stack, name, health_delay_ms=1500)
    try:
        first = set_state(stack, "sglang-slow")["health_checks"]
        wait_for(lambda: not admin_backends(stack)["vllm-slow"]["healthy"], "the slow liveness check to fail")
        # Three slow checks answered (a fourth has arrived) and the backend never failed one.
        wait_for(lambda: set_state(stack, "sglang-slow")["health_checks"] >= first + 4, "slow checks", timeout=30)
        view = admin_backends(stack)["sglang-slow"]
        assert view["healthy"] and view["probe_failures"] == 0 and view["admissible"]
        assert served_by(stack.oa.chat.completions.create(model="slow", messages=[])) == "sglang-slow"
        log = stack.log("sidecar-0")
        assert not [line for line in log.splitlines() if "sglang-slow" in line and "health check" in line]
        assert "backend vllm-slow is down: its liveness health check /health failed" in log
    finally:
        for name in ("sglang-slow", "vllm-slow"):
            set_state(stack, name, health_delay_ms=0)
    wait_for(lambda: admin_backends(stack)["vllm-slow"]["healthy"], "the liveness check to pass again")

"""Model experiments through real Envoy, two sidecar replicas and the SDKs."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from sidecar.routing.assignment import assign

from ..conftest import clear_demo_requests, demo_requests, metered, metric, routed_again, sidecar_metric, wait_metric

pytestmark = pytest.mark.integration

N_CALLERS = 2000

CONFIG = """
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
model_experiments:
  - name: split
    model: chat
    response_headers: true
    variants:
      - {id: control, model: model-a, weight: %(control)d}
      - {id: candidate, model: model-b, weight: %(candidate)d}
  - name: client-named
    model: chat-client
    response_model: client
    sticky_key: user
    variants:
      - {id: a, model: model-a, weight: 1}
      - {id: b, model: model-b, weight: 1, backends: [pool-b]}
  - name: metered
    model: chat-metered
    variants: [{id: only, model: model-a, weight: 1}]
"""


def tolerance(p: float, n: int) -> float:
    """4.5 standard errors of a proportion p estimated from n samples."""
    return 4.5 * math.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG % {"control": 90, "candidate": 10}, sidecars=2)
    s.http = httpx.Client(base_url=s.url, timeout=30, limits=httpx.Limits(max_connections=16))
    return s


def arm(stack, key: str | None) -> tuple[str, str]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = stack.http.post("/v1/chat/completions", json={"model": "chat", "messages": []}, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-continuum-experiment-variant"], r.json()["model"]


def arms(stack, keys) -> dict[str, str]:
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda k: arm(stack, k), keys))
    for variant, model in results:
        assert model == {"control": "model-a", "candidate": "model-b"}[variant]
    return {k: v for k, (v, _) in zip(keys, results)}


KEYS = [f"caller-{i:05d}" for i in range(N_CALLERS)]


@pytest.fixture(scope="module")
def first_arms(stack):
    return arms(stack, KEYS)


def test_split_follows_weights_and_the_published_hash(first_arms):
    share = sum(v == "candidate" for v in first_arms.values()) / N_CALLERS
    assert abs(share - 0.10) <= tolerance(0.10, N_CALLERS), share
    variants = (("control", 90), ("candidate", 10))
    for key, variant in first_arms.items():
        assert variant == assign("split", variants, key).variant_id


def test_every_caller_keeps_its_arm_across_replicas_and_restart(stack, first_arms):
    sample = KEYS[:400]
    # Envoy round-robins streams over the two sidecar processes: each key meets both.
    for _ in range(2):
        assert arms(stack, sample) == {k: first_arms[k] for k in sample}
    # Both replicas decided some of those requests.
    assert all(sidecar_metric(text, "model_router_decisions_total", outcome="routed") > 0
               for text in stack.metrics_text())
    stack.stop_sidecar()
    stack.start_sidecar()
    routed_again(stack)
    assert arms(stack, sample) == {k: first_arms[k] for k in sample}


def test_callers_without_key_are_random(stack):
    before = metric(stack, "model_experiment_requests_total", experiment="split", assignment="random")
    sticky = metric(stack, "model_experiment_requests_total", experiment="split", assignment="sticky")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: arm(stack, None), range(200)))
    assert wait_metric(stack, "model_experiment_requests_total", before + 200, experiment="split",
                       assignment="random") - before == 200
    assert metric(stack, "model_experiment_requests_total", experiment="split", assignment="sticky") == sticky


def test_random_draws_follow_weights(stack):
    with ThreadPoolExecutor(8) as pool:
        variants = [v for v, _ in pool.map(lambda _: arm(stack, None), range(1000))]
    share = variants.count("candidate") / len(variants)
    assert abs(share - 0.10) <= tolerance(0.10, len(variants)), share


def test_response_model_client_buffered_and_streamed(stack):
    oa = openai.OpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0)
    for user in ("u-1", "u-2", "u-3", "u-4"):
        r = oa.chat.completions.create(model="chat-client", user=user, messages=[{"role": "user", "content": "héllo"}])
        assert r.model == "chat-client"
        assert r.choices[0].message.content.split("]")[0] in ("[pool-a", "[pool-b")
        chunks = list(oa.chat.completions.create(
            model="chat-client", user=user, stream=True, messages=[{"role": "user", "content": "a b c"}],
            extra_headers={"x-demo-split": "1"},
        ))
        assert chunks and {c.model for c in chunks} == {"chat-client"}
        # The sidecar asked upstream for usage; the client, who did not, sees none of it.
        assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert "héllo→✓" in text
        with_usage = list(oa.chat.completions.create(
            model="chat-client", user=user, stream=True, messages=[{"role": "user", "content": "a b c"}],
            stream_options={"include_usage": True},
        ))
        assert with_usage[-1].usage is not None and with_usage[-1].choices == []
        assert {c.model for c in with_usage} == {"chat-client"}


def test_anthropic_ingress_resolves_and_rewrites(stack):
    clear_demo_requests(stack)
    an = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="k", max_retries=0)
    msg = an.messages.create(model="chat-client", max_tokens=20, metadata={"user_id": "user-7"},
                             messages=[{"role": "user", "content": "hi"}])
    assert msg.model == "chat-client"
    with an.messages.stream(model="chat-client", max_tokens=20, metadata={"user_id": "user-7"},
                            messages=[{"role": "user", "content": "hi"}]) as s:
        final = s.get_final_message()
    assert final.model == "chat-client"
    seen = demo_requests(stack, "pool-a") + demo_requests(stack, "pool-b")
    assert [s["path"] for s in seen] == ["/v1/messages", "/v1/messages"]
    expected = assign("client-named", (("a", 1), ("b", 1)), "user-7").variant_id
    assert {s["json"]["model"] for s in seen} == {{"a": "model-a", "b": "model-b"}[expected]}


def test_metrics_count_requests_tokens_and_statuses(stack):
    oa = openai.OpenAI(base_url=stack.url + "/v1", api_key="meter", max_retries=0)
    msgs = [{"role": "user", "content": "one two three four"}]
    usages = [oa.chat.completions.create(model="chat-metered", messages=msgs).usage for _ in range(3)]
    list(oa.chat.completions.create(model="chat-metered", messages=msgs, stream=True))
    list(oa.chat.completions.create(model="chat-metered", messages=msgs, stream=True,
                                    stream_options={"include_usage": True}))
    with pytest.raises(openai.InternalServerError):
        oa.chat.completions.create(model="chat-metered", messages=msgs, extra_headers={"x-demo-status": "500"})
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model="chat-metered", messages=msgs, extra_headers={"x-demo-status": "400"})
    an = anthropic.Anthropic(base_url=stack.url + "/anthropic", api_key="meter", max_retries=0)
    assert an.messages.count_tokens(model="chat-metered", messages=msgs).input_tokens > 0

    m = lambda name, **kw: metric(stack, name, experiment="metered", variant="only", **kw)  # noqa: E731
    # Accounting arrives with Envoy's access log: wait for all 7 entries, and
    # for every entry of a request Envoy finished, so a double count would show.
    wait_metric(stack, "model_experiment_requests_total", 7, experiment="metered", variant="only")
    assert metered(stack, timeout=15)
    assert m("model_experiment_requests_total", status="success", assignment="sticky") == 5
    assert m("model_experiment_requests_total", status="server_error") == 1
    assert m("model_experiment_requests_total", status="client_error") == 1
    assert m("model_experiment_request_duration_seconds_count") == 7
    u = usages[0]
    assert m("model_experiment_tokens_total", kind="prompt") == 5 * u.prompt_tokens
    assert m("model_experiment_tokens_total", kind="completion") == 5 * u.completion_tokens


def test_weight_edit_moves_only_control_callers(stack, first_arms):
    """Runs last: edits the config file under the running sidecars."""
    reloads = metric(stack, "model_router_config_reloads_total", result="success")
    stack.config_path.write_text(CONFIG % {"control": 80, "candidate": 20})
    deadline = time.monotonic() + 15
    while metric(stack, "model_router_config_reloads_total", result="success") < reloads + 2:
        assert time.monotonic() < deadline, "sidecars did not reload"
        time.sleep(0.1)
    second = arms(stack, KEYS)
    moved = [k for k in KEYS if second[k] != first_arms[k]]
    assert all(first_arms[k] == "control" and second[k] == "candidate" for k in moved)
    assert abs(len(moved) / N_CALLERS - 0.10) <= tolerance(0.10, N_CALLERS)


def test_invalid_edit_is_rejected_and_old_config_keeps_serving(stack):
    failures = metric(stack, "model_router_config_reloads_total", result="failure")
    stack.config_path.write_text(CONFIG.replace("weight: %(candidate)d", "weight: -1") % {"control": 80})
    deadline = time.monotonic() + 15
    while metric(stack, "model_router_config_reloads_total", result="failure") < failures + 2:
        assert time.monotonic() < deadline, "sidecars did not notice the edit"
        time.sleep(0.1)
    assert arm(stack, "caller-00001")[0] in ("control", "candidate")
    assert "config reload rejected" in stack.log("sidecar-0")


KEYED = """
backends:
  - {name: pool-a, url: "demo://", models: [model-a]}
  - {name: pool-b, url: "demo://", models: [model-b]}
api_keys:
  - {key: k-chat-only, id: chat-only, allowed_models: [chat]}
  - {key: k-pool-a, id: pool-a-only, allowed_backends: [pool-a]}
model_experiments:
  - name: pinned
    model: chat
    variants: [{id: b, model: model-b, weight: 1, backends: [pool-b]}]
"""


def test_pins_and_key_allow_lists(stack_factory):
    s = stack_factory(KEYED)
    chat_only = openai.OpenAI(base_url=s.url + "/v1", api_key="k-chat-only", max_retries=0)
    assert chat_only.chat.completions.create(model="chat", messages=[]).model == "model-b"
    with pytest.raises(openai.PermissionDeniedError) as info:
        chat_only.chat.completions.create(model="model-b", messages=[])
    assert "'model-b'" in info.value.body["message"]
    pool_a = openai.OpenAI(base_url=s.url + "/v1", api_key="k-pool-a", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as info:
        pool_a.chat.completions.create(model="chat", messages=[])
    # The refusal names the client-facing model and never falls over to another arm.
    assert info.value.body["code"] == "model_not_permitted" and "'chat'" in info.value.body["message"]
    an = anthropic.Anthropic(base_url=s.url + "/anthropic", api_key="k-pool-a", max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as info:
        an.messages.create(model="chat", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "permission_error"

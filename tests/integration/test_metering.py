"""The metering plane through real Envoy: the decision travels as dynamic
metadata, Envoy reads token usage and sends one access-log entry per request,
and the sidecar turns the entries into per-arm metrics and usage records."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import envoy_stat, metric, wait_metric
from ..support.configs import split_config

pytestmark = pytest.mark.integration

CONFIG = split_config(
    """
metering: {flush_interval_ms: 100}
api_keys:
  - {id: team-a, key: sk-team-a}
  - {id: pinned, key: sk-pinned, allowed_backends: [pool-b]}
""",
    backends='  - {name: pool-c, url: "http://127.0.0.1:9", models: [model-c], health_path: /health}  # nothing listens there',
    between="monitor: {probe_interval_s: 0.2, timeout_s: 0.2}",
    experiments="""\
  - name: renamed
    model: chat-client
    response_headers: true
    response_model: client
    sticky_key: "header:x-caller"
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 1}
  - name: dead-arm
    model: chat-dead
    response_headers: true
    variants: [{id: only, model: model-c, weight: 1}]
  - name: pinned-away
    model: chat-pinned
    response_headers: true
    variants: [{id: only, model: model-a, weight: 1}]
""",
)

PROMPT = "one two three"  # the demo engine counts words: 3 prompt tokens
ARM_BACKEND = {"control": "pool-a", "candidate": "pool-b"}


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def generated(stack, backend: str) -> float:
    """Completion tokens the demo engine behind ``backend`` has produced."""
    text = httpx.get(stack.demo_urls[backend] + "/metrics").text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "vllm:generation_tokens_total"
    )


def served(stack) -> dict[str, float]:
    return {arm: generated(stack, b) for arm, b in ARM_BACKEND.items()}


def counts(stack, experiment: str) -> dict[tuple[str, str], float]:
    out = {}
    for arm in ARM_BACKEND:
        out[arm, "requests"] = metric(stack, "model_experiment_requests_total", experiment=experiment, variant=arm)
        for t in ("prompt", "completion"):
            out[arm, t] = metric(stack, "model_experiment_tokens_total", experiment=experiment, variant=arm, kind=t)
    return out


def settle(stack, experiment: str, before: dict, requests: int) -> dict:
    """Per-arm deltas once ``requests`` more requests have been accounted."""
    total = sum(before[a, "requests"] for a in ARM_BACKEND) + requests
    deadline = time.monotonic() + 10
    while True:
        now = counts(stack, experiment)
        if sum(now[a, "requests"] for a in ARM_BACKEND) >= total or time.monotonic() > deadline:
            time.sleep(0.3)  # anything more would be a double count: let it arrive
            now = counts(stack, experiment)
            return {k: now[k] - before[k] for k in now}
        time.sleep(0.05)


def run_openai(stack, model: str, stream: bool, include_usage: bool, n: int = 12):
    """``n`` chat calls from distinct callers; returns per-arm request counts and
    what the client saw of usage."""
    arms = {a: 0 for a in ARM_BACKEND}
    for i in range(n):
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-team-a",
                               default_headers={"x-caller": f"{model}-{stream}-{include_usage}-{i}"})
        kwargs = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
        if stream:
            kwargs["stream"] = True
            if include_usage:
                kwargs["stream_options"] = {"include_usage": True}
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        arm = raw.headers["x-continuum-experiment-variant"]
        arms[arm] += 1
        result = raw.parse()
        if stream:
            chunks = list(result)
            usage = [c.usage for c in chunks if c.usage is not None]
            # The client sees exactly the usage it asked for.
            assert len(usage) == (1 if include_usage else 0), chunks
            assert all(c.model == (model if model == "chat-client" else {"control": "model-a", "candidate": "model-b"}[arm])
                       for c in chunks)
        else:
            assert result.usage.prompt_tokens == 3
    return arms


@pytest.mark.parametrize(
    "model,stream,include_usage",
    [("chat", False, False), ("chat", True, False), ("chat", True, True),
     ("chat-client", False, False), ("chat-client", True, False), ("chat-client", True, True)],
    ids=["buffered", "stream", "stream-usage", "client-buffered", "client-stream", "client-stream-usage"],
)
def test_openai_counts_and_tokens_per_arm_are_what_the_upstreams_served(stack, model, stream, include_usage):
    experiment = "split" if model == "chat" else "renamed"
    before, gen_before = counts(stack, experiment), served(stack)
    arms = run_openai(stack, model, stream, include_usage)
    delta = settle(stack, experiment, before, sum(arms.values()))
    gen = {a: served(stack)[a] - gen_before[a] for a in ARM_BACKEND}
    assert all(arms.values()), arms  # both arms were exercised
    for a in ARM_BACKEND:
        assert delta[a, "requests"] == arms[a]
        assert delta[a, "prompt"] == 3 * arms[a]
        assert delta[a, "completion"] == gen[a] > 0


def test_anthropic_counts_and_tokens_per_arm(stack):
    before, gen_before = counts(stack, "split"), served(stack)
    arms = {a: 0 for a in ARM_BACKEND}
    for i in range(12):
        client = anthropic.Anthropic(base_url=stack.url, api_key="sk-team-a", default_headers={"x-caller": f"anthropic-{i}"})
        kwargs = {"model": "chat", "max_tokens": 64, "messages": [{"role": "user", "content": PROMPT}]}
        if i % 2:
            with client.messages.stream(**kwargs) as s:
                arm = s.response.headers["x-continuum-experiment-variant"]
                final = s.get_final_message()
        else:
            raw = client.messages.with_raw_response.create(**kwargs)
            arm = raw.headers["x-continuum-experiment-variant"]
            final = raw.parse()
        assert final.usage.input_tokens == 3
        arms[arm] += 1
    delta = settle(stack, "split", before, 12)
    gen = {a: served(stack)[a] - gen_before[a] for a in ARM_BACKEND}
    for a in ARM_BACKEND:
        assert delta[a, "requests"] == arms[a]
        assert delta[a, "prompt"] == 3 * arms[a]
        assert delta[a, "completion"] == gen[a]


def test_an_experiment_request_costs_two_ext_proc_messages(stack):
    """Tokens are counted and the arm reported without the sidecar seeing the response."""
    before = envoy_stat(stack, "ext_proc.stream_msgs_sent")
    for i in range(5):
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": [], "stream": i % 2 == 1},
                       headers={"authorization": "Bearer sk-team-a", "x-caller": f"two-msgs-{i}"})
        assert r.status_code == 200
        assert r.headers["x-continuum-experiment-variant"] in ARM_BACKEND
    assert envoy_stat(stack, "ext_proc.stream_msgs_sent") - before == 10


def test_refusals_after_assignment_count_on_the_arm(stack):
    """A dead arm shows as errors on that arm: Envoy's 503s before the probe
    notices, then the sidecar's own refusals, all counted."""
    key = {"authorization": "Bearer sk-team-a"}
    sent = 0
    deadline = time.monotonic() + 15
    refused = 0
    while refused < 2 and time.monotonic() < deadline:
        r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-dead", "messages": []}, headers=key)
        sent += 1
        assert r.status_code == 503
        assert r.headers["x-continuum-experiment-variant"] == "only"
        refused += r.json()["error"]["code"] == "no_backend_available"
    assert refused == 2
    assert wait_metric(stack, "model_experiment_requests_total", sent, experiment="dead-arm", variant="only",
                       status="server_error") == sent
    before = metric(stack, "model_experiment_requests_total", experiment="pinned-away", variant="only")
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat-pinned", "messages": []},
                   headers={"authorization": "Bearer sk-pinned"})
    assert r.status_code == 403, r.text
    assert r.headers["x-continuum-experiment"] == "pinned-away"
    assert wait_metric(stack, "model_experiment_requests_total", before + 1, experiment="pinned-away",
                       variant="only", status="client_error") == before + 1


def test_count_tokens_stays_out_of_requests_and_duration(stack):
    before = counts(stack, "split")
    dur = metric(stack, "model_experiment_request_duration_seconds_count", experiment="split")
    client = anthropic.Anthropic(base_url=stack.url, api_key="sk-team-a")
    for _ in range(3):
        assert client.messages.count_tokens(model="chat", messages=[{"role": "user", "content": PROMPT}]).input_tokens > 0
    # A request after them marks when their entries have arrived too.
    httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": []},
               headers={"authorization": "Bearer sk-team-a"})
    delta = settle(stack, "split", before, 1)
    assert sum(delta[a, "requests"] for a in ARM_BACKEND) == 1
    assert metric(stack, "model_experiment_request_duration_seconds_count", experiment="split") - dur == 1


def test_label_sets_exist_before_the_first_request_and_no_created_series(stack_factory):
    s = stack_factory(CONFIG)
    text = s.metrics_text()[0]
    names = {x.name for f in text_string_to_metric_families(text) for x in f.samples}
    assert not [n for n in names if n.endswith("_created")]
    assert "process_cpu_seconds_total" in names
    from ..conftest import sidecar_metric

    for exp, arm in [("split", "control"), ("split", "candidate"), ("dead-arm", "only")]:
        assert f'model_experiment_requests_total{{assignment="sticky",experiment="{exp}",status="success",variant="{arm}"}}' in text \
            or _has(text, "model_experiment_requests_total", experiment=exp, variant=arm, status="success")
        assert _has(text, "model_experiment_tokens_total", experiment=exp, variant=arm, kind="completion")
    assert _has(text, "model_router_config_reloads_total", result="failure")
    assert sidecar_metric(text, "model_router_config_reloads_total", result="failure") == 0


def _has(text: str, name: str, **labels) -> bool:
    return any(
        s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        for f in text_string_to_metric_families(text) for s in f.samples
    )


def test_usage_records_carry_the_arm_and_never_the_key(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-team-a")
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": PROMPT}], extra_headers={"x-caller": "records"}
    )
    arm = raw.headers["x-continuum-experiment-variant"]
    rid = raw.headers["x-request-id"].encode()  # Envoy's id for the request, quoted back
    path = stack.usage_records
    deadline = time.monotonic() + 10
    record = None
    while record is None and time.monotonic() < deadline:
        lines = path.read_bytes().splitlines() if path.exists() else []
        record = next((orjson.loads(x) for x in lines if b'"' + rid + b'"' in x), None)
        time.sleep(0.05)
    assert record is not None
    assert record["key_id"] == "team-a"
    assert record["experiment_id"] == "split" and record["experiment_variant_id"] == arm
    assert record["client_model"] == "chat"
    assert record["upstream_model"] == {"control": "model-a", "candidate": "model-b"}[arm]
    assert record["backend"] == ARM_BACKEND[arm]
    assert record["status"] == 200 and record["prompt_tokens"] == 3 and record["completion_tokens"] > 0
    assert record["assignment"] == "sticky"
    assert b"sk-team-a" not in path.read_bytes()


def test_a_response_its_upstream_cut_is_a_server_error_whatever_its_status():
    from sidecar.accounting.metering import Entry, status_class

    def entry(status: int, upstream_failed: bool, client_gone: bool = False) -> Entry:
        return Entry(decision={}, status=status, start=0.0, headers_s=0.1, total_s=0.5, prompt_tokens=None,
                     completion_tokens=None, upstream_failed=upstream_failed, client_gone=client_gone)

    assert status_class(entry(200, upstream_failed=False)) == "success"
    assert status_class(entry(200, upstream_failed=True)) == "server_error"  # the engine died mid-stream
    assert status_class(entry(503, upstream_failed=True)) == "server_error"
    assert status_class(entry(200, upstream_failed=True, client_gone=True)) == "success"  # the client left first
    assert status_class(entry(0, upstream_failed=False, client_gone=True)) == "client_error"


def test_an_observer_that_fails_loses_no_count_and_no_other_entry():
    from sidecar import metrics as m
    from sidecar.accounting.metering import Entry, Meter

    class Broken:
        def observe(self, entry):
            raise RuntimeError("boom")

    seen: list[str] = []

    class Later:
        def observe(self, entry):
            seen.append(entry.decision.request_id)

    def arm() -> float:
        return m.EXPERIMENT_REQUESTS.labels("unit-meter", "a", "server_error", "sticky")._value.get()

    before, errors = arm(), m.STREAM_ERRORS._value.get()
    decision = {"kind": "routed", "experiment": "unit-meter", "variant": "a", "assignment": "sticky"}
    batch = [Entry({**decision, "request_id": str(i)}, 503, 0.0, 0.01, 0.01, None, None, True, False) for i in range(3)]
    Meter(lambda backend, status: None, observers=(Broken(), Later())).record(batch)
    assert arm() == before + 3
    assert seen == ["0", "1", "2"]
    assert m.STREAM_ERRORS._value.get() == errors + 3

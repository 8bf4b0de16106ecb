"""Outcome feedback: the body's rules, the join store, and the endpoint through real Envoy."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.accounting import metering
from sidecar.config.schema import parse
from sidecar.decision import Decision
from sidecar.experiments import feedback, join
from sidecar.experiments.feedback import Feedback, owner_of

from ..conftest import metered
from ..support.configs import split_config

METRICS = """
feedback_metrics:
  - {name: thumbs_up, type: boolean}
  - {name: rating, type: float, optimize: max}
"""
BASE = """
backends:
  - {name: pool-a, url: "http://127.0.0.1:1", models: [model-a]}
model_experiments:
  - name: split
    model: chat
    variants: [{id: control, model: model-a, weight: 1}]
"""


@pytest.fixture
def cfg():
    return parse(BASE + METRICS + "feedback: {ttl_s: 60, max_requests: 3}\n").config


def body(**kw) -> bytes:
    return orjson.dumps({"request_id": "r1", "name": "thumbs_up", "value": True, **kw})


@pytest.mark.parametrize(("raw", "param"), [
    (b"{", None), (b"[1]", None), (b'"x"', None),
    (body(request_id=""), "request_id"), (body(request_id=7), "request_id"), (body(request_id="a\nb"), "request_id"),
    (body(request_id="x" * 300), "request_id"),
    (body(name="stars"), "name"), (body(name=None), "name"),
    (body(value=1), "value"), (body(value="true"), "value"), (body(name="rating", value=True), "value"),
    (body(name="rating", value="4"), "value"), (b'{"request_id": "r1", "name": "rating", "value": NaN}', None),
    (body(name="rating", value=1e999), "value"),
    (body(comment=5), "comment"), (body(comment="x" * 5000), "comment"), (body(extra=1), "extra"),
])
def test_malformed_feedback_is_a_400_in_the_openai_shape(cfg, raw, param):
    reply = feedback.parse(raw, cfg)
    assert isinstance(reply, feedback.Reply) and reply.status == 400
    err = orjson.loads(reply.body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_well_formed_feedback(cfg):
    assert feedback.parse(body(comment="great"), cfg) == feedback.Given("r1", "thumbs_up", True, "great")
    got = feedback.parse(body(name="rating", value=4), cfg)
    assert got == feedback.Given("r1", "rating", 4.0, None) and got.number == 4.0


def test_owner_never_holds_the_key():
    assert owner_of("team-a", "sk-secret") == "id:team-a"
    anon = owner_of(None, "sk-secret")
    assert "sk-secret" not in anon and anon != owner_of(None, "sk-other") and owner_of(None, None) == ""


def run(coro):
    return asyncio.run(coro)


def test_join_replaces_without_double_counting(cfg):
    fb = Feedback()
    labels = {"experiment": "split", "variant": "control", "name": "thumbs_up"}

    def count(m) -> float:
        return m.labels(**labels)._value.get()

    before = [count(m) for m in (feedback.GIVEN, feedback.CORRECTIONS, feedback.VALUE, feedback.RETRACTED)]

    async def go():
        fb.record(cfg, "r1", lambda: "id:team-a", "split", "control")
        first = await fb.handle(cfg, "POST", "id:team-a", body())
        again = await fb.handle(cfg, "POST", "id:team-a", body(value=False))
        other = await fb.handle(cfg, "POST", "id:team-b", body())
        unknown = await fb.handle(cfg, "POST", "id:team-a", body(request_id="r2"))
        wrong_method = await fb.handle(cfg, "GET", "id:team-a", body())
        return first, again, other, unknown, wrong_method

    first, again, other, unknown, wrong_method = run(go())
    assert first[0].status == 200 and orjson.loads(first[0].body)["replaced"] is False
    assert first[1].feedback_value is True and first[1].variant == "control"
    assert again[0].status == 200 and orjson.loads(again[0].body)["replaced"] is True and again[1].feedback_replaces
    assert (first[1].feedback_revision, again[1].feedback_revision) == (1, 2)
    assert other[0].status == 404 and unknown[0].status == 404
    assert other[0].body.replace(b"r1", b"") == unknown[0].body.replace(b"r2", b"")  # no tell between the two
    assert wrong_method[0].status == 405
    after = [count(m) for m in (feedback.GIVEN, feedback.CORRECTIONS, feedback.VALUE, feedback.RETRACTED)]
    given, corrections, value, retracted = (a - b for a, b in zip(after, before))
    assert (given, corrections) == (1, 1)
    assert value - retracted == 0  # true, then replaced by false: the arm's sum is 0


def test_memory_join_is_bounded_and_expires(cfg):
    store = join.MemoryJoin()
    served = join.Served("", "split", "control")
    capacity = join.JOIN_EVICTIONS.labels("capacity")._value.get()
    for i in range(5):
        store.put(f"r{i}", served, 60, 3, now=100.0)
    assert len(store) == 3 and store.get("r0", 100.0) is None and store.get("r4", 100.0) is not None
    assert join.JOIN_EVICTIONS.labels("capacity")._value.get() - capacity == 2
    assert store.get("r3", 161.0) is None  # past its TTL
    store.expire(161.0)
    assert len(store) == 0


def test_feedback_needs_declared_metrics_to_record():
    fb = Feedback()
    plain = parse(BASE).config
    asked = []
    fb.record(plain, "r1", lambda: asked.append("owner") or "", "split", "control")
    assert len(fb.join.memory) == 0 and asked == []  # nor is the owner worked out


def test_feedback_usage_record():
    rec = metering.feedback_record(Decision.decode({
        "kind": "feedback", "feedback_for": "r1", "key_id": "team-a", "experiment": "split", "variant": "control",
        "feedback_name": "rating", "feedback_value": 4.0, "feedback_replaces": False, "feedback_comment": "ok",
        "request_id": "fb-1", "feedback_revision": 1.0}), 0.0)
    assert rec["request_id"] == "r1" and rec["kind"] == "feedback" and rec["value"] == 4.0
    assert rec["comment"] == "ok" and rec["feedback_request_id"] == "fb-1" and rec["replaces"] is False
    assert rec["revision"] == 1 and isinstance(rec["revision"], int)


# --------------------------------------------------------------------------- through Envoy

# A slow access-log flush: feedback sent right after an answer arrives long before the answer's entry.
STACK = split_config("""
metering: {flush_interval_ms: 2000}
server: {admin_token: admin-secret}
api_keys:
  - {id: team-a, key: sk-team-a}
  - {id: team-b, key: sk-team-b}
""") + METRICS


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(STACK)


def fb_metric(stack, series: str, /, **labels) -> float:
    """A series summed over the sidecar processes (feedback is counted when it is answered)."""
    total = 0.0
    for text in stack.metrics_text():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == series and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
    return total


def served(stack, n: int) -> list[tuple[str, str]]:
    """n chat requests as team-a through the official SDK: (request id, arm)."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-team-a")
    out = []
    for i in range(n):
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-caller": f"user-{i}"})
        out.append((raw.headers["x-request-id"], raw.headers["x-continuum-experiment-variant"]))
    return out


def give(stack, key: str, payload) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(stack.url + "/v1/feedback", content=content, timeout=30,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


@pytest.mark.integration
def test_feedback_through_envoy_moves_the_arms_series(stack):
    requests = served(stack, 12)
    arms = {arm for _, arm in requests}
    assert arms == {"control", "candidate"}
    before = {arm: fb_metric(stack, "model_experiment_feedback_total", experiment="split", variant=arm,
                             name="thumbs_up") for arm in arms}
    for rid, arm in requests:  # sent the moment each answer is in, before any access-log flush
        r = give(stack, "sk-team-a", {"request_id": rid, "name": "thumbs_up", "value": arm == "candidate",
                                      "comment": "from the test"})
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "feedback", "request_id": rid, "name": "thumbs_up",
                            "value": arm == "candidate", "replaced": False}
    for arm in arms:
        n = sum(1 for _, a in requests if a == arm)
        assert fb_metric(stack, "model_experiment_feedback_total", experiment="split", variant=arm,
                         name="thumbs_up") - before[arm] == n
    rid, arm = requests[0]
    # A replacement is a correction: the count stays, the value moves.
    value_before = fb_metric(stack, "model_experiment_feedback_value_total", experiment="split", variant=arm)
    retracted_before = fb_metric(stack, "model_experiment_feedback_value_retracted_total", experiment="split",
                                 variant=arm)
    count_before = fb_metric(stack, "model_experiment_feedback_total", experiment="split", variant=arm)
    r = give(stack, "sk-team-a", {"request_id": rid, "name": "thumbs_up", "value": arm != "candidate"})
    assert r.status_code == 200 and r.json()["replaced"] is True
    assert fb_metric(stack, "model_experiment_feedback_total", experiment="split", variant=arm) == count_before
    assert fb_metric(stack, "model_experiment_feedback_corrections_total", experiment="split", variant=arm) >= 1
    net_before = value_before - retracted_before
    net_after = (fb_metric(stack, "model_experiment_feedback_value_total", experiment="split", variant=arm)
                 - fb_metric(stack, "model_experiment_feedback_value_retracted_total", experiment="split", variant=arm))
    assert net_after - net_before == (1 if arm != "candidate" else -1)
    # Feedback records reach the usage records, joined to the arm, the comment kept there alone.
    assert metered(stack, timeout=10)
    deadline = time.monotonic() + 10
    while True:
        lines = [orjson.loads(x) for x in stack.usage_records.read_bytes().splitlines()]
        fb = [x for x in lines if x["kind"] == "feedback" and x["request_id"] == rid]
        if len(fb) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    fb.sort(key=lambda x: x["revision"])  # Envoy's worker threads flush their entries independently
    assert [(x["revision"], x["replaces"]) for x in fb] == [(1, False), (2, True)]
    assert {x["experiment_variant_id"] for x in fb} == {arm} and fb[1]["value"] is (arm != "candidate")
    assert fb[0]["comment"] == "from the test" and "comment" in fb[1] and fb[1]["comment"] is None
    assert {x["key_id"] for x in fb} == {"team-a"}


@pytest.mark.integration
def test_feedback_refusals_through_envoy(stack):
    (rid, _), = served(stack, 1)
    other = give(stack, "sk-team-b", {"request_id": rid, "name": "thumbs_up", "value": True})
    unknown = give(stack, "sk-team-a", {"request_id": "not-a-request", "name": "thumbs_up", "value": True})
    assert other.status_code == 404 and unknown.status_code == 404
    assert other.json()["error"]["code"] == "request_not_found"
    assert other.json()["error"]["message"].replace(rid, "?") == unknown.json()["error"]["message"].replace(
        "not-a-request", "?")
    bad_name = give(stack, "sk-team-a", {"request_id": rid, "name": "stars", "value": 1})
    assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "name"
    bad_value = give(stack, "sk-team-a", {"request_id": rid, "name": "rating", "value": "five"})
    assert bad_value.status_code == 400 and bad_value.json()["error"]["code"] == "invalid_feedback"
    assert give(stack, "sk-team-a", b"{not json").status_code == 400
    assert give(stack, "sk-nobody", {"request_id": rid, "name": "thumbs_up", "value": True}).status_code == 401
    assert httpx.get(stack.url + "/v1/feedback", headers={"authorization": "Bearer sk-team-a"}).status_code == 405
    # A request outside any experiment has no arm to join.
    raw = httpx.post(stack.url + "/v1/chat/completions", json={"model": "model-a", "messages": []},
                     headers={"authorization": "Bearer sk-team-a"})
    assert raw.status_code == 200
    outside = give(stack, "sk-team-a", {"request_id": raw.headers["x-request-id"], "name": "thumbs_up", "value": True})
    assert outside.status_code == 404
    huge = give(stack, "sk-team-a", {"request_id": rid, "name": "rating", "value": 1, "comment": "x" * 70_000})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    # Another spelling of the path, and the key in x-api-key: the same endpoint and the same owner.
    rating = httpx.post(stack.url + "/V1/Feedback/", json={"request_id": rid, "name": "rating", "value": 4.5},
                        headers={"x-api-key": "sk-team-a"})
    assert rating.status_code == 200, rating.text
    assert fb_metric(stack, "model_experiment_feedback_distribution_count", experiment="split", name="rating") >= 1


@pytest.mark.integration
def test_report_through_the_admin_port(stack):
    requests = served(stack, 20)
    for rid, arm in requests:
        assert give(stack, "sk-team-a", {"request_id": rid, "name": "thumbs_up", "value": arm == "candidate"}).status_code == 200
    assert metered(stack, timeout=10)
    url = f"http://{stack.sidecar_admin[0]}/admin/experiments/split/report"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url.replace("split", "nope"), headers={"authorization": "Bearer admin-secret"}).status_code == 404
    deadline = time.monotonic() + 10
    while True:
        doc = httpx.get(url, headers={"authorization": "Bearer admin-secret"}, timeout=30).json()
        if sum(a["requests"] for a in doc["arms"]) >= 20 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert doc["source"] == "usage_records" and doc["control"] == "control"
    arms = {a["variant"]: a for a in doc["arms"]}
    # Every candidate request got true and every control one false, but for one the first test flipped.
    assert arms["candidate"]["metrics"]["feedback:thumbs_up"]["mean"] > 0.85
    assert arms["control"]["metrics"]["feedback:thumbs_up"]["mean"] < 0.15
    assert arms["control"]["callers"] > 0 and arms["control"]["metrics"]["tokens_per_request"]["n"] > 0
    assert doc["comparisons"][0]["metrics"]["feedback:thumbs_up"]["verdict"] in ("better", "not yet distinguishable")


@pytest.mark.integration
def test_prometheus_records_the_feedback_rules_and_the_report_reads_it(stack_factory, tmp_path, capsys):
    from pathlib import Path

    from sidecar.commands.main import main
    from tests.support.servers import PrometheusServer

    rules = Path(__file__).resolve().parents[2] / "deploy" / "observability" / "model-router.rules.yml"
    fresh = stack_factory(STACK.replace("flush_interval_ms: 2000", "flush_interval_ms: 100"))
    prom = PrometheusServer(tmp_path / "prometheus", targets=fresh.sidecar_admin, rule_files=[rules]).start()
    try:
        def primed() -> bool:
            return bool(prom.query('model_experiment_feedback_total{name="thumbs_up"}'))

        wait_until(primed, "the first scrape of the primed feedback series")
        requests = served(fresh, 16)
        for i, (rid, arm) in enumerate(requests):
            value = arm == "candidate" or i % 4 == 0
            assert give(fresh, "sk-team-a", {"request_id": rid, "name": "thumbs_up", "value": value}).status_code == 200
        rid, arm = requests[1]
        assert give(fresh, "sk-team-a", {"request_id": rid, "name": "thumbs_up", "value": arm != "candidate"}).json()[
            "replaced"]
        assert metered(fresh, timeout=10)
        want = {}
        for a in ("control", "candidate"):
            n = fb_metric(fresh, "model_experiment_feedback_total", experiment="split", variant=a, name="thumbs_up")
            net = (fb_metric(fresh, "model_experiment_feedback_value_total", experiment="split", variant=a)
                   - fb_metric(fresh, "model_experiment_feedback_value_retracted_total", experiment="split", variant=a))
            want[a] = net / n

        def means() -> dict[str, float]:
            return {s["metric"]["variant"]: float(s["value"][1]) for s in prom.query(
                'model_experiment_feedback:mean:ratio_rate1h{experiment="split", name="thumbs_up"}')}

        got = wait_until(lambda: (m := means()) and all(m.get(a) == pytest.approx(v) for a, v in want.items()) and m,
                         "the recorded means to match the sidecar's counters")
        delta = {s["metric"]["variant"]: float(s["value"][1]) for s in prom.query(
            'model_experiment_feedback:mean_delta_vs_control:ratio_rate1h{name="thumbs_up"}')}
        assert delta["control"] == 0 and delta["candidate"] == pytest.approx(got["candidate"] - got["control"])
        for rule in ("model_experiment_feedback:given:rate5m", "model_experiment_feedback:per_request:ratio_rate5m",
                     "model_experiment_feedback:corrections:ratio_rate5m"):
            assert {s["metric"]["variant"] for s in prom.query(rule)} == {"control", "candidate"}, rule
        config = tmp_path / "config.yaml"
        config.write_text(STACK)
        assert main(["experiments", "report", "--config", str(config), "--prometheus", prom.url,
                     "--experiment", "split", "--window", "1h", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["source"] == "prometheus"
        arms = {a["variant"]: a for a in doc["arms"]}
        for a, v in want.items():  # increase() extrapolates each series to the window's edges: nearly exact
            assert arms[a]["metrics"]["feedback:thumbs_up"]["mean"] == pytest.approx(v, rel=0.01)
        assert sum(a["requests"] for a in arms.values()) >= 16
    finally:
        prom.stop()


def wait_until(check, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.integration
def test_two_sidecars_share_the_join_through_redis(stack_factory, redis_server):
    import redis

    text = STACK + 'redis: {url: "%s", timeout_ms: 200, key_prefix: "fbtest:"}\nfeedback: {ttl_s: 600}\n' % redis_server.url
    pair = stack_factory(text, sidecars=2)
    requests: list[tuple[str, str]] = []
    for _ in range(10):  # until Envoy has spread the decisions over both processes
        requests += served(pair, 4)
        decided = [sidecar_count(t, "model_router_decisions_total") for t in pair.metrics_text()]
        if all(n > 0 for n in decided):
            break
    assert all(n > 0 for n in decided), decided
    store = redis.Redis.from_url(redis_server.url)
    rid, arm = requests[0]
    stored = store.hgetall(f"fbtest:feedback:{rid}")
    assert stored == {b"owner": b"id:team-a", b"experiment": b"split", b"variant": arm.encode()}
    assert 0 < store.ttl(f"fbtest:feedback:{rid}") <= 600
    for rid, _ in requests:
        r = give(pair, "sk-team-a", {"request_id": rid, "name": "rating", "value": 3})
        assert r.status_code == 200 and r.json()["replaced"] is False, r.text
    assert give(pair, "sk-team-a", {"request_id": rid, "name": "rating", "value": 5}).json()["replaced"] is True
    assert give(pair, "sk-team-b", {"request_id": rid, "name": "rating", "value": 5}).status_code == 404
    per_process = [sidecar_count(t, "model_experiment_feedback_total") for t in pair.metrics_text()]
    assert sum(per_process) == len(requests)
    assert sum(sidecar_count(t, "model_experiment_feedback_corrections_total") for t in pair.metrics_text()) == 1
    assert [sidecar_count(t, "model_router_feedback_join_entries") for t in pair.metrics_text()] == [0, 0]
    assert store.hget(f"fbtest:feedback:{rid}", "rev:rating") == b"2"
    # Redis gone: the router cannot tell whether it knows the request, so it says so (503), not 404.
    redis_server.kill()
    try:
        down = give(pair, "sk-team-a", {"request_id": rid, "name": "rating", "value": 1})
        assert down.status_code == 503 and down.json()["error"]["code"] == "feedback_unavailable"
        assert down.headers["retry-after"] == "1"
    finally:
        redis_server.start()
    # Each process's pooled connections fail once after the restart (counted, answered 503); then new
    # requests join again, and the old one is forgotten: this Redis keeps nothing across a restart.
    codes = []
    for _ in range(30):
        (new, _), = served(pair, 1)
        codes.append(give(pair, "sk-team-a", {"request_id": new, "name": "rating", "value": 2}).status_code)
        if codes[-3:] == [200, 200, 200]:
            break
    assert codes[-3:] == [200, 200, 200] and set(codes) <= {200, 404, 503}, codes
    old = [give(pair, "sk-team-a", {"request_id": rid, "name": "rating", "value": 2}).status_code for _ in range(3)]
    assert 404 in old and set(old) <= {404, 503}, old


def sidecar_count(text: str, series: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == series)


@pytest.mark.integration
def test_without_feedback_metrics_the_path_is_the_backends_own(stack_factory):
    from ..conftest import clear_demo_requests, demo_requests

    plain = stack_factory('proxy: {passthrough_backend: alpha}\nbackends: [{name: alpha, url: "demo://", models: [m]}]\n')
    clear_demo_requests(plain)
    r = httpx.post(plain.url + "/v1/feedback", json={"request_id": "x", "name": "thumbs_up", "value": True})
    assert r.status_code == 404  # the demo engine's own answer: it has no such endpoint
    assert demo_requests(plain, "alpha")[-1]["path"] == "/v1/feedback"

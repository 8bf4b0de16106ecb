"""The live sample-ratio-mismatch test: its statistics, its sample, and a stack whose arm fails its callers."""

from __future__ import annotations

import hashlib
import math
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from sidecar.config.schema import parse
from sidecar.experiments import srm
from sidecar.routing.assignment import assign

from ..conftest import metered, sidecar_metric

# --------------------------------------------------------------------------- chi-square


def closed_form_sf(x: float, dof: int) -> float:
    """Chi-square survival in closed form: erfc for one degree of freedom, a finite sum for even ones."""
    if dof == 1:
        return math.erfc(math.sqrt(x / 2))
    assert dof % 2 == 0
    half = x / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))


@pytest.mark.parametrize("dof", [1, 2, 4, 6, 10, 30])
@pytest.mark.parametrize("x", [1e-6, 0.3, 1.0, 2.5, 5.0, 11.0, 25.0, 60.0, 150.0])
def test_chi2_sf_matches_closed_forms(x, dof):
    want = closed_form_sf(x, dof)
    assert srm.chi2_sf(x, dof) == pytest.approx(want, rel=1e-10, abs=1e-300)


@pytest.mark.parametrize(("x", "dof", "p"), [
    (3.841458820694124, 1, 0.05), (10.827566170662733, 1, 0.001), (13.815510557964274, 2, 0.001),
    (7.814727903251178, 3, 0.05), (16.26623619623813, 3, 0.001), (18.46682695290317, 4, 0.001),
    (20.515005652432873, 5, 0.001), (29.58829844507442, 10, 0.001),
])
def test_chi2_sf_at_published_critical_values(x, dof, p):
    assert srm.chi2_sf(x, dof) == pytest.approx(p, rel=1e-9)


def test_chi2_sf_edges():
    assert srm.chi2_sf(0, 3) == 1.0 and srm.chi2_sf(-1, 1) == 1.0
    assert srm.chi2_sf(5000, 2) == 0.0 or srm.chi2_sf(5000, 2) < 1e-300
    with pytest.raises(ValueError):
        srm.chi2_sf(1, 0)


def test_p_value_leaves_out_weight_zero_arms_and_says_nothing_on_tiny_samples():
    assert srm.p_value([500, 500, 0], [1, 1, 0]) == pytest.approx(1.0)
    assert srm.p_value([600, 400], [1, 1]) == pytest.approx(closed_form_sf(40.0, 1))
    assert math.isnan(srm.p_value([3, 1], [1, 1]))  # expected 2 per arm: below the approximation's floor
    assert math.isnan(srm.p_value([100], [1]))
    assert math.isnan(srm.p_value([0, 0], [1, 1]))


# --------------------------------------------------------------------------- the sample


def caller(i: int) -> int:
    return int.from_bytes(hashlib.sha256(b"c%d" % i).digest()[:8], "big")


def test_the_sample_is_exactly_the_bottom_k_of_the_windows_distinct_callers():
    s = srm.CallerSample((1, 1, 1), window_s=100, buckets=5, size=50)
    arms = {}
    rnd = random.Random(7)
    for step in range(3000):
        i = rnd.randrange(800)  # repeats: one caller counts once
        arms[caller(i)] = i % 3
        s.add(caller(i), i % 3, now=step * 0.03)  # 90 s: inside one window
    smallest = sorted(arms)[:50]
    want = [0, 0, 0]
    for h in smallest:
        want[arms[h]] += 1
    assert s.counts(now=90) == want and sum(want) == 50
    assert all(len(b.callers) < 50 + 50 // 4 for b in s._buckets)  # the memory bound holds


def test_the_window_rolls_and_forgets_old_callers():
    s = srm.CallerSample((1, 1), window_s=100, buckets=5, size=1000)
    for i in range(100):
        s.add(caller(i), 0, now=10)
    for i in range(100, 150):
        s.add(caller(i), 1, now=95)
    assert s.counts(now=99) == [100, 50]
    assert s.counts(now=125) == [0, 50]  # the bucket of t=10 left the window
    assert s.counts(now=500) == [0, 0]


def test_tracker_starts_afresh_when_the_weights_change():
    text = """
backends: [{name: a, url: "demo://", models: [m]}]
model_experiments:
  - name: e
    model: chat
    variants: [{id: x, model: m, weight: 1}, {id: y, model: m, weight: 1%s}]
"""
    config = {"now": parse(text % "", env={}).config}
    t = srm.Tracker(lambda: config["now"], clock=lambda: 1000.0)
    for i in range(40):
        t.add("e", "x" if i % 2 else "y", f"{caller(i):016x}")
    t.add("e", "nope", "00ff")  # an arm the config does not have
    t.add("other", "x", "00ff")
    t.add("e", "x", "not-hex")
    [(name, arms, counts, p)] = list(t.report())
    assert (name, arms, counts) == ("e", ["x", "y"], [20, 20]) and p == pytest.approx(1.0)
    config["now"] = parse(text % ", paused: true", env={}).config
    [(_, _, counts, p)] = list(t.report())
    assert counts == [0, 0] and math.isnan(p)
    # Callers served after the change count in the new sample, not the one it replaced.
    config["now"] = parse(text % "0", env={}).config  # y: weight 10
    for i in range(6):
        t.add("e", "x" if i % 3 else "y", f"{caller(100 + i):016x}")
    [(_, _, counts, _)] = list(t.report())
    assert counts == [4, 2]


# --------------------------------------------------------------------------- through a stack


class Refusing(BaseHTTPRequestHandler):
    """An upstream that answers every request with 503 and an OpenAI-shaped error."""

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": {"message": "overloaded", "type": "server_error"}}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET = _refuse

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def refusing():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


CALLERS = [f"caller-{i:04d}" for i in range(600)]


@pytest.mark.integration
def test_srm_gauge_stays_high_for_a_fair_split_and_drops_when_an_arm_fails_its_callers(stack_factory, refusing):
    stack = stack_factory(f"""
backends:
  - {{name: pool-a, url: "demo://", models: [m-a]}}
  - {{name: pool-b, url: "demo://", models: [m-b]}}
  - {{name: broken, url: "{refusing}", models: [m-broken]}}
monitor: {{passive_holdout_s: 0}}
model_experiments:
  - name: fair
    model: chat
    variants:
      - {{id: control, model: m-a, weight: 60}}
      - {{id: b, model: m-b, weight: 30}}
      - {{id: c, model: m-a, weight: 10}}
  - name: skewed
    model: chat-2
    variants:
      - {{id: control, model: m-a, weight: 50}}
      - {{id: broken, model: m-broken, weight: 50}}
""")
    client = httpx.Client(base_url=stack.url, timeout=30, limits=httpx.Limits(max_connections=8))

    def ask(args: tuple[str, str]) -> int:
        model, key = args
        r = client.post("/v1/chat/completions", json={"model": model, "messages": []},
                        headers={"authorization": f"Bearer {key}"})
        return r.status_code

    jobs = [(m, k) for k in CALLERS for m in ("chat", "chat-2")]
    jobs += [("chat", k) for k in CALLERS[:20] for _ in range(10)]  # heavy callers count once
    with ThreadPoolExecutor(8) as pool:
        statuses = dict(zip(jobs, pool.map(ask, jobs)))
    broken = [k for k in CALLERS if assign("skewed", [("control", 50), ("broken", 50)], k).variant_id == "broken"]
    assert 200 < len(broken) < 400
    assert {statuses[("chat-2", k)] for k in broken} == {503}  # the arm fails every caller it has
    assert {statuses[("chat", k)] for k in CALLERS} == {200}
    assert metered(stack, timeout=30)

    [text] = stack.metrics_text()
    fair = [sidecar_metric(text, "model_experiment_srm_callers", experiment="fair", variant=v)
            for v in ("control", "b", "c")]
    want = [sum(assign("fair", [("control", 60), ("b", 30), ("c", 10)], k).variant_id == v for k in CALLERS)
            for v in ("control", "b", "c")]
    assert fair == want and sum(fair) == len(CALLERS)  # distinct callers, not requests
    assert sidecar_metric(text, "model_experiment_srm_p_value", experiment="fair") > 0.01
    skewed = [sidecar_metric(text, "model_experiment_srm_callers", experiment="skewed", variant=v)
              for v in ("control", "broken")]
    assert skewed == [len(CALLERS) - len(broken), 0]
    assert sidecar_metric(text, "model_experiment_srm_p_value", experiment="skewed") < 0.001


def test_the_decision_publishes_the_caller_key_digest_for_sticky_assignments_only():
    from sidecar.routing import decide, snapshot
    from sidecar.routing.assignment import caller_key

    from ..unit.test_decide import req

    snap = snapshot.build(parse("""
backends: [{name: a, url: "http://127.0.0.1:1", models: [m-a]}]
model_experiments:
  - name: by-user
    model: chat
    sticky_key: user
    variants: [{id: x, model: m-a, weight: 1}, {id: y, model: m-a, weight: 1}]
""", env={}).config)
    sticky = decide(snap, req("/v1/chat/completions", {"model": "chat", "user": "alice", "messages": []}))
    md = sticky.metadata()
    assert md["assignment"] == "sticky"
    assert md["caller"] == caller_key("by-user", "alice", None, 0)[0][:8].hex()
    assert "alice" not in orjson_dumps(md)
    random_draw = decide(snap, req("/v1/chat/completions", {"model": "chat", "messages": []}))
    assert random_draw.metadata()["assignment"] == "random" and "caller" not in random_draw.metadata()


def orjson_dumps(value) -> str:
    import orjson

    return orjson.dumps(value).decode()

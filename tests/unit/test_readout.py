"""The experiment readout from usage records and from metric samples: figures, verdicts, the SRM gate, the command."""

from __future__ import annotations

import json
import random

import pytest

from sidecar.commands.main import main
from sidecar.config.schema import parse
from sidecar.experiments import readout, records, samples

CONFIG = """
backends:
  - {name: pool-a, url: "http://127.0.0.1:1", models: [model-a]}
  - {name: pool-b, url: "http://127.0.0.1:2", models: [model-b]}
model_metadata:
  - {id: model-a, pricing: {input: 1.0, output: 2.0}}
  - {id: model-b, pricing: {input: 1.0, output: 2.0}, backend_pricing: {pool-b: {input: 3.0, output: 4.0}}}
feedback_metrics:
  - {name: thumbs_up, type: boolean, optimize: max}
  - {name: score, type: float, optimize: max}
model_experiments:
  - name: split
    model: chat
    variants:
      - {id: control, model: model-a, weight: 50}
      - {id: candidate, model: model-b, weight: 50}
"""


@pytest.fixture
def cfg():
    return parse(CONFIG).config


def request(i: int, variant: str, *, status: int = 200, latency: float = 10.0, caller: str | None = None,
            kind: str = "routed") -> dict:
    model, backend = ("model-a", "pool-a") if variant == "control" else ("model-b", "pool-b")
    return {"request_id": f"r{i}", "kind": kind, "time": "2025-12-01T17:53:30.217+00:00", "experiment_id": "split", "experiment_variant_id": variant,
            "upstream_model": model, "backend": backend, "status": status, "duration_to_headers_ms": latency,
            "prompt_tokens": 10, "completion_tokens": 20, "caller": caller or f"{i:016x}", "assignment": "sticky"}


def feedback(i: int, variant: str, name: str, value) -> dict:
    return {"request_id": f"r{i}", "kind": "feedback", "experiment_id": "split", "experiment_variant_id": variant,
            "name": name, "value": value}


def balanced(n: int, thumbs_candidate: float, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        variant = "control" if i % 2 == 0 else "candidate"
        rows.append({**request(i, variant, latency=rng.gauss(100 if variant == "control" else 80, 10)),
                     "completion_tokens": rng.randint(10, 30)})
        p = 0.5 if variant == "control" else thumbs_candidate
        rows.append(feedback(i, variant, "thumbs_up", rng.random() < p))
    return rows


def test_figures_from_records(cfg):
    e = cfg.model_experiments[0]
    rows = [request(0, "control", status=503, caller="aa"), request(1, "control", latency=30.0, caller="aa"),
            request(2, "candidate", latency=7.0), request(3, "candidate", kind="refusal", status=404),
            {**feedback(0, "control", "score", 4.0), "revision": 2},  # a replacement written before the value
            {**feedback(0, "control", "score", 2.0), "revision": 1},  # it replaced (Envoy threads flush apart)
            feedback(2, "candidate", "thumbs_up", True), feedback(2, "candidate", "unknown", 1),
            {"kind": "routed", "experiment_id": "other", "experiment_variant_id": "control"}]
    arms, p = records.aggregate(rows, cfg, e)
    c, t = arms["control"], arms["candidate"]
    assert (c.requests, c.callers, t.requests, t.callers) == (2, 1, 2, 2)
    assert c.metrics["error_rate"].mean == 0.5 and t.metrics["error_rate"].mean == 0.0
    assert c.metrics["latency_ms"].n == 2 and t.metrics["latency_ms"].n == 1  # a refusal served nothing
    assert c.metrics["tokens_per_request"].mean == 30
    assert c.metrics["tokens_per_request"].variance == 0.0  # constant: no spread, not rounding noise
    assert c.metrics["cost_per_request"].mean == pytest.approx((10 * 1 + 20 * 2) / 1e6)
    assert t.metrics["cost_per_request"].mean == pytest.approx((10 * 3 + 20 * 4) / 1e6)  # the backend's price
    assert c.metrics["feedback:score"].n == 1 and c.metrics["feedback:score"].mean == 4.0
    assert t.metrics["feedback:thumbs_up"].mean == 1.0 and "feedback:unknown" not in t.metrics
    assert p is None  # too few callers to test


def test_a_clear_winner_and_a_tie(cfg):
    rows = balanced(4000, 0.6, random.Random(1))
    report = readout.build(cfg, cfg.model_experiments[0], *records.aggregate(rows, cfg, cfg.model_experiments[0]),
                           "usage_records")
    assert report["srm"]["trusted"] and report["control"] == "control"
    m = report["comparisons"][0]["metrics"]
    assert m["feedback:thumbs_up"]["verdict"] == "better" and m["feedback:thumbs_up"]["low"] > 0
    assert m["latency_ms"]["verdict"] == "better" and m["latency_ms"]["high"] < 0  # lower is better
    assert m["error_rate"]["verdict"] == "not yet distinguishable"  # no errors anywhere: no spread
    assert m["tokens_per_request"]["verdict"] == "not yet distinguishable"  # same token counts on both arms
    assert m["cost_per_request"]["verdict"] == "worse" and m["cost_per_request"]["low"] > 0
    text = readout.render(report)
    assert "feedback:thumbs_up" in text and "better" in text and "CANNOT BE TRUSTED" not in text


def test_a_sample_ratio_mismatch_voids_the_verdicts(cfg):
    rng = random.Random(2)
    rows = balanced(4000, 0.6, rng)
    rows += [request(10_000 + i, "candidate") for i in range(600)]  # the candidate gets callers it should not
    report = readout.build(cfg, cfg.model_experiments[0], *records.aggregate(rows, cfg, cfg.model_experiments[0]),
                           "usage_records")
    assert not report["srm"]["trusted"] and report["srm"]["p_value"] < 0.001
    assert "sample-ratio mismatch" in report["srm"]["reason"]
    assert {c["verdict"] for c in report["comparisons"][0]["metrics"].values()} == {readout.UNTRUSTED}
    assert "COMPARISON CANNOT BE TRUSTED" in readout.render(report)


def test_the_command(cfg, tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text(CONFIG)
    usage = tmp_path / "usage.jsonl"
    usage.write_text("".join(json.dumps(r) + "\n" for r in balanced(2000, 0.7, random.Random(3))) + '{"torn')
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage),
                 "--experiment", "split", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["experiment"] == "split" and doc["arms"][0]["requests"] == 1000
    assert doc["comparisons"][0]["metrics"]["feedback:thumbs_up"]["verdict"] == "better"
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage)]) == 0
    assert "candidate vs control" in capsys.readouterr().out
    # Records carry their time: --since keeps the later ones (here 2026-01-01 on, of which there are none).
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage), "--json",
                 "--experiment", "split", "--since", "1767225600"]) == 0
    assert [a["requests"] for a in json.loads(capsys.readouterr().out)["arms"]] == [0, 0]
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage), "--json",
                 "--experiment", "split", "--since", "2020-01-01T00:00:00Z"]) == 0
    assert json.loads(capsys.readouterr().out)["arms"][0]["requests"] == 1000
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage), "--since", "soon"]) == 1
    assert "--since must be" in capsys.readouterr().err
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(usage),
                 "--experiment", "nope"]) == 1
    assert "no experiment named 'nope'" in capsys.readouterr().err
    assert main(["experiments", "report", "--config", str(conf), "--usage-records", str(tmp_path / "missing")]) == 1
    assert "cannot read usage records" in capsys.readouterr().err
    assert main(["experiments", "report", "--config", str(conf), "--prometheus", "http://127.0.0.1:1",
                 "--window", "soon"]) == 1
    assert "--window" in capsys.readouterr().err


def test_figures_from_metric_samples(cfg):
    e = cfg.model_experiments[0]

    def arm(v: str, errors: int, thumbs: int, retracted: int) -> list[samples.Sample]:
        out: list[samples.Sample] = [
            (samples.REQUESTS, {"variant": v, "status": "success"}, 1000 - errors),
            (samples.REQUESTS, {"variant": v, "status": "server_error"}, errors),
            (samples.TOKENS, {"variant": v, "kind": "prompt"}, 10_000), (samples.TOKENS, {"variant": v, "kind": "completion"}, 20_000),
            (samples.FEEDBACK, {"variant": v, "name": "thumbs_up"}, 800),
            (samples.FEEDBACK_VALUE, {"variant": v, "name": "thumbs_up"}, thumbs + retracted),
            (samples.FEEDBACK_RETRACTED, {"variant": v, "name": "thumbs_up"}, retracted),
            (samples.SRM_CALLERS, {"variant": v}, 400),
            (samples.CACHE_HITS, {"variant": v}, 10),
        ]
        for le, count in (("0.1", 500), ("0.2", 900), ("+Inf", 1000)):
            out.append((samples.DURATION + "_bucket", {"variant": v, "le": le}, count))
        out.append((samples.DURATION + "_sum", {"variant": v}, 130.0))
        return out

    rows = arm("control", 10, 400, 0) + arm("candidate", 90, 560, 50) + [(samples.SRM_P, {}, 0.4)]
    arms, p = samples.arms_of(cfg, e, rows)
    c, t = arms["control"], arms["candidate"]
    assert p == 0.4 and c.requests == 1000 and c.callers == 400
    assert c.metrics["error_rate"].mean == 0.01 and t.metrics["error_rate"].mean == 0.09
    assert c.latency_p50_ms == pytest.approx(100.0) and c.latency_p95_ms == pytest.approx(200.0)
    assert c.metrics["latency_ms"].mean == pytest.approx(130.0)
    assert t.metrics["feedback:thumbs_up"].mean == pytest.approx(560 / 800)  # net of the retracted values
    assert c.means_only["tokens_per_request"] == pytest.approx(30_000 / 980)  # cache hits ran no model
    report = readout.build(cfg, e, arms, p, "prometheus")
    m = report["comparisons"][0]["metrics"]
    assert m["error_rate"]["verdict"] == "worse" and m["feedback:thumbs_up"]["verdict"] == "better"
    assert m["tokens_per_request"]["low"] is None and "no interval" in m["tokens_per_request"]["note"]


@pytest.mark.parametrize(("extra", "fragment"), [
    ("feedback_metrics: [{name: a, type: stars}]", "feedback_metrics[0].type"),
    ("feedback_metrics: [{name: a, type: boolean, optimize: up}]", "feedback_metrics[0].optimize"),
    ("feedback_metrics: [{name: a, type: boolean, weight: 2}]", "feedback_metrics[0].weight"),
    ("feedback_metrics: [{name: a, type: boolean}, {name: a, type: float}]", "unique"),
    ("feedback_metrics: [{name: 'a b', type: boolean}]", "feedback_metrics[0].name"),
    ("feedback: {ttl_s: 1}", "feedback.ttl_s"),
    ("feedback: {max_entries: 5}", "feedback.max_entries"),
])
def test_feedback_config_is_checked(extra, fragment):
    from sidecar.config.schema import ConfigError

    with pytest.raises(ConfigError) as err:
        parse(CONFIG + extra + "\n")
    assert any(fragment in e for e in err.value.errors), err.value.errors


def test_the_registry_source_reads_this_process_counters(cfg):
    import asyncio

    from sidecar.experiments.feedback import Feedback
    from sidecar.serve.runtime import prime_metrics

    prime_metrics(cfg)
    e = cfg.model_experiments[0]
    before, _ = samples.arms_of(cfg, e, samples.registry_samples())
    fb = Feedback()

    async def give() -> None:
        for i, variant in enumerate(["control", "candidate", "candidate"]):
            fb.record(cfg, f"reg-{i}", lambda: "", "split", variant)
            reply, _ = await fb.handle(cfg, "POST", "", json.dumps(
                {"request_id": f"reg-{i}", "name": "thumbs_up", "value": variant == "candidate"}).encode())
            assert reply.status == 200

    asyncio.run(give())
    after, _ = samples.arms_of(cfg, e, samples.registry_samples())
    key = "feedback:thumbs_up"
    assert after["candidate"].metrics[key].n - before["candidate"].metrics[key].n == 2
    assert after["candidate"].metrics[key].total - before["candidate"].metrics[key].total == 2
    assert after["control"].metrics[key].n - before["control"].metrics[key].n == 1
    report = samples.report_from_registry(cfg, e)
    assert report["source"] == "metrics" and report["arms"][1]["variant"] == "candidate"


def test_a_prometheus_that_answers_nonsense_is_an_error_not_a_traceback(cfg, tmp_path, capsys):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = iter([b"not json", b'{"status": "error", "error": "bad query"}',
                    b'{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": []}]}}'])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = next(answers)
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conf = tmp_path / "c.yaml"
    conf.write_text(CONFIG)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for want in ("did not answer", "refused", "malformed sample"):
            assert main(["experiments", "report", "--config", str(conf), "--prometheus", url]) == 1
            assert want in capsys.readouterr().err
    finally:
        server.shutdown()


def test_a_shadow_arm_is_reported_beside_the_live_arms_from_its_copies():
    cfg = parse(CONFIG.replace(
        "      - {id: candidate, model: model-b, weight: 50}\n",
        "      - {id: candidate, model: model-b, weight: 50}\n      - {id: probe, model: model-b, shadow: {share: 0.5}}\n",
    )).config
    e = cfg.model_experiments[0]
    rows = [request(i, "control", latency=100.0) for i in range(4)]
    copy = {"kind": "shadow", "shadow": True, "experiment_id": "split", "experiment_variant_id": "probe",
            "time": "2025-12-01T17:53:30.217+00:00", "upstream_model": "model-b", "backend": "pool-b",
            "prompt_tokens": 10, "completion_tokens": 5}
    rows += [{**copy, "request_id": "r0", "status": 200, "duration_to_headers_ms": 40.0},
             {**copy, "request_id": "r1", "status": 502, "duration_to_headers_ms": 60.0}]
    arms, _ = records.aggregate(rows, cfg, e)
    probe = arms["probe"]
    assert probe.requests == 2 and probe.metrics["error_rate"].mean == 0.5
    assert probe.metrics["latency_ms"].mean == 50.0 and probe.metrics["tokens_per_request"].mean == 15
    assert arms["control"].requests == 4  # a copy is no request of a live arm
    report = readout.build(cfg, e, arms, None, "usage_records")
    assert [(a["variant"], a["role"]) for a in report["arms"]] == [
        ("control", "control"), ("candidate", "treatment"), ("probe", "shadow")]
    shadow = [c for c in report["comparisons"] if c.get("shadow")]
    assert [c["variant"] for c in shadow] == ["probe"]
    assert shadow[0]["metrics"]["latency_ms"]["difference"] == -50.0
    text = readout.render(report)
    assert "probe (shadow)" in text and "probe vs control (shadow copies" in text

"""deploy/observability: the rules pass promtool, the dashboard asks only for what exists, and a real
Prometheus scraping a running stack evaluates every recording rule into per-arm series."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import metrics
from sidecar.config.schema import parse
from sidecar.deploy import k8s, k8s_monitoring
from sidecar.experiments import srm
from sidecar.serve.runtime import prime_metrics
from tests.support.servers import PrometheusServer

from ..conftest import metered
from .test_srm import refusing  # noqa: F401  (the fixture: an upstream answering 503)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
RULES = DEPLOY / "model-router.rules.yml"
DASHBOARD = DEPLOY / "model-router.dashboard.json"
RULE_TESTS = DEPLOY / "model-router.rules.test.yml"

# Scraper-made series.
PROMETHEUS_OWN = {"up"}

ALL_FEATURES = """
backends:
  - {name: a, url: "demo://", models: [m-a, m-b]}
proxy: {variant_suffixes: {enabled: true}}
fallback_chains: {m-b: [m-a]}
cache: {}
feedback_metrics: [{name: thumbs_up, type: boolean}, {name: rating, type: float}]
model_experiments:
  - name: e
    model: chat
    hide_variant_models: true
    fallback: cross_variant
    variants: [{id: x, model: m-a, weight: 1}, {id: y, model: m-b, weight: 1}, {id: z, model: m-b, shadow: {share: 0.1}}]
"""


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def exported() -> set[str]:
    """Every sample name the sidecar's /metrics shows once a config with every feature has loaded."""
    cfg = parse(ALL_FEATURES, env={}).config
    prime_metrics(cfg)
    names = {s.name for f in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode())
             for s in f.samples}
    names |= {f.name for f in srm.SrmCollector(srm.Tracker(lambda: cfg)).collect()}
    return names


_FUNCTIONS = {
    "sum", "min", "max", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right", "and",
    "or", "unless", "rate", "increase", "irate", "histogram_quantile", "label_values", "bool", "offset", "absent",
}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label matchers, ranges, groupings and strings removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,[^)]*\)", r" \1 ", text)
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {t for t in tokens if t not in _FUNCTIONS and not re.fullmatch(r"e\d*|Inf|NaN", t)}


def test_promtool_checks_the_rules():
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run `python -m tests.support.servers`")
    return promtool


def test_promtool_rule_unit_tests_pass():
    """SRM, error rate against control across two sidecars, the small-sample
    guard, reload failure and sidecar down, each with its input series."""
    done = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=DEPLOY, capture_output=True, text=True)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    names = [t["name"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]]
    assert len(names) == 6
    alerted = {a["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for a in t["alert_rule_test"]}
    assert alerted == {r["alert"] for r in rules() if "alert" in r}


def test_the_rule_tests_fail_when_an_alert_stops_firing(tmp_path):
    """The unit tests can fail: a sidecar-down rule on another job breaks them."""
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(
        f'up{{job="{k8s_monitoring.SCRAPE_JOB}"}}', 'up{job="model-router"}'))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    done = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0 and "ModelRouterSidecarDown" in done.stdout + done.stderr


def test_rules_dashboard_and_service_monitor_agree_on_the_scrape_job():
    """Every job the rules and the dashboard name is the one the generated
    ServiceMonitor gives the sidecars' series."""
    texts = [RULES.read_text(), DASHBOARD.read_text()]
    jobs = {j for t in texts for j in re.findall(r'job\s*=\s*\\?"([^"\\]+)', t)}
    assert jobs == {k8s_monitoring.SCRAPE_JOB}
    monitor = k8s_monitoring.service_monitor(k8s.Options())
    (endpoint,) = monitor["spec"]["endpoints"]
    assert {"action": "replace", "targetLabel": "job", "replacement": k8s_monitoring.SCRAPE_JOB} in endpoint["relabelings"]
    # The PrometheusRule is the rules file's groups, unchanged.
    assert k8s_monitoring.prometheus_rule(k8s.Options())["spec"] == yaml.safe_load(RULES.read_text())


def test_importing_the_dashboard_asks_for_its_data_source():
    """Grafana's import dialog prompts for every ``__inputs`` entry and puts
    the choice wherever ``${NAME}`` appears; every panel reads the data source
    variable that choice sets, and every panel type is declared."""
    text = DASHBOARD.read_text()
    dash = json.loads(text)
    (ds_input,) = dash["__inputs"]
    assert (ds_input["type"], ds_input["pluginId"]) == ("datasource", "prometheus")
    variable = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert variable["current"]["value"] == "${%s}" % ds_input["name"]
    targets = [p for p in dash["panels"] if p["type"] != "row"]
    assert targets and all(p["datasource"]["uid"] == "${%s}" % variable["name"] for p in targets)
    declared = {r["id"] for r in dash["__requires"] if r["type"] == "panel"}
    assert {p["type"] for p in targets} <= declared


def test_rules_read_only_exported_metrics_and_earlier_records():
    known = exported() | PROMETHEUS_OWN
    for rule in rules():
        assert metric_names(rule["expr"]) <= known | recorded(), rule
    assert {r["alert"] for r in rules() if "alert" in r} == {
        "ModelExperimentSampleRatioMismatch", "ModelExperimentArmErrorRateAboveControl",
        "ModelRouterConfigReloadFailed", "ModelRouterSidecarDown", "ModelRouterSidecarsNotScraped",
    }


def test_every_dashboard_expression_reads_exported_metrics_or_recorded_rules():
    dash = json.loads(DASHBOARD.read_text())
    known = exported() | recorded() | PROMETHEUS_OWN
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 18
    used: set[str] = set()
    for e in exprs:
        names = metric_names(e)
        assert names, e
        assert names <= known, (e, names - known)
        used |= names
    # Every panel the dashboard promises is there.
    for needed in ("model_experiment:requests:rate5m", "model_experiment:error_rate:ratio_rate5m",
                   "model_experiment:request_duration_seconds:p95_5m", "model_experiment_variant_paused",
                   "model_experiment:random_assignment:ratio_rate5m", "model_experiment_reserved_refusals_total",
                   "continuum_model_variant_requests_total", "model_router_fallbacks_total",
                   "model_router_cache_hits_total", "model_experiment:srm_p_value:min",
                   "model_experiment_shadow_requests_total", "model_experiment_shadow_copies_total",
                   "model_experiment_shadow_request_duration_seconds_bucket",
                   "model_experiment_shadow_time_to_first_token_seconds_bucket", "model_experiment_shadow_tokens_total"):
        assert needed in used, needed
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert metric_names('sum by (a) (rate(x_total{k="v"}[5m])) / on (a) group_left y') == {"x_total", "y"}


# --------------------------------------------------------------------------- a real Prometheus

STACK = """
backends:
  - {name: pool-a, url: "demo://", models: [m-a]}
  - {name: pool-b, url: "demo://", models: [m-b]}
  - {name: broken, url: "%s", models: [m-broken]}
monitor: {passive_holdout_s: 0}
fallback_chains: {m-b: [m-a]}
model_experiments:
  - name: split
    model: chat
    fallback: cross_variant
    variants:
      - {id: control, model: m-a, weight: 2}
      - {id: treatment, model: m-b, weight: 1}
      - {id: broken, model: m-broken, weight: 1}
"""
ARMS = {"control", "treatment", "broken"}


def wait_for(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.integration
def test_prometheus_scrapes_the_stack_and_every_recording_rule_yields_per_arm_series(
    stack_factory, refusing, tmp_path,  # noqa: F811
):
    stack = stack_factory(STACK % refusing)
    prom = PrometheusServer(tmp_path / "prometheus", targets=stack.sidecar_admin, rule_files=[RULES]).start()
    try:
        wait_for("the first scrape", lambda: [s for s in prom.query(f'up{{job="{k8s_monitoring.SCRAPE_JOB}"}}')
                                              if s["value"][1] == "1"])
        assert {g["name"] for g in prom.get("/api/v1/rules")["data"]["groups"]} == {
            "model-router.experiments", "model-router.alerts", "model-router.feedback"}
        wait_for("a scrape with the arms' series", lambda: prom.query("model_experiment_requests_total"))
        client = httpx.Client(base_url=stack.url, timeout=30)

        def ask(i: int) -> int:
            headers = {"authorization": f"Bearer caller-{i}"} if i % 5 else {}  # every fifth: random
            return client.post("/v1/chat/completions", json={"model": "chat", "messages": []},
                               headers=headers).status_code

        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(ask, range(200)))
        assert set(codes) == {200, 503}
        assert metered(stack, timeout=30)

        def arms_of(name: str) -> dict[str, float]:
            return {s["metric"]["variant"]: float(s["value"][1]) for s in prom.query(name)
                    if s["metric"].get("experiment") == "split"}

        def scraped() -> float:
            got = prom.query('sum(model_experiment_requests_total{experiment="split"})')
            return float(got[0]["value"][1]) if got else 0.0

        wait_for("a scrape that counts every request", lambda: scraped() == len(codes))
        # The broken arm fails every one of its callers.
        wait_for("the error rates", lambda: arms_of("model_experiment:error_rate:ratio_rate5m").get("broken") == 1.0)
        wait_for("durations on every arm", lambda: set(arms_of("model_experiment:request_duration_seconds:p95_5m")) == ARMS
                 and all(v > 0 for v in arms_of("model_experiment:request_duration_seconds:p95_5m").values()))
        for rule in sorted(recorded()):
            if rule.startswith("model_experiment_feedback:"):
                continue  # tests/integration/test_feedback.py evaluates these on a stack that gets feedback
            if rule == "model_experiment:srm_p_value:min":
                series = prom.query(rule)
                assert [s["metric"] for s in series] == [{"__name__": rule, "experiment": "split"}], rule
                continue
            got = wait_for(rule, lambda rule=rule: arms_of(rule))
            want = {"treatment"} if rule == "model_experiment:fallbacks:rate5m" else ARMS
            assert set(got) == want, (rule, got)
        rates = arms_of("model_experiment:error_rate:ratio_rate5m")
        assert rates["control"] == 0.0 and rates["treatment"] == 0.0
        delta = arms_of("model_experiment:error_rate_delta_vs_control:ratio_rate5m")
        assert delta == {"control": 0.0, "treatment": 0.0, "broken": 1.0}
        random_share = arms_of("model_experiment:random_assignment:ratio_rate5m")
        assert 0 < random_share["control"] < 1 and all(0 <= v <= 1 for v in random_share.values())
        p95 = arms_of("model_experiment:request_duration_seconds:p95_5m")
        assert all(v > 0 for v in p95.values()), p95
        assert arms_of("model_experiment:requests:rate5m")["control"] > 0
    finally:
        prom.stop()


@pytest.mark.integration
def test_the_ext_proc_port_answers_a_grpc_health_check_serving(stack_factory):
    stack = stack_factory('backends: [{name: a, url: "demo://", models: [m]}]\n')
    with grpc.insecure_channel(stack.sidecar_grpc[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

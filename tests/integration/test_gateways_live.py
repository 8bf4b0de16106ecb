"""The gateway recipes, run. Envoy Gateway: an Envoy configured the way its
translator configures one from the generated resources (HTTPRoute rules as
routes, the EnvoyExtensionPolicy's ext_proc filter disabled on the listener
and enabled on the LLM route's rules, the ClientTrafficPolicy's early header
removal, the EnvoyProxy's access log with its CEL match). Istio: the gateway
built from the HTTPRoute, patched as istiod applies the EnvoyFilter. Each in
front of the real sidecar and demo engines: per-arm metrics move, another
app's route never meets the sidecar (Envoy Gateway), and a dead sidecar
gives 503."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from sidecar.config import schema as config_mod
from sidecar.deploy import envoy as envoyconf
from sidecar.deploy import k8s, k8s_gateways
from sidecar.devstack.stack import envoy_binary, free_port
from sidecar.payload.json_budget import MAX_VALUES, REFUSED_BYTES_PER_SECOND
from sidecar.routing import assignment
from sidecar.serve import grpc_auth

from ..conftest import demo_requests, metered, sidecar_metric
from .test_bad_input import check_error
from .test_k8s import TEMPLATE, _apply_envoy_filter, _eg_ext_proc, httproute_routes

pytestmark = pytest.mark.integration

_T = "type.googleapis.com/"
OTHER_APP = "/other-app"


def _twin(boot: dict, name: str) -> None:
    sidecar = next(c for c in boot["static_resources"]["clusters"] if c["name"] == envoyconf.RESERVED_BACKEND_NAME)
    twin = copy.deepcopy(sidecar)
    twin["name"] = twin["load_assignment"]["cluster_name"] = name
    boot["static_resources"]["clusters"].append(twin)


def eg_access_logs(envoy_proxy: dict, cluster: str) -> list[dict]:
    """EnvoyProxy ``telemetry.accessLog`` as Envoy Gateway's translator writes
    the connection manager's access logs: an ALS sink becomes the HTTP gRPC
    access log (log name, the cluster, V3, the extra request headers); each
    ``matches`` entry a CEL extension filter."""
    out = []
    for setting in envoy_proxy["spec"]["telemetry"]["accessLog"]["settings"]:
        for sink in setting["sinks"]:
            if sink["type"] == "ALS":
                als = sink["als"]
                log: dict = {"name": "envoy.access_loggers.http_grpc", "typed_config": {
                    "@type": _T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                    "common_config": {"log_name": als["logName"], "transport_api_version": "V3",
                                      "grpc_service": {"envoy_grpc": {"cluster_name": cluster}}},
                    "additional_request_headers_to_log": als["http"]["requestHeaders"]}}
            else:
                log = {"name": "envoy.access_loggers.file", "typed_config": {
                    "@type": _T + "envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": sink["file"]["path"]}}
            (expr,) = setting.get("matches", [None])
            if expr:
                log["filter"] = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
                    "@type": _T + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter", "expression": expr}}}
            out.append(log)
    return out


def eg_bootstrap(stack_boot: dict, files: dict[str, list[dict]], listen: str, admin: str) -> dict:
    """The stack's clusters (backends, sidecar) under a listener built from
    the Envoy Gateway resources."""
    route = next(d for d in files["routes.yaml"] if d["kind"] == "HTTPRoute")
    policy, proxy, client = (next(d for d in files["envoy-gateway.yaml"] if d["kind"] == k)
                             for k in ("EnvoyExtensionPolicy", "EnvoyProxy", "ClientTrafficPolicy"))
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                             "name": route["metadata"]["name"]}]
    boot = copy.deepcopy(stack_boot)
    boot["admin"]["address"] = envoyconf._addr(admin)
    ns, name = policy["metadata"]["namespace"], policy["metadata"]["name"]
    ext_proc_name = f"envoyextensionpolicy/{ns}/{name}/extproc/0"
    _twin(boot, ext_proc_name)
    _twin(boot, "accesslog/als/0")
    ext_proc = _eg_ext_proc(policy["spec"]["extProc"][0], ext_proc_name)
    filter_name = f"envoy.filters.http.ext_proc/{ext_proc_name}"
    ext_proc["name"], ext_proc["disabled"] = filter_name, True
    services = {r.service: b for b, r in k8s.backend_refs(config_mod.load(TEMPLATE).config, {}).items()}
    routes = httproute_routes(route, services)
    rname = route["metadata"]["name"]
    for i, r in enumerate(routes):  # the policy's target: every rule of the LLM route
        r["name"] = f"httproute/{route['metadata']['namespace']}/{rname}/rule/{i}/match/0/*"
        r["typed_per_filter_config"] = {filter_name: {"@type": _T + "envoy.config.route.v3.FilterConfig", "config": {}}}
    other = {"name": "httproute/shop/orders/rule/0/match/0/*", "match": {"prefix": OTHER_APP},
             "direct_response": {"status": 200, "body": {"inline_string": "orders"}}}
    listener = boot["static_resources"]["listeners"][0]
    listener["address"] = envoyconf._addr(listen)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    router = hcm["http_filters"][-1]
    router["typed_config"] = {"@type": router["typed_config"]["@type"]}
    hcm["http_filters"] = [ext_proc, router]
    hcm.pop("local_reply_config", None)
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [other, *routes]
    hcm["early_header_mutation_extensions"] = [{
        "name": "envoy.http.early_header_mutation.header_mutation", "typed_config": {
            "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": h} for h in client["spec"]["headers"]["earlyRequestHeaders"]["remove"]]}}]
    hcm["access_log"] = eg_access_logs(proxy, "accesslog/als/0")
    return boot


def _arms(stack) -> dict[str, float]:
    text = stack.metrics_text()
    return {arm: sum(sidecar_metric(t, "model_experiment_requests_total", experiment="chat-ab", variant=arm)
                     for t in text) for arm in ("control", "candidate")}


def _entries(stack) -> float:
    return sum(sidecar_metric(t, "model_router_access_log_entries_total") for t in stack.metrics_text())


@contextlib.contextmanager
def running_envoy(boot: dict, tmp_path: Path):
    """The real Envoy on ``boot``, ready, stopped afterwards."""
    (tmp_path / "envoy.yaml").write_text(envoyconf.render(boot))
    log = (tmp_path / "envoy.log").open("w")
    proc = subprocess.Popen([envoy_binary(), "-c", str(tmp_path / "envoy.yaml"), "--use-dynamic-base-id",
                             "--disable-hot-restart", "--concurrency", "1", "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    admin = f"{boot['admin']['address']['socket_address']['address']}:{boot['admin']['address']['socket_address']['port_value']}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://{admin}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "envoy.log").read_text()
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def meters_each_arm_and_fails_closed(stack, listen: str, other_app: bool) -> None:
    """Callers through ``listen`` move each arm's counter by exactly the
    callers the published hash gives it (a client's routing header is
    stripped); another app's route, when there is one, adds no entry; with
    the sidecar stopped the answer is 503."""
    assert metered(stack, timeout=30)
    before, entries = _arms(stack), _entries(stack)
    arms = [("control", 90), ("candidate", 10)]
    callers = {f"caller-{i}": assignment.assign("chat-ab", arms, f"caller-{i}").variant_id for i in range(40)}
    want = {arm: sum(1 for a in callers.values() if a == arm) for arm, _ in arms}
    assert all(want.values())
    with httpx.Client(base_url=f"http://{listen}", timeout=30) as client:
        for caller, arm in callers.items():
            r = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {caller}",
                                                             envoyconf.BACKEND_HEADER: "pool-b",
                                                             "x-model-router-limit-model": "spoof"},
                            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == ("llama-3.1-8b" if arm == "control" else "qwen3-8b")
        # No router header a client sent reached an engine.
        seen = demo_requests(stack, "pool-a") + demo_requests(stack, "pool-b")
        assert seen and not [h for r in seen for h in r["headers"] if h.startswith("x-model-router-")]
        if other_app:
            assert client.get(OTHER_APP).text == "orders"
        deadline = time.monotonic() + 60
        while _arms(stack) != {a: before[a] + want[a] for a in want}:
            assert time.monotonic() < deadline, (before, _arms(stack), want)
            time.sleep(0.2)
        assert _entries(stack) == entries + len(callers)
        stack.stop_sidecar()
        r = client.post("/v1/chat/completions", headers={"authorization": "Bearer caller-1"},
                        json={"model": "chat", "messages": []})
        assert r.status_code == 503


def authenticated(boot: dict, secret: str | None) -> dict:
    """The gateway's calls to the sidecar carry the test stack's gRPC secret, as
    a deployment's would (every gRPC call in these bootstraps is the sidecar's)."""
    def walk(node) -> None:
        if isinstance(node, dict):
            if "envoy_grpc" in node and secret is not None:
                kept = [m for m in node.get("initial_metadata", []) if m["key"] != grpc_auth.METADATA_KEY]
                node["initial_metadata"] = [*kept, {"key": grpc_auth.METADATA_KEY, "value": secret}]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(boot)
    return boot


def test_an_envoy_gateway_proxy_meters_per_arm_and_fails_closed_with_503(stack_factory, tmp_path: Path):
    stack = stack_factory(Path(TEMPLATE).read_text())
    files = k8s.manifests(config_mod.load(TEMPLATE).config, "", k8s.Options())
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    boot = eg_bootstrap(yaml.safe_load((stack.workdir / "envoy.yaml").read_text()), files, listen, admin)
    with running_envoy(authenticated(boot, stack.grpc_secret), tmp_path):
        meters_each_arm_and_fails_closed(stack, listen, other_app=True)


def test_under_envoy_gateway_a_body_past_the_budget_is_refused_within_the_message_timeout(stack_factory,
                                                                                          tmp_path: Path):
    """Envoy Gateway cannot let the sidecar ask for more time, and its streams
    do not claim it can: a refusal held for its size (here about 3.3 s) would
    outlast ``messageTimeout`` (3 s) and end as Envoy's 504, or go on to the
    engine with ``failOpen``. It is held within half the timeout, then refused."""
    text = Path(TEMPLATE).read_text().replace("message_timeout_ms: 5000", "message_timeout_ms: 3000", 1)
    assert "message_timeout_ms: 3000" in text
    stack = stack_factory(text)
    files = k8s.manifests(config_mod.parse(text, env={}).config, "", k8s.Options())
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    boot = eg_bootstrap(yaml.safe_load((stack.workdir / "envoy.yaml").read_text()), files, listen, admin)
    headers = {"authorization": "Bearer caller-1", "content-type": "application/json"}
    values = b'{"model":"chat","x":[' + b",".join([b"[]"] * (REFUSED_BYTES_PER_SECOND * 11 // 10)) + b"]}"
    assert len(values) / REFUSED_BYTES_PER_SECOND > 3.0  # its hold, where Envoy can be asked to wait
    with running_envoy(authenticated(boot, stack.grpc_secret), tmp_path), \
            httpx.Client(base_url=f"http://{listen}", timeout=60) as client:
        # The worker's counting process starts on its first big body: not inside the measured request.
        warm = client.post("/v1/chat/completions", headers=headers, content=b'{"model":"chat","x":['
                           + b",".join([b"[]"] * (MAX_VALUES + 1)) + b"]}")
        assert warm.status_code == 400, warm.text
        r = client.post("/v1/chat/completions", headers=headers, content=values)
    doc = check_error(r.status_code, r.headers, r.content, "openai")
    assert r.status_code == 400 and f"more than {MAX_VALUES} JSON values" in doc["error"]["message"], doc


def test_an_istio_gateway_patched_by_the_envoy_filter_meters_per_arm_and_fails_closed(stack_factory, tmp_path: Path):
    """The gateway Istio builds for the HTTPRoute (routes from its rules, a
    plain router, no access log), patched as istiod applies the EnvoyFilter."""
    stack = stack_factory(Path(TEMPLATE).read_text())
    files = k8s.manifests(config_mod.load(TEMPLATE).config, "", k8s.Options())
    boot = copy.deepcopy(yaml.safe_load((stack.workdir / "envoy.yaml").read_text()))
    listen, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    boot["admin"]["address"] = envoyconf._addr(admin)
    listener = boot["static_resources"]["listeners"][0]
    listener["address"] = envoyconf._addr(listen)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    router = hcm["http_filters"][-1]
    router["typed_config"] = {"@type": router["typed_config"]["@type"]}
    hcm["http_filters"] = [router]
    for key in ("early_header_mutation_extensions", "access_log", "local_reply_config"):
        hcm.pop(key, None)
    route = next(d for d in files["routes.yaml"] if d["kind"] == "HTTPRoute")
    services = {r.service: b for b, r in k8s.backend_refs(config_mod.load(TEMPLATE).config, {}).items()}
    hcm["route_config"]["virtual_hosts"][0]["routes"] = httproute_routes(route, services)
    _twin(boot, k8s_gateways.istio_cluster(k8s.Options()))
    (envoy_filter,) = [d for d in files["istio.yaml"] if d["kind"] == "EnvoyFilter"]
    _apply_envoy_filter(boot, envoy_filter)
    with running_envoy(authenticated(boot, stack.grpc_secret), tmp_path):
        meters_each_arm_and_fails_closed(stack, listen, other_app=False)

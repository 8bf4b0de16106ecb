"""The Kubernetes, Istio and Envoy Gateway manifests, checked without a cluster:
built-in objects against Kubernetes' own schemas (kubernetes-validate), custom
resources by shape, and the Envoy parts of the gateway recipes embedded in a
bootstrap the real Envoy validates. (That the header-match routes reach every
backend through the real Envoy is tests/integration/test_header_match.py.)"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar.config import schema as config_mod
from sidecar.deploy import envoy as envoyconf
from sidecar.deploy import k8s, k8s_gateways
from sidecar.devstack.stack import envoy_binary

DEPLOY = Path("deploy/kubernetes")
TEMPLATE = "sidecar/templates/ab-testing.yaml"
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests target (native gRPC probes: 1.27)
BUILT_IN = {"Secret", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"}


def _docs(name: str) -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def _all() -> list[dict]:
    return [d for name in sorted(p.name for p in DEPLOY.glob("*.yaml")) for d in _docs(name)]


def _template():
    return config_mod.load(TEMPLATE).config


def test_checked_in_manifests_are_what_the_generator_writes(tmp_path):
    subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", TEMPLATE, "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for path in sorted(tmp_path.iterdir()):
        assert (DEPLOY / path.name).read_text() == path.read_text(), (
            f"{DEPLOY / path.name} is stale: run model-router k8s --config {TEMPLATE} --out {DEPLOY}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in DEPLOY.glob("*.yaml"))


@pytest.mark.parametrize("doc", [d for d in _all() if d["kind"] in BUILT_IN],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_built_in_objects_match_the_kubernetes_schema(doc):
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_the_schema_check_catches_a_misspelt_field():
    deployment = copy.deepcopy(next(d for d in _docs("sidecar.yaml") if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _sidecar_objects() -> dict[str, dict]:
    docs = _docs("sidecar.yaml") + _docs("monitoring.yaml")
    return {d["kind"]: d for d in docs if d["metadata"]["name"].startswith("model-router")}


def test_the_sidecar_pod_is_locked_down_and_probed():
    objs = _sidecar_objects()
    pod = objs["Deployment"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] != 0
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["grpc"]["port"] == k8s.GRPC_PORT
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The config comes from the Secret, mounted read-only; the args point at it.
    secret = objs["Secret"]
    assert secret["stringData"]["config.yaml"] == Path(TEMPLATE).read_text()
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert mount["readOnly"] and c["args"][c["args"].index("--config") + 1] == f"{mount['mountPath']}/config.yaml"
    assert pod["spec"]["terminationGracePeriodSeconds"] > _template().server.drain_timeout_s


def test_selectors_and_ports_line_up():
    objs = _sidecar_objects()
    labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
        spec = objs[kind]["spec"]
        selector = spec["selector"].get("matchLabels", spec["selector"])
        assert selector.items() <= labels.items(), kind
    assert {p["targetPort"] for p in objs["Service"]["spec"]["ports"]} <= ports
    service_ports = {p["name"] for p in objs["Service"]["spec"]["ports"]}
    assert [e["port"] for e in objs["ServiceMonitor"]["spec"]["endpoints"]] == ["http-admin"]
    assert "http-admin" in service_ports and objs["ServiceMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"
    assert objs["PodDisruptionBudget"]["spec"]["maxUnavailable"] < objs["Deployment"]["spec"]["replicas"]


def test_every_route_names_a_service_the_manifests_or_the_cluster_provide():
    services = {(d["metadata"]["name"], d["spec"]["ports"][0]["port"]) for d in _all() if d["kind"] == "Service"}
    (route,) = [d for d in _docs("routes.yaml") if d["kind"] == "HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    *per_backend, catch_all = route["spec"]["rules"]
    assert catch_all == {"matches": [{"path": {"type": "PathPrefix", "value": "/"}}]}
    for rule in per_backend:
        (ref,) = rule["backendRefs"]
        assert (ref["name"], ref["port"]) in services
        assert rule["filters"][0]["requestHeaderModifier"]["remove"] == [envoyconf.BACKEND_HEADER, k8s.RESPONSE_HEADER]
    assert len(per_backend) == len(_template().backends)


def test_backends_outside_the_cluster_get_an_external_name_and_their_host(tmp_path):
    cfg = config_mod.parse("""
backends:
  - {name: hosted, url: "https://api.example.com/v1", type: openai}
  - {name: local, url: "http://vllm.llm.svc.cluster.local:8000"}
  - {name: short, url: "http://tgi:80"}
""").config
    docs = k8s.manifests(cfg, "", k8s.Options())
    route, external, tls = docs["routes.yaml"]
    refs = [r["backendRefs"][0] for r in route["spec"]["rules"][:-1]]
    assert refs == [{"kind": "Service", "name": "backend-hosted", "port": 443},
                    {"kind": "Service", "name": "vllm", "port": 8000, "namespace": "llm"},
                    {"kind": "Service", "name": "tgi", "port": 80}]
    assert route["spec"]["rules"][0]["filters"][1] == {"type": "URLRewrite", "urlRewrite": {"hostname": "api.example.com"}}
    assert external["spec"] == {"type": "ExternalName", "externalName": "api.example.com",
                                "ports": [{"name": "https", "port": 443}]}
    assert kubernetes_validate.validate(external, K8S_VERSION, strict=True)
    # TLS to port 443, never plaintext: Gateway API's BackendTLSPolicy, Istio's DestinationRule.
    assert tls["kind"] == "BackendTLSPolicy" and tls["spec"] == {
        "targetRefs": [{"group": "", "kind": "Service", "name": "backend-hosted"}],
        "validation": {"wellKnownCACertificates": "System", "hostname": "api.example.com"}}
    rules = [d for d in docs["istio.yaml"] if d["kind"] == "DestinationRule"]
    assert [r["spec"] for r in rules] == [{"host": "backend-hosted.model-router.svc.cluster.local",
                                           "trafficPolicy": {"tls": {"mode": "SIMPLE", "sni": "api.example.com"}}}]


def test_env_references_come_from_a_secret_in_the_pod(tmp_path, monkeypatch):
    """A config with ${ENV} secrets is generated without the values at hand
    and runs in the pod: each reference is an env var from the env Secret."""
    monkeypatch.delenv("HOSTED_KEY", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text('backends:\n  - {name: hosted, url: "https://api.example.com", type: openai, api_key: "${HOSTED_KEY}"}\n'
                    '  - {name: local, url: "http://vllm:8000", api_key: "${LOCAL_KEY:-none}"}\n')
    out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    deployment = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Deployment")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HOSTED_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "model-router-env", "key": "HOSTED_KEY"}}
    assert env["LOCAL_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    secret = next(d for d in yaml.safe_load_all(out.stdout) if d["kind"] == "Secret")
    assert "${HOSTED_KEY}" in secret["stringData"]["config.yaml"] and "set-in-the-pod" not in out.stdout
    assert kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_a_terminating_pod_keeps_serving_until_the_gateway_has_let_go():
    pod = _sidecar_objects()["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    probe = c["readinessProbe"]
    assert sleep > probe["periodSeconds"] * probe["failureThreshold"]
    assert pod["terminationGracePeriodSeconds"] > sleep + _template().server.drain_timeout_s


@pytest.mark.parametrize(("extra", "message"), [
    ("limits: [{model: m, requests_per_second: 5}]\n", "limits[0]: request rates and token budgets"),
    ("limits: [{model: m, tokens: 1000}]\n", "limits[0]: request rates and token budgets"),
    ("model_experiments: [{name: e, model: chat, response_model: client, variants: [{id: a, model: m, weight: 1}]}]\n",
     "model_experiments 'e'.response_model: client needs the response processor"),
    ("model_experiments: [{name: e, model: chat, variants: [{id: a, model: m, weight: 1}, "
     "{id: s, model: m, shadow: {share: 0.1}}]}]\n",
     "model_experiments 'e'.variants: the shadow arm 's' needs the shadow cluster"),
])
def test_what_a_gateway_would_silently_skip_is_refused(tmp_path, extra, message):
    path = tmp_path / "c.yaml"
    path.write_text("backends: [{name: a, url: 'http://a:8000', models: [m]}]\n" + extra)
    out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and f"error: {message}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    ok = subprocess.run([sys.executable, "-m", "sidecar", "config", "validate", str(path)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr  # a valid config: only the gateway cannot carry it


def test_what_the_manifests_cannot_express_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backends: [{name: a, url: 'http://10.0.0.7:8000'}]\n")
    out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and "backends 'a'.url: 10.0.0.7 is an IP address" in out.stderr
    path.write_text("backends: [{name: a, url: 'http://a:8000', models: [m, n]}]\nfallback_chains: {m: [n]}\n")
    out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 1 and "fallback_attempts: moving a failed attempt" in out.stderr, out.stderr
    path.write_text(path.read_text() + "fallback_attempts: 0\n")
    out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "kind: HTTPRoute" in out.stdout, out.stderr


def test_the_pod_recycles_its_one_process_by_exiting(tmp_path):
    """A pod runs one sidecar on one port: it recycles at the bound by going
    unready, draining and exiting for the kubelet to start it again."""
    path = tmp_path / "c.yaml"
    for server, flag in (("", ["--max-requests-per-worker", str(config_mod.DEFAULT_RETIRE_AFTER)]),
                         ("server: {max_requests_per_worker: 1000}\n", [])):
        path.write_text(server + "backends: [{name: a, url: 'http://a:8000'}]\n")
        out = subprocess.run([sys.executable, "-m", "sidecar", "k8s", "--config", str(path)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        docs = list(yaml.safe_load_all(out.stdout))
        deployment = next(d for d in docs if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "model-router")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["args"][:5] == ["serve", "--config", "/etc/model-router/config.yaml", "--workers", "1"]
        # A recycle restarts the container: unless the config sets a bound, a larger one than the supervisor's.
        args = container["args"]
        assert args[5] == "--no-supervisor"
        if flag:
            assert args[args.index(flag[0]):args.index(flag[0]) + 2] == flag
        else:
            assert "--max-requests-per-worker" not in args


# ------------------------------------------------------------ Envoy parts


def _hcm(boot: dict) -> dict:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def httproute_routes(route: dict, clusters: dict[str, str]) -> list[dict]:
    """An HTTPRoute's rules as the Envoy routes a gateway makes of them:
    exact header matches, the Service's cluster (``clusters``: Service name
    to cluster), the header removal; a rule with no backend answers 500."""
    out = []
    for i, rule in enumerate(route["spec"]["rules"]):
        (m,) = rule["matches"]
        match = {"prefix": m["path"]["value"]}
        if m.get("headers"):
            match["headers"] = [{"name": h["name"], "string_match": {"exact": h["value"]}} for h in m["headers"]]
        envoy_route: dict = {"name": f"rule-{i}", "match": match}
        if rule.get("backendRefs"):
            envoy_route["route"] = {"cluster": clusters[rule["backendRefs"][0]["name"]], "timeout": rule["timeouts"]["request"]}
            for f in rule.get("filters", []):
                if f["type"] == "RequestHeaderModifier":
                    envoy_route["request_headers_to_remove"] = f["requestHeaderModifier"]["remove"]
        else:
            envoy_route["direct_response"] = {"status": 500}
        out.append(envoy_route)
    return out


def _base() -> dict:
    """A gateway's Envoy before the recipe: the routes of the HTTPRoute, a
    plain router, the backends' and the sidecar's clusters; no decision
    filter, usage filter, header guard or access log."""
    boot = envoyconf.bootstrap(_template(), backend_urls={"pool-a": "http://127.0.0.1:18000", "pool-b": "http://127.0.0.1:18001"})
    hcm = _hcm(boot)
    router = hcm["http_filters"][-1]
    router["typed_config"] = {"@type": router["typed_config"]["@type"]}
    hcm["http_filters"] = [router]
    del hcm["early_header_mutation_extensions"], hcm["access_log"]
    route = next(d for d in _docs("routes.yaml") if d["kind"] == "HTTPRoute")
    services = {r.service: name for name, r in k8s.backend_refs(_template(), {}).items()}
    hcm["route_config"]["virtual_hosts"][0]["routes"] = httproute_routes(route, services)
    return boot


def _add_cluster(boot: dict, name: str) -> None:
    sidecar = next(c for c in boot["static_resources"]["clusters"] if c["name"] == envoyconf.RESERVED_BACKEND_NAME)
    twin = copy.deepcopy(sidecar)
    twin["name"] = twin["load_assignment"]["cluster_name"] = name
    boot["static_resources"]["clusters"].append(twin)


def _validate(boot: dict, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(envoyconf.render(boot))
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _apply_envoy_filter(boot: dict, envoy_filter: dict) -> None:
    """Apply the EnvoyFilter's patches as Istio does: HTTP filters inserted
    before the router, in order; the connection manager merged (repeated
    fields appended, as protobuf merges)."""
    hcm = _hcm(boot)
    for p in envoy_filter["spec"]["configPatches"]:
        op, value = p["patch"]["operation"], p["patch"]["value"]
        if p["applyTo"] == "HTTP_FILTER":
            assert op == "INSERT_BEFORE" and p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
            router = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "envoy.filters.http.router")
            hcm["http_filters"].insert(router, value)
        else:
            assert (p["applyTo"], op, value["name"]) == ("NETWORK_FILTER", "MERGE", k8s_gateways.HCM)
            assert value["typed_config"]["@type"] == hcm["@type"]
            for key, v in value["typed_config"].items():
                if key != "@type":
                    hcm[key] = hcm.get(key, []) + v if isinstance(v, list) else v


def test_the_istio_envoy_filter_patches_into_a_valid_envoy(tmp_path):
    (envoy_filter,) = _docs("istio.yaml")
    assert envoy_filter["apiVersion"] == "networking.istio.io/v1alpha3" and envoy_filter["kind"] == "EnvoyFilter"
    assert {p["match"]["context"] for p in envoy_filter["spec"]["configPatches"]} == {"GATEWAY"}
    boot = _base()
    opts = k8s.Options()
    _add_cluster(boot, k8s_gateways.istio_cluster(opts))
    _apply_envoy_filter(boot, envoy_filter)
    # The same filters, in the same order, as the product's own bootstrap.
    own = _hcm(envoyconf.bootstrap(_template(), backend_urls={"pool-a": "http://127.0.0.1:1", "pool-b": "http://127.0.0.1:2"}))
    patched = _hcm(boot)
    names = [f["name"] for f in patched["http_filters"]]
    assert names == [f["name"] for f in own["http_filters"] if f["name"] != "envoy.filters.http.sse_to_metadata"]
    # The decision filter (after the body buffer) is wrapped alike (skipped on Envoy's own 431) in both.
    ext_proc = patched["http_filters"][1]["typed_config"]["extension_config"]["typed_config"]
    mine = own["http_filters"][1]["typed_config"]
    assert patched["http_filters"][1]["typed_config"]["xds_matcher"] == mine["xds_matcher"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "outbound|50051||model-router.model-router.svc.cluster.local"
    assert {k: v for k, v in ext_proc.items() if k != "grpc_service"} == {
        k: v for k, v in mine["extension_config"]["typed_config"].items() if k != "grpc_service"}
    assert patched["early_header_mutation_extensions"] == own["early_header_mutation_extensions"]
    _validate(boot, tmp_path)


def test_a_misspelt_patch_field_fails_envoy_validation(tmp_path):
    (envoy_filter,) = _docs("istio.yaml")
    envoy_filter["spec"]["configPatches"][1]["patch"]["value"]["typed_config"]["mesage_timeout"] = "1s"
    boot = _base()
    _add_cluster(boot, k8s_gateways.istio_cluster(k8s.Options()))
    _apply_envoy_filter(boot, envoy_filter)
    with pytest.raises(AssertionError, match="mesage_timeout"):
        _validate(boot, tmp_path)


_EG_BODY = {"Buffered": "BUFFERED", "Streamed": "STREAMED", "BufferedPartial": "BUFFERED_PARTIAL"}


def _eg_ext_proc(spec: dict, cluster: str) -> dict:
    """An EnvoyExtensionPolicy extProc entry as the ext_proc filter Envoy
    Gateway configures from it (its documented field mapping)."""
    mode = spec.get("processingMode", {})

    def phase(name: str) -> tuple[str, str]:
        if name not in mode:
            return "SKIP", "NONE"
        return "SEND", _EG_BODY.get(mode[name].get("body", ""), "NONE")

    (req_h, req_b), (resp_h, resp_b) = phase("request"), phase("response")
    ms = int(spec["messageTimeout"].removesuffix("ms"))
    return {"name": "envoy.filters.http.ext_proc", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
        "failure_mode_allow": spec["failOpen"],
        "message_timeout": f"{ms / 1000:.3f}s",
        "allow_mode_override": mode.get("allowModeOverride", False),
        "metadata_options": {"receiving_namespaces": {"untyped": spec["metadata"]["writableNamespaces"]}},
        **({"status_on_error": {"code": spec["statusOnError"]}} if "statusOnError" in spec else {}),
        "processing_mode": {"request_header_mode": req_h, "request_body_mode": req_b, "response_header_mode": resp_h,
                            "response_body_mode": resp_b, "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
    }}


def test_the_envoy_gateway_policy_means_the_bootstrap_s_ext_proc(tmp_path):
    policy, proxy, client = _docs("envoy-gateway.yaml")
    assert (policy["kind"], proxy["kind"], client["kind"]) == ("EnvoyExtensionPolicy", "EnvoyProxy", "ClientTrafficPolicy")
    # The ext_proc filter runs on the LLM route only; the header guard on the whole listener.
    route = next(d for d in _docs("routes.yaml") if d["kind"] == "HTTPRoute")
    assert policy["spec"]["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                             "name": route["metadata"]["name"]}]
    assert policy["metadata"]["namespace"] == route["metadata"]["namespace"]
    assert client["spec"]["targetRefs"][0]["kind"] == "Gateway"
    (ref,) = policy["spec"]["extProc"][0]["backendRefs"]
    service = _sidecar_objects()["Service"]
    assert (ref["name"], ref["port"]) == (service["metadata"]["name"], k8s.GRPC_PORT)
    assert next(p for p in service["spec"]["ports"] if p["port"] == k8s.GRPC_PORT)["appProtocol"] == "kubernetes.io/h2c"
    removed = client["spec"]["headers"]["earlyRequestHeaders"]["remove"]
    assert {envoyconf.BACKEND_HEADER, k8s.RESPONSE_HEADER, "x-model-router-limit-model"} <= set(removed)
    assert all(h.startswith(envoyconf.ROUTER_HEADER_PREFIXES) for h in removed)
    assert int(client["spec"]["connection"]["bufferLimit"]) == envoyconf.buffer_limit_bytes(_template().server)

    cluster = "envoyextensionpolicy/model-router/model-router/extproc/0"
    ext_proc = _eg_ext_proc(policy["spec"]["extProc"][0], cluster)
    own = envoyconf.decision_filter(_template())["typed_config"]
    for key in ("processing_mode", "message_timeout", "failure_mode_allow", "allow_mode_override", "metadata_options",
                "status_on_error"):
        assert ext_proc["typed_config"][key] == own[key], key
    boot = _base()
    _add_cluster(boot, cluster)
    _hcm(boot)["http_filters"].insert(0, ext_proc)
    _validate(boot, tmp_path)


def test_gateway_recipes_in_another_namespace_reach_the_sidecar_across_it():
    opts = k8s.Options(namespace="llm", gateway="edge", gateway_namespace="gateways")
    files = k8s.manifests(_template(), "", opts)
    policy, proxy, client, grant = files["envoy-gateway.yaml"]
    # The policy sits with the HTTPRoute it targets and the sidecar it calls.
    assert policy["metadata"]["namespace"] == "llm" and "namespace" not in policy["spec"]["extProc"][0]["backendRefs"][0]
    # The EnvoyProxy and the ClientTrafficPolicy sit with the Gateway; the access log crosses over.
    assert proxy["metadata"]["namespace"] == client["metadata"]["namespace"] == "gateways"
    als = proxy["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"][0]["als"]
    assert als["backendRefs"][0]["namespace"] == "llm"
    assert grant["kind"] == "ReferenceGrant" and grant["metadata"]["namespace"] == "llm"
    assert grant["spec"]["from"] == [{"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "namespace": "gateways"}]
    (envoy_filter,) = files["istio.yaml"]
    assert envoy_filter["metadata"]["namespace"] == "gateways"
    assert envoy_filter["spec"]["workloadSelector"]["labels"] == {k8s_gateways.GATEWAY_LABEL: "edge"}
    route = files["routes.yaml"][0]
    assert route["spec"]["parentRefs"][0] == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge",
                                              "namespace": "gateways"}

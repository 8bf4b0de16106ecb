"""Only Envoy talks to the sidecar's gRPC port: forged calls are refused,
Envoy's own (carrying the per-run secret) are served."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import httpx
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as data_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as common_rl_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.contract import MAX_WAIT_METADATA
from sidecar.serve.grpc_auth import METADATA_KEY
from tests.conftest import metric, wait_metric

CONFIG = """
backends:
  - {name: pool-a, url: "demo://", type: vllm, models: [model-a]}
  - {name: pool-b, url: "demo://", type: vllm, models: [model-b]}
metering: {flush_interval_ms: 50}
model_experiments:
  - name: exp
    model: chat
    response_headers: true
    variants:
      - {id: control, model: model-a, weight: 1}
      - {id: candidate, model: model-b, weight: 0}
"""

ALS = "envoy.service.accesslog.v3.AccessLogService"
RLS = "envoy.service.ratelimit.v3.RateLimitService"


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG)


def forged_batch(variant: str = "candidate") -> als_pb2.StreamAccessLogsMessage:
    """One access-log entry as Envoy would send it, claiming a request on an arm."""
    entry = data_pb2.HTTPAccessLogEntry()
    meta = struct_pb2.Struct()
    meta.update({"kind": "routed", "backend": "pool-b", "experiment": "exp", "variant": variant,
                 "assignment": "sticky"})
    entry.common_properties.metadata.filter_metadata["model_router"].CopyFrom(meta)
    usage = struct_pb2.Struct()
    usage.update({"prompt_tokens": 100000, "completion_tokens": 0})
    entry.common_properties.metadata.filter_metadata["model_router_usage"].CopyFrom(usage)
    entry.response.response_code.value = 200
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.node.id = "forger"
    msg.identifier.log_name = "model_router"
    msg.http_logs.log_entry.append(entry)
    return msg


def send_log(addr: str, metadata=()) -> grpc.RpcError | None:
    with grpc.insecure_channel(addr) as channel:
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        try:
            stub.StreamAccessLogs(iter([forged_batch()]), metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc
    return None


def ask_rate(addr: str, metadata=()) -> grpc.RpcError | None:
    req = rls_pb2.RateLimitRequest(domain="model_router", hits_addend=1, descriptors=[
        common_rl_pb2.RateLimitDescriptor(entries=[
            common_rl_pb2.RateLimitDescriptor.Entry(key="model", value="chat")])])
    with grpc.insecure_channel(addr) as channel:
        try:
            rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(req, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc
    return None


def arm_count(stack, variant: str) -> float:
    return metric(stack, "model_experiment_requests_total", experiment="exp", variant=variant)


@pytest.mark.integration
def test_forged_access_log_is_refused(stack):
    addr = stack.sidecar_grpc[0]
    before = arm_count(stack, "candidate")
    for metadata in ((), ((METADATA_KEY, "not-the-secret-0123456789"),), ((METADATA_KEY, ""),)):
        err = send_log(addr, metadata)
        assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    refused = metric(stack, "model_router_grpc_unauthenticated_total", service=ALS)
    assert refused >= 3
    # The control: the same batch with Envoy's secret is accounted, so a
    # refusal above is what kept the arm's count still.
    assert send_log(addr, ((METADATA_KEY, stack.grpc_secret),)) is None
    assert wait_metric(stack, "model_experiment_requests_total", before + 1, experiment="exp",
                       variant="candidate") == before + 1


@pytest.mark.integration
def test_forged_rate_limit_call_is_refused(stack):
    addr = stack.sidecar_grpc[0]
    err = ask_rate(addr)
    assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert metric(stack, "model_router_grpc_unauthenticated_total", service=RLS) >= 1
    assert ask_rate(addr, ((METADATA_KEY, stack.grpc_secret),)) is None


@pytest.mark.integration
def test_envoy_calls_are_served_and_health_is_open(stack):
    before = arm_count(stack, "control")
    refused = metric(stack, "model_router_grpc_unauthenticated_total")
    for i in range(3):
        r = httpx.post(stack.url + "/v1/chat/completions", headers={"authorization": f"Bearer user-{i}"},
                       json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-continuum-experiment-variant"] == "control"
    # Per-arm metrics come from Envoy's access-log stream: it was admitted.
    assert wait_metric(stack, "model_experiment_requests_total", before + 3, experiment="exp",
                       variant="control") == before + 3
    assert metric(stack, "model_router_grpc_unauthenticated_total") == refused
    with grpc.insecure_channel(stack.sidecar_grpc[0]) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_every_sidecar_call_in_the_bootstrap_carries_the_secret():
    from sidecar.config import schema as config_mod
    from sidecar.deploy import envoy as envoyconf

    cfg = config_mod.parse(CONFIG.replace("metering:", "fallback_chains: {model-a: [model-b]}\n"
                                          "limits: [{model: chat, requests_per_second: 5, shared: true}]\n"
                                          "redis: {url: 'redis://127.0.0.1:1/0'}\nmetering:")).config
    boot = envoyconf.bootstrap(cfg, backend_urls={"pool-a": "http://127.0.0.1:1", "pool-b": "http://127.0.0.1:2"},
                               grpc_secret="s" * 20)
    services: list[dict] = []  # every gRPC call Envoy makes to the sidecar
    filters: list[dict] = []  # every config holding one as its grpc_service

    def walk(node):
        if isinstance(node, dict):
            if "envoy_grpc" in node:
                services.append(node)
            if isinstance(node.get("grpc_service"), dict) and "envoy_grpc" in node["grpc_service"]:
                filters.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(boot)
    # decision, response, hop (a copy per composite cluster), access log, rate-limit service
    assert len(services) >= 5
    for s in services:
        # Each call carries the secret once; the decision filter's also says how long Envoy waits when asked.
        secrets = [m for m in s["initial_metadata"] if m["key"] == METADATA_KEY]
        assert secrets == [{"key": METADATA_KEY, "value": "s" * 20}]
        assert all(m["key"] in (METADATA_KEY, MAX_WAIT_METADATA) for m in s["initial_metadata"])
    # The filters that say so wait as long as they say: their max_message_timeout (the others name none).
    said = {id(f): [m["value"] for m in f["grpc_service"]["initial_metadata"] if m["key"] == MAX_WAIT_METADATA]
            for f in filters}
    assert any(said.values())
    for f in filters:
        wait = f.get("max_message_timeout")
        assert said[id(f)] == ([str(int(wait.removesuffix("s")) * 1000)] if wait else []), f


# --------------------------------------------------------------------- mTLS


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d, name: str = "ca") -> dict[str, str]:
    """A throwaway CA, a server certificate for sidecar.test and a client certificate."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1",
             "-subj", f"/CN={name}", cwd=d)
    out = {"ca": str(d / f"{name}.pem")}
    for who, ext in (("server", "subjectAltName=DNS:sidecar.test\nextendedKeyUsage=serverAuth\n"),
                     ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}-{who}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}-{who}.key", "-out", f"{name}-{who}.csr", "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}-{who}.csr", "-CA", f"{name}.pem", "-CAkey", f"{name}.key",
                 "-CAcreateserial", "-out", f"{name}-{who}.pem", "-days", "1", "-extfile", f"{name}-{who}.ext", cwd=d)
        out[who] = str(d / f"{name}-{who}.pem")
        out[f"{who}_key"] = str(d / f"{name}-{who}.key")
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")
    d = tmp_path_factory.mktemp("pki")
    return make_pki(d), make_pki(d, "rogue")


@pytest.fixture(scope="module")
def tls_stack(stack_factory, pki):
    ours, _ = pki
    tls = (f"{{cert_file: '{ours['server']}', key_file: '{ours['server_key']}', client_ca_file: '{ours['ca']}', "
           f"envoy_cert_file: '{ours['client']}', envoy_key_file: '{ours['client_key']}', server_name: sidecar.test}}")
    return stack_factory(f"server: {{grpc_auth: {{tls: {tls}}}}}\n" + CONFIG)


def _tls_call(addr: str, ca: str, cert: tuple[str, str] | None, metadata=()) -> grpc.RpcError | None:
    creds = grpc.ssl_channel_credentials(
        root_certificates=open(ca, "rb").read(),
        private_key=open(cert[1], "rb").read() if cert else None,
        certificate_chain=open(cert[0], "rb").read() if cert else None,
    )
    options = (("grpc.ssl_target_name_override", "sidecar.test"),)
    with grpc.secure_channel(addr, creds, options=options) as channel:
        try:
            rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit(
                rls_pb2.RateLimitRequest(domain="model_router"), metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc
    return None


@pytest.mark.integration
def test_with_mtls_envoy_routes_and_a_caller_without_the_certificate_is_refused(tls_stack, pki):
    ours, rogue = pki
    r = httpx.post(tls_stack.url + "/v1/chat/completions", headers={"authorization": "Bearer user-1"},
                   json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 200, r.text
    addr = tls_stack.sidecar_grpc[0]
    secret = ((METADATA_KEY, tls_stack.grpc_secret),)
    assert ask_rate(addr, secret).code() == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
    for cert in (None, (rogue["client"], rogue["client_key"])):  # no certificate; another CA's
        err = _tls_call(addr, ours["ca"], cert, secret)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, cert
    # The control: the right certificate (and the secret) is served, so the
    # refusals above are the handshake's.
    assert _tls_call(addr, ours["ca"], (ours["client"], ours["client_key"]), secret) is None
    err = _tls_call(addr, ours["ca"], (ours["client"], ours["client_key"]))
    assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED  # the secret still counts


# --------------------------------------------------------------------- the rule, and serve's refusal


def _gate(**auth):
    from sidecar.config.schema import GrpcAuth
    from sidecar.serve.grpc_auth import Gate

    spec = GrpcAuth(**auth)
    return Gate(spec.secret, spec)


ASSIGN = "/model_router.v1.Assignment/Assign"
EXT_PROC = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH = "/grpc.health.v1.Health/Check"


def test_the_assignment_api_takes_its_own_token_and_not_envoys_secret():
    gate = _gate(secret="e" * 20, assignment_token="t" * 20)
    assert gate.admits(ASSIGN, {"authorization": "Bearer " + "t" * 20})
    assert not gate.admits(ASSIGN, {METADATA_KEY: "e" * 20})
    assert not gate.admits(ASSIGN, {"authorization": "t" * 20})  # no scheme
    assert not gate.admits(EXT_PROC, {"authorization": "Bearer " + "t" * 20})
    assert gate.admits(EXT_PROC, {METADATA_KEY: "e" * 20})
    assert not _gate(secret="e" * 20).admits(ASSIGN, {METADATA_KEY: "e" * 20})  # no token: closed
    assert gate.admits(HEALTH, {})


def test_without_grpc_auth_the_port_trusts_its_network():
    gate = _gate()
    assert gate.admits(EXT_PROC, {}) and gate.admits(ASSIGN, {})


@pytest.mark.parametrize("value", ["short", "has space in it 0123", "x" * 15])
def test_a_weak_secret_is_refused_at_load(value):
    from sidecar.config.schema import ConfigError, parse

    with pytest.raises(ConfigError) as info:
        parse(f"server: {{grpc_auth: {{secret: '{value}'}}}}\nbackends: [{{name: a, url: 'demo://'}}]\n", env={})
    assert info.value.errors[0].startswith("server.grpc_auth.secret: must")


def test_serve_refuses_an_unauthenticated_port_beyond_loopback(tmp_path):
    import sys

    config = tmp_path / "c.yaml"
    config.write_text("backends: [{name: a, url: 'http://127.0.0.1:9'}]\n")
    done = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--config", str(config),
                           "--grpc-listen", "0.0.0.0:0", "--admin-listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "beyond loopback and unauthenticated" in done.stderr

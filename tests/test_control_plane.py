"""Only Envoy talks to the sidecar's gRPC port: forged calls are refused,
Envoy's own (carrying the per-run secret) are served."""

from __future__ import annotations

import grpc
import httpx
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as data_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2 as common_rl_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.grpc_auth import METADATA_KEY
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
    from sidecar import config as config_mod
    from sidecar import envoyconf

    cfg = config_mod.parse(CONFIG.replace("metering:", "fallback_chains: {model-a: [model-b]}\n"
                                          "limits: [{model: chat, requests_per_second: 5, shared: true}]\n"
                                          "redis: {url: 'redis://127.0.0.1:1/0'}\nmetering:")).config
    boot = envoyconf.bootstrap(cfg, backend_urls={"pool-a": "http://127.0.0.1:1", "pool-b": "http://127.0.0.1:2"},
                               grpc_secret="s" * 20)
    services: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            if "envoy_grpc" in node:
                services.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(boot)
    # decision, response, hop (a copy per composite cluster), access log, rate-limit service
    assert len(services) >= 5
    for s in services:
        assert s["initial_metadata"] == [{"key": METADATA_KEY, "value": "s" * 20}]

"""OTLP traces: one router.request span per request, built from Envoy's
access-log entry, exported to a receiver the test starts on loopback, a child
of the client's W3C trace context when it sent one."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

from sidecar.accounting import spans, trace_settings
from sidecar.accounting.metering import Entry
from sidecar.config.schema import Tracing

from ..conftest import clear_demo_requests, demo_requests, metric, wait_metric
from ..support.configs import SPLIT_ARMS, split_config
from ..support.otlp import GrpcReceiver, HttpReceiver, decode

KEY = "sk-trace-team-secret"
CONFIG = split_config("""
metering: {flush_interval_ms: 100}
tracing: %s
api_keys:
  - {id: team-a, key: %s}
""")
ARM = SPLIT_ARMS
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "one two three"  # the demo engine counts words: 3 prompt tokens


# ------------------------------------------------------------------ pure parts


def test_traceparent_parsing_follows_w3c():
    p = spans.parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "vendor=x")
    assert p is not None and p.trace_id.hex() == TRACE_ID and p.span_id.hex() == CLIENT_SPAN
    assert p.sampled and p.state == "vendor=x"
    assert not spans.parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-00").sampled
    # A later version may append fields; version 00 may not.
    assert spans.parse_traceparent(f"01-{TRACE_ID}-{CLIENT_SPAN}-01-extra") is not None
    for bad in (None, "", "garbage", f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra", f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",
                f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"00-{TRACE_ID}-{'0' * 16}-01", f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01"):
        assert spans.parse_traceparent(bad) is None, bad


def test_samplers_follow_the_parent_or_the_ratio():
    sampled = spans.parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
    unsampled = spans.parse_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-00")
    low, high = bytes(8) + (1).to_bytes(8, "big"), bytes(8) + b"\xff" * 8
    on = spans.Sampler("parentbased_always_on")
    assert on.sample(None, high) and on.sample(sampled, high) and not on.sample(unsampled, high)
    assert spans.Sampler("always_on").sample(unsampled, high)
    assert not spans.Sampler("always_off").sample(sampled, high)
    half = spans.Sampler("traceidratio", 0.5)
    assert half.sample(None, low) and not half.sample(None, high)
    ratio = spans.Sampler("parentbased_traceidratio", 0.0)
    assert ratio.sample(sampled, high) and not ratio.sample(None, low)


def _entry(**decision) -> Entry:
    return Entry(decision=decision, status=200, start=1_700_000_000.25, headers_s=0.01, total_s=0.5,
                 prompt_tokens=3, completion_tokens=7, upstream_failed=False, client_gone=False,
                 traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-01")


def test_span_of_an_entry_carries_the_decision_and_times():
    span = spans.span_of(_entry(kind="routed", experiment="split", variant="control", client_model="chat",
                                upstream_model="model-a", backend="pool-a", ingress="/v1/chat/completions",
                                family="openai"), spans.Sampler())
    got = decode(tracing_request([span]))[0]
    assert got["trace_id"] == TRACE_ID and got["parent_span_id"] == CLIENT_SPAN
    assert got["start"] == 1_700_000_000_250_000_000 and got["end"] - got["start"] == 500_000_000
    assert got["attributes"] == {
        "gen_ai.operation.name": "chat", "router.kind": "routed", "router.experiment": "split",
        "router.experiment_variant": "control", "gen_ai.request.model": "chat", "gen_ai.response.model": "model-a",
        "router.upstream_model": "model-a", "router.backend": "pool-a", "router.ingress": "/v1/chat/completions",
        "gen_ai.provider.name": "openai", "gen_ai.system": "openai", "http.response.status_code": 200, "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 7,
    }
    assert spans.span_of(Entry({}, 503, 1.0, None, None, None, None, True, False), spans.Sampler()) is None


def test_a_span_names_the_answer_the_server_and_the_error_type():
    import dataclasses

    decision = {"kind": "routed", "client_model": "chat", "upstream_model": "claude-x", "backend": "pool-a",
                "ingress": "/anthropic/v1/messages", "family": "anthropic"}
    entry = dataclasses.replace(_entry(**decision), answer={
        "response_id": "msg_01", "response_model": "claude-x-2025", "finish_reason": "end_turn"})
    ctx = spans.sampled(entry, spans.Sampler())
    got = decode(tracing_request([spans.build(entry, ctx, server_of={"pool-a": ("10.0.0.5", 8000)}.get)]))[0]
    attrs = got["attributes"]
    assert (attrs["gen_ai.response.id"], attrs["gen_ai.response.model"]) == ("msg_01", "claude-x-2025")
    assert attrs["gen_ai.response.finish_reasons"] == ["end_turn"]
    assert (attrs["server.address"], attrs["server.port"]) == ("10.0.0.5", 8000) and "error.type" not in attrs
    # A body renamed to the client's name does not hide the model that answered.
    renamed = dataclasses.replace(entry, answer={"response_model": "chat"})
    assert decode(tracing_request([spans.build(renamed, ctx)]))[0]["attributes"]["gen_ai.response.model"] == "claude-x"
    # Errors carry error.type: the refusal code, else the status, else _OTHER.
    for change, want in ((dict(status=503, decision={**decision, "refusal": "no_backend_available"}), "no_backend_available"),
                         (dict(status=502), "502"), (dict(status=0, upstream_failed=True), "_OTHER")):
        failed = dataclasses.replace(entry, **change)
        got = decode(tracing_request([spans.build(failed, ctx)]))[0]
        assert got["attributes"]["error.type"] == want and got["status"] == 2, (change, got)
    assert spans.error_type(decision, 404, False) is None


def test_the_router_names_its_span_upstream_only_when_the_client_did_not():
    assert spans.upstream_traceparent(f"00-{TRACE_ID}-{CLIENT_SPAN}-01") is None
    header, span_id = spans.upstream_traceparent("garbage", lambda n: bytes.fromhex(CLIENT_SPAN + TRACE_ID)[:n])
    assert (header, span_id) == (f"00-{TRACE_ID}-{CLIENT_SPAN}-01", CLIENT_SPAN)
    # The access log carries the context the router sent: the span is its root, with that id.
    import dataclasses

    entry = dataclasses.replace(_entry(kind="routed", span_id=span_id), traceparent=header)
    got = decode(tracing_request([spans.span_of(entry, spans.Sampler())]))[0]
    assert (got["trace_id"], got["span_id"], got["parent_span_id"]) == (TRACE_ID, CLIENT_SPAN, "")
    # A ratio sampler decides on the trace id as for any root.
    assert spans.span_of(entry, spans.Sampler("parentbased_always_off")) is None


def tracing_request(span_list) -> bytes:
    from sidecar._proto import otlp_pb2

    return otlp_pb2.ExportTraceServiceRequest(resource_spans=[otlp_pb2.ResourceSpans(
        scope_spans=[otlp_pb2.ScopeSpans(spans=span_list)])]).SerializeToString()


def test_the_file_wins_over_otel_variables_and_sdk_disabled_wins_over_all():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "from-env", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=x",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20tok", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    s, warnings = trace_settings.resolve(Tracing(), env)
    assert warnings == []
    assert s.endpoint == "http://collector:4318/v1/traces" and s.protocol == "http/protobuf"
    assert dict(s.resource) == {"deployment.environment": "prod", "service.name": "from-env"}
    assert s.sampler == spans.Sampler("traceidratio", 0.25) and s.schedule_delay_s == 0.2
    assert dict(s.headers) == {"authorization": "Bearer tok"}
    assert "tok" not in repr(s)
    s, _ = trace_settings.resolve(Tracing(endpoint="http://file:4317", protocol="grpc", service_name="file",
                                   sampler="always_on"), env)
    assert (s.endpoint, s.protocol, dict(s.resource)["service.name"], s.sampler.name) == (
        "http://file:4317", "grpc", "file", "always_on")
    assert trace_settings.resolve(Tracing(endpoint="http://file:4317"), {**env, "OTEL_SDK_DISABLED": "true"})[0] is None
    assert trace_settings.resolve(Tracing(enabled=False), env)[0] is None
    # Off unless an endpoint is known; a signal-specific endpoint is used as given.
    assert trace_settings.resolve(Tracing(), {})[0] is None
    s, _ = trace_settings.resolve(Tracing(), {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317"})
    assert (s.endpoint, s.protocol, s.sampler.name) == ("http://collector:4317", "grpc", "parentbased_always_on")
    s, warnings = trace_settings.resolve(Tracing(enabled=True), {"OTEL_TRACES_SAMPLER": "nope", "OTEL_BSP_MAX_QUEUE_SIZE": "x"})
    assert s.endpoint == "http://localhost:4317" and s.sampler.name == "parentbased_always_on" and s.max_queue_size == 2048
    assert len(warnings) == 2


def test_a_bad_tracing_section_is_a_config_error_with_its_path():
    from sidecar.config.schema import ConfigError, parse

    base = 'backends: [{name: a, url: "demo://", models: [m]}]\n'
    assert parse(base + 'tracing: {endpoint: "https://collector:4317", sampler: traceidratio, sampler_arg: 0.5}')
    with pytest.raises(ConfigError) as info:
        parse(base + "tracing: {endpoint: ftp://x, sampler: nope, sampler_arg: 2, protocol: http/json, bogus: 1}")
    paths = sorted(e.split(":")[0] for e in info.value.errors)
    assert paths == ["tracing.bogus", "tracing.endpoint", "tracing.protocol", "tracing.sampler", "tracing.sampler_arg"]


def test_xds_protos_and_the_otlp_exporter_import_together():
    """xds-protos ships an old copy of opentelemetry.proto (grpc/grpc#42926);
    the exporter's messages live under the router's own package, so both load
    in one process and its bytes read as OTLP with whichever copy is installed."""
    code = (
        "from envoy.service.ext_proc.v3 import external_processor_pb2\n"
        "from envoy.service.accesslog.v3 import als_pb2\n"
        "from envoy.extensions.access_loggers.open_telemetry.v3 import logs_service_pb2\n"
        "import sidecar.serve.server, sidecar.accounting.tracing\n"
        "from opentelemetry.proto.collector.trace.v1 import trace_service_pb2\n"
        "from sidecar._proto import otlp_pb2\n"
        "span = otlp_pb2.Span(name='router.request', trace_id=b'\\x01' * 16)\n"
        "body = otlp_pb2.ExportTraceServiceRequest(resource_spans=[otlp_pb2.ResourceSpans(\n"
        "    scope_spans=[otlp_pb2.ScopeSpans(spans=[span])])]).SerializeToString()\n"
        "req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)\n"
        "rs = req.resource_spans[0]\n"
        "print(getattr(rs, rs.DESCRIPTOR.fields_by_number[2].name)[0].spans[0].name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "router.request"


# ------------------------------------------------------------------ through Envoy


@pytest.fixture(scope="module")
def grpc_receiver():
    r = GrpcReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def grpc_stack(stack_factory, grpc_receiver):
    section = ("{endpoint: \"%s\", schedule_delay_ms: 50, service_name: router-under-test, "
               "headers: {x-collector-token: tok}}" % grpc_receiver.endpoint)
    return stack_factory(CONFIG % (section, KEY))


def _chat(stack, caller: str, headers: dict | None = None):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    return client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": PROMPT}],
        extra_headers={"x-caller": caller, **(headers or {})},
    )


def _by_request(receiver, rid: str) -> dict:
    found = receiver.wait_for(lambda s: s["attributes"].get("router.request_id") == rid)
    assert len(found) == 1, f"{len(found)} spans for request {rid}"
    return found[0]


@pytest.mark.integration
def test_a_span_per_request_parented_to_the_clients_trace(grpc_stack, grpc_receiver):
    before = time.time_ns()
    raw = _chat(grpc_stack, "traced", {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "vendor=v1"})
    after = time.time_ns()
    completion = raw.parse()
    arm = raw.headers["x-continuum-experiment-variant"]
    span = _by_request(grpc_receiver, raw.headers["x-request-id"])
    assert span["name"] == "router.request" and span["kind"] == 2  # SERVER
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == CLIENT_SPAN
    assert span["trace_state"] == "vendor=v1"
    assert span["span_id"] not in ("", "0" * 16, CLIENT_SPAN)
    assert before - 1e9 <= span["start"] <= span["end"] <= after + 1e9
    model, backend = ARM[arm]
    attrs = span["attributes"]
    assert {k: attrs.get(k) for k in (
        "router.experiment", "router.experiment_variant", "router.assignment", "gen_ai.request.model",
        "gen_ai.response.model", "router.backend", "http.response.status_code", "gen_ai.operation.name",
        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "router.key_id",
    )} == {
        "router.experiment": "split", "router.experiment_variant": arm, "router.assignment": "sticky",
        "gen_ai.request.model": "chat", "gen_ai.response.model": model, "router.backend": backend,
        "http.response.status_code": 200, "gen_ai.operation.name": "chat",
        "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": completion.usage.completion_tokens,
        "router.key_id": "team-a",
    }
    assert span["status"] == 0 and "error.type" not in attrs  # UNSET: a success
    # What the answer says about itself, and where it came from (GenAI conventions).
    assert attrs["gen_ai.response.id"] == completion.id and attrs["gen_ai.response.model"] == completion.model
    demo = grpc_stack.demo_urls[backend]
    assert f"{attrs['server.address']}:{attrs['server.port']}" == demo.split("://", 1)[1].rstrip("/")
    assert span["schema_url"] == spans.SCHEMA_URL
    assert span["resource"]["service.name"] == "router-under-test"
    assert span["scope"] == "model-router"
    assert all(h.get("x-collector-token") == "tok" for h in grpc_receiver.headers)
    assert not any(KEY in str(v) for s in grpc_receiver.spans for v in s["attributes"].values())


@pytest.mark.integration
def test_a_request_without_traceparent_starts_a_new_trace_the_engine_joins(grpc_stack, grpc_receiver):
    """The router's span is the root, and the request carries it upstream as
    the engine's parent: both sides of the hop are in one trace."""
    for sent in ({}, {"traceparent": "00-not-a-trace-01"}):  # an invalid one is ignored the same way
        clear_demo_requests(grpc_stack)
        raw = _chat(grpc_stack, "untraced", sent)
        span = _by_request(grpc_receiver, raw.headers["x-request-id"])
        assert span["parent_span_id"] == ""
        assert span["trace_id"] not in (TRACE_ID, "0" * 32) and len(span["trace_id"]) == 32
        (seen,) = demo_requests(grpc_stack, ARM[raw.headers["x-continuum-experiment-variant"]][1])
        assert seen["headers"]["traceparent"] == f"00-{span['trace_id']}-{span['span_id']}-01", seen["headers"]
    # A client's valid context goes upstream untouched.
    clear_demo_requests(grpc_stack)
    raw = _chat(grpc_stack, "traced", {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    (seen,) = demo_requests(grpc_stack, ARM[raw.headers["x-continuum-experiment-variant"]][1])
    assert seen["headers"]["traceparent"] == f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.mark.integration
def test_with_tracing_off_no_trace_context_is_made_up_for_the_engine(stack_factory):
    """Without span export the router's span exists nowhere: a request goes
    upstream with the trace context its client sent, or with none."""
    stack = stack_factory(CONFIG % ("{enabled: false}", KEY))
    for sent in ({}, {"traceparent": "00-not-a-trace-01"}, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}):
        clear_demo_requests(stack)
        raw = _chat(stack, "untraced", sent)
        (seen,) = demo_requests(stack, ARM[raw.headers["x-continuum-experiment-variant"]][1])
        assert seen["headers"].get("traceparent") == sent.get("traceparent"), seen["headers"]


@pytest.mark.integration
def test_a_refusal_has_a_span_with_its_kind(grpc_stack, grpc_receiver):
    r = httpx.post(grpc_stack.url + "/v1/chat/completions", json={"model": "nope", "messages": []},
                   headers={"authorization": f"Bearer {KEY}", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    assert r.status_code == 404
    span = _by_request(grpc_receiver, r.headers["x-request-id"])
    assert span["trace_id"] == TRACE_ID
    assert span["attributes"]["router.refusal"] == "model_not_found"
    assert span["attributes"]["http.response.status_code"] == 404
    assert span["status"] == 0  # a client error is not the server's


@pytest.mark.integration
def test_tracing_keeps_the_request_path_at_two_ext_proc_messages(grpc_stack):
    from ..conftest import envoy_stat

    before = envoy_stat(grpc_stack, "ext_proc.stream_msgs_sent")
    for i in range(3):
        assert _chat(grpc_stack, f"msgs-{i}", {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}).status_code == 200
    assert envoy_stat(grpc_stack, "ext_proc.stream_msgs_sent") - before == 6


@pytest.mark.integration
def test_otel_variables_configure_http_export_and_a_dead_collector_costs_only_spans(stack_factory):
    receiver = HttpReceiver().start()
    try:
        stack = stack_factory(CONFIG % ("{}", KEY), sidecar_env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_SERVICE_NAME": "from-env", "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_EXPORTER_OTLP_TIMEOUT": "2000",
        })
        raw = _chat(stack, "http", {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        span = _by_request(receiver, raw.headers["x-request-id"])
        assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == CLIENT_SPAN
        assert span["resource"]["service.name"] == "from-env"
        assert span["attributes"]["router.experiment"] == "split"
        exported = wait_metric(stack, "model_router_trace_spans_exported_total", 1)
        assert exported >= 1
    finally:
        receiver.stop()
    before = metric(stack, "model_router_trace_spans_dropped_total", reason="export_failed")
    for i in range(5):
        assert _chat(stack, f"down-{i}").status_code == 200
    assert wait_metric(stack, "model_router_trace_spans_dropped_total", before + 5, timeout=30,
                       reason="export_failed") >= before + 5
    assert metric(stack, "model_router_trace_spans_exported_total") == exported


def test_a_reload_moves_export_and_a_full_queue_drops_and_counts(grpc_receiver):
    """The tracer follows the current tracing: section; spans past the queue are counted, not kept."""
    import asyncio

    from sidecar import metrics
    from sidecar.accounting.tracing import Tracer

    other = GrpcReceiver().start()
    current = {"cfg": Tracing(endpoint=grpc_receiver.endpoint, schedule_delay_ms=20, max_queue_size=2)}
    dropped = metrics.TRACE_SPANS_DROPPED.labels("queue_full")

    def entry(rid: str) -> Entry:
        return Entry({"kind": "routed", "request_id": rid}, 200, time.time(), 0.001, 0.002, None, None, False, False)

    async def scenario() -> None:
        tracer = Tracer(lambda: current["cfg"], env={})
        tracer.start()
        before = dropped._value.get()
        for i in range(3):
            tracer.observe(entry(f"first-{i}"))  # the third finds the queue full
        assert dropped._value.get() == before + 1
        await asyncio.to_thread(grpc_receiver.wait_for, lambda s: s["attributes"]["router.request_id"] == "first-1")
        current["cfg"] = Tracing(endpoint=other.endpoint, schedule_delay_ms=20)
        tracer.observe(entry("second"))
        await tracer.close()

    try:
        asyncio.run(scenario())
        assert [s["attributes"]["router.request_id"] for s in other.spans] == ["second"]
        assert not grpc_receiver.wait_for(lambda s: s["attributes"]["router.request_id"] in ("second", "first-2"),
                                          timeout=0)
    finally:
        other.stop()


@pytest.mark.integration
def test_a_stopping_sidecar_exports_what_it_still_holds(stack_factory, grpc_receiver):
    from ..conftest import metered

    section = "{endpoint: \"%s\", schedule_delay_ms: 600000}" % grpc_receiver.endpoint  # no export on the clock
    stack = stack_factory(CONFIG % (section, KEY))
    raw = _chat(stack, "at-stop")
    rid = raw.headers["x-request-id"]
    assert metered(stack, timeout=30)  # the entry has reached the sidecar
    assert not grpc_receiver.wait_for(lambda s: s["attributes"].get("router.request_id") == rid, timeout=0)
    stack.stop_sidecar(0)
    assert _by_request(grpc_receiver, rid)["attributes"]["router.experiment"] == "split"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_never_answers_costs_counted_spans_within_the_timeout(protocol):
    """A listener that accepts and never answers: each export ends at its timeout."""
    import asyncio
    import socket

    from sidecar import metrics
    from sidecar.accounting.tracing import Tracer

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    endpoint = "http://127.0.0.1:%d" % silent.getsockname()[1]
    failed = metrics.TRACE_SPANS_DROPPED.labels("export_failed")
    cfg = Tracing(endpoint=endpoint, protocol=protocol, timeout_ms=300, schedule_delay_ms=20)

    async def scenario() -> float:
        tracer = Tracer(lambda: cfg, env={})
        tracer.start()
        before = failed._value.get()
        for i in range(4):
            tracer.observe(Entry({"kind": "routed", "request_id": f"silent-{i}"}, 200, time.time(), None, 0.001,
                                 None, None, False, False))
        deadline = time.monotonic() + 30
        while failed._value.get() < before + 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await tracer.close(timeout=5)
        return failed._value.get() - before

    try:
        assert asyncio.run(scenario()) == 4
    finally:
        silent.close()

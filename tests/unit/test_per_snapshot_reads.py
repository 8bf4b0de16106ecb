"""What the request path reads once per config snapshot, or keeps as plain
counts, still follows the config and still reaches a scrape."""

from __future__ import annotations

import asyncio

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.accounting.budgets import Budgets
from sidecar.config.schema import parse
from sidecar.handlers.extproc import Processor
from sidecar.metrics import Tally
from sidecar.routing import snapshot
from sidecar.routing.snapshot import Snapshot

CONFIG = """
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m]}
"""


class Runtime:
    """Exports spans while its current snapshot says so (as the tracer follows the config)."""

    def __init__(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self.budgets = Budgets(lambda: self.snapshot)
        self.asked = 0

    def backend_states(self) -> dict:
        return {}

    def count_request(self) -> None:
        pass

    def exports_traces(self) -> bool:
        self.asked += 1
        return self.snapshot.config.server.grpc_listen.endswith(":9999")  # stands for "tracing: on"

    def report_response(self, backend: str, status: int | None) -> None:
        pass


def _traceparent_sent(processor: Processor, between=lambda: None) -> bool:
    """Whether a routed request's answer names a span upstream; ``between``
    runs after Envoy's first message is read, before the body arrives."""
    entries = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
               {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}.items()]
    messages = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=entries))),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "m"}', end_of_stream=True))]

    async def run() -> list[pb.ProcessingResponse]:
        async def stream():
            yield messages[0]
            between()
            yield messages[1]
        return [a async for a in processor.Process(stream(), None)]

    answer = asyncio.run(run())[-1]
    sets = answer.request_body.response.header_mutation.set_headers
    assert any(h.header.key == "x-model-router-backend" for h in sets), answer  # routed
    return any(h.header.key == "traceparent" for h in sets)


def test_whether_spans_are_exported_is_read_again_for_each_new_snapshot():
    off = snapshot.build(parse(CONFIG, env={}).config)
    on = snapshot.build(parse(CONFIG + "server: {grpc_listen: '127.0.0.1:9999'}\n", env={}).config)
    runtime = Runtime(off)
    processor = Processor(runtime)
    assert [_traceparent_sent(processor) for _ in range(3)] == [False] * 3
    assert runtime.asked == 1  # once for the snapshot, not per request
    runtime.snapshot = on  # a reload turns tracing on
    assert [_traceparent_sent(processor) for _ in range(2)] == [True] * 2
    runtime.snapshot = off
    assert _traceparent_sent(processor) is False
    assert runtime.asked == 3


def test_a_reload_during_an_upload_is_followed_as_the_tracer_follows_it():
    """A request decided on the old snapshot names a span upstream only if
    the tracer, which follows the current config, will export it."""
    off = snapshot.build(parse(CONFIG, env={}).config)
    on = snapshot.build(parse(CONFIG + "server: {grpc_listen: '127.0.0.1:9999'}\n", env={}).config)
    runtime = Runtime(on)
    processor = Processor(runtime)
    assert _traceparent_sent(processor) is True

    def reload(to: Snapshot):
        return lambda: setattr(runtime, "snapshot", to)

    assert _traceparent_sent(processor, between=reload(off)) is False  # headers under "on", body after the reload
    assert _traceparent_sent(processor, between=reload(on)) is True


def test_a_tally_is_scraped_as_a_counter_per_label_set():
    registry = CollectorRegistry()
    tally = Tally("demo_decisions_total", "Decisions.", ("outcome",), registry=registry)
    for outcome in ("routed", "routed", "404", "routed"):
        tally.inc(outcome)
    (family,) = text_string_to_metric_families(generate_latest(registry).decode())
    assert (family.name, family.type, family.documentation) == ("demo_decisions", "counter", "Decisions.")
    assert {(s.name, s.labels["outcome"], s.value) for s in family.samples} == {
        ("demo_decisions_total", "routed", 3.0), ("demo_decisions_total", "404", 1.0)}
    assert registry.get_sample_value("demo_decisions_total", {"outcome": "routed"}) == 3

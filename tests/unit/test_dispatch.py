"""The ext_proc handler and explain dispatch every request the same way.

The handler is driven with fake Envoy message streams (no Envoy, no gRPC
server), and its answer is set beside what ``explain`` says for the same
request: refused or answered with the same status and code, or routed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.accounting.budgets import Budgets
from sidecar.config.schema import parse
from sidecar.handlers.extproc import Processor
from sidecar.payload import response_ids
from sidecar.routing import explain, snapshot
from sidecar.routing.ingress import INGRESSES
from sidecar.routing.snapshot import Snapshot

TEMPLATE = Path(__file__).resolve().parents[2] / "sidecar" / "templates" / "ab-testing.yaml"
KEYED = """
proxy: {passthrough_backend: a}
backends:
  - {name: a, url: "http://127.0.0.1:1", models: [m, n]}
  - {name: b, url: "http://127.0.0.1:2", models: [m]}
api_keys:
  - {key: sk-all, id: all}
  - {key: sk-a, id: only-a, allowed_backends: [a]}
"""


class Runtime:
    """What the handler reads from the serving process, with no monitor."""

    def __init__(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self.budgets = Budgets(lambda: snap)
        self.http_session = None

    def backend_states(self) -> dict:
        return {}

    def count_request(self) -> None:
        pass

    def exports_traces(self) -> bool:
        return False

    def report_response(self, backend: str, status: int | None) -> None:
        pass


def _messages(method: str, path: str, headers: dict[str, str], body: bytes) -> list[pb.ProcessingRequest]:
    entries = [base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1"))
               for k, v in {":method": method, ":path": path, **headers}.items()]
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=entries), end_of_stream=not body))
    if not body:
        return [first]
    return [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


async def _stream(items: list[pb.ProcessingRequest]):
    for item in items:
        yield item


def handler_verdict(snap: Snapshot, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple:
    """``("refused", status, code)``, ``("answered", status)`` or ``("routed",)`` from the handler's answers."""

    async def run() -> list[pb.ProcessingResponse]:
        return [a async for a in Processor(Runtime(snap)).Process(_stream(_messages(method, path, headers, body)), None)]

    for answer in asyncio.run(run()):
        if answer.HasField("immediate_response"):
            status = answer.immediate_response.status.code
            if status < 400:
                return ("answered", status)
            error = orjson.loads(answer.immediate_response.body).get("error", {})
            return ("refused", status, error.get("code") or error.get("type"))
        mutation = answer.request_body if answer.HasField("request_body") else answer.request_headers
        if mutation.response.HasField("header_mutation") and mutation.response.header_mutation.set_headers:
            return ("routed",)
    raise AssertionError("the handler neither answered nor routed the request")


def explain_verdict(snap: Snapshot, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple:
    spec = explain.RequestSpec(method, path, headers, body)
    out = explain.explain(snap, spec, {}, 0.0, 0.0, live=False)["outcome"]
    if "backend" in out:
        return ("routed",)
    return ("refused", out["status"], out["code"]) if "code" in out else ("answered", out["status"])


def _requests(snap: Snapshot) -> list[tuple[str, str, dict[str, str], bytes]]:
    """Every path shape: each ingress, listings, follow-ups, passthrough, bad paths."""
    model = next(iter(sorted(snap.config.model_experiments, key=lambda e: e.name)), None)
    name = model.model if model is not None else snap.config.backends[0].models[0]
    owner = response_ids.Owner(snap.config.backends[0].name, name, False, "")
    tagged = response_ids.tag(owner, "resp_upstream", snap.id_key)
    json_body = orjson.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}], "input": "hi",
                              "prompt": "hi", "query": "q", "documents": ["d"]})
    out = []
    for ingress in INGRESSES.values():
        if ingress.body == "json":
            out.append(("POST", ingress.path, {"content-type": "application/json"}, json_body))
        elif ingress.body == "query":
            out.append(("GET", f"{ingress.path}?model={name}", {}, b""))
        else:
            form = (b"--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + name.encode() + b"\r\n--x--\r\n")
            out.append(("POST", ingress.path, {"content-type": "multipart/form-data; boundary=x"}, form))
    out += [
        ("GET", "/v1/models", {}, b""),
        ("GET", f"/v1/models/{name}", {}, b""),
        ("GET", "/v1/models/no-such-model", {}, b""),
        ("GET", "/anthropic/v1/models", {}, b""),
        ("GET", "/v1/responses/resp_abc", {}, b""),
        ("GET", f"/v1/responses/{tagged}", {}, b""),
        ("DELETE", f"/v1/responses/{tagged}", {}, b""),
        ("POST", f"/v1/responses/{tagged}/cancel", {}, b""),
        ("GET", f"/v1/responses/{tagged}/input_items", {}, b""),
        ("POST", "/v1/unknown", {"content-type": "application/json"}, json_body),
        ("GET", "/health", {}, b""),
        ("POST", "/v1/chat/%2e%2e/completions", {"content-type": "application/json"}, json_body),
        ("POST", "/v1/chat/completions", {"content-type": "application/json", "content-encoding": "gzip"}, json_body),
        ("POST", "/v1/chat/completions", {"content-type": "application/json"}, b'{"model": 3}'),
    ]
    return out


def _snapshots() -> list[tuple[str, Snapshot, list[dict[str, str]]]]:
    template = snapshot.build(parse(TEMPLATE.read_text(), env={}).config)
    keyed = snapshot.build(parse(KEYED, env={}).config)
    return [
        ("ab-testing", template, [{}]),
        ("keyed", keyed, [{}, {"authorization": "Bearer sk-all"}, {"authorization": "Bearer sk-a"},
                          {"authorization": "Bearer sk-wrong"}]),
    ]


CASES = [
    pytest.param(snap, method, path, {**creds, **headers}, body, id=f"{name}:{method} {path}:{i}")
    for name, snap, all_creds in _snapshots()
    for i, creds in enumerate(all_creds)
    for method, path, headers, body in _requests(snap)
]


@pytest.mark.parametrize(("snap", "method", "path", "headers", "body"), CASES)
def test_the_handler_and_explain_agree(snap, method, path, headers, body):
    assert handler_verdict(snap, method, path, headers, body) == explain_verdict(snap, method, path, headers, body)


def test_a_follow_up_is_routed_by_its_id_in_explain_too():
    # explain once answered 404 unknown_endpoint here; the live path routes it.
    name, snap, _ = _snapshots()[0]
    method, path, headers, body = next(r for r in _requests(snap) if r[0] == "GET" and "/v1/responses/resp_mr2" in r[1])
    assert explain_verdict(snap, method, path, headers, body) == ("routed",)


def test_an_experiment_request_without_a_json_body_is_remembered_for_feedback():
    snap = snapshot.build(parse("""
feedback_metrics: [{name: thumbs_up, type: boolean}]
backends: [{name: a, url: "http://127.0.0.1:1", models: [img-a]}]
model_experiments:
  - {name: img, model: images, variants: [{id: only, model: img-a, weight: 1}]}
""", env={}).config)
    processor = Processor(Runtime(snap))
    body = b'--B\r\ncontent-disposition: form-data; name="model"\r\n\r\nimages\r\n--B--\r\n'
    messages = _messages("POST", "/v1/images/edits", {"content-type": "multipart/form-data; boundary=B",
                                                      "x-request-id": "req-1"}, body)

    async def run() -> object:
        [a async for a in processor.Process(_stream(messages), None)]
        return await processor.requests.feedback.join.find(snap.config, "req-1")

    served = asyncio.run(run())
    assert served is not None and (served.experiment, served.variant) == ("img", "only")


def test_a_request_refused_after_its_decision_counts_no_shadow_copy_and_one_refusal():
    # 32 headers is Envoy's floor; the route's own headers take this request past it: 431.
    snap = snapshot.build(parse("""
envoy: {max_request_headers: 32}
backends: [{name: a, url: "http://127.0.0.1:1", models: [m1, m2]}]
model_experiments:
  - {name: e, model: chat, variants: [{id: control, model: m1, weight: 1}, {id: cand, model: m2, shadow: {share: 1.0}}]}
""", env={}).config)
    from sidecar import metrics

    def counts() -> tuple[float, float, float]:
        value = metrics.REGISTRY.get_sample_value
        return (value("model_experiment_shadow_copies_total", {"experiment": "e", "variant": "cand"}) or 0.0,
                value("model_router_decisions_total", {"outcome": "431"}) or 0.0,
                value("model_router_decisions_total", {"outcome": "routed"}) or 0.0)

    body = orjson.dumps({"model": "chat", "messages": []})
    before = counts()
    headers = {f"x-pad-{i}": "v" for i in range(29)}
    assert handler_verdict(snap, "POST", "/v1/chat/completions", headers, body)[:2] == ("refused", 431)
    assert tuple(a - b for a, b in zip(counts(), before)) == (0.0, 1.0, 0.0)
    assert handler_verdict(snap, "POST", "/v1/chat/completions", {}, body) == ("routed",)
    assert tuple(a - b for a, b in zip(counts(), before)) == (1.0, 1.0, 1.0)

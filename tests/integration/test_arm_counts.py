"""Per-arm counts are exact with every feature on (tests/support/realistic.py):
Envoy's own 503 and 504 on an arm count on that arm, and a reserved refusal
is counted only where the name really is reserved."""

from __future__ import annotations

import httpx
import pytest

from ..conftest import metered, metric
from ..support.realistic import RESERVED, realistic  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration

FULL = {"authorization": "Bearer key-full"}
# Ingresses that do not apply model_aliases, with a body each accepts.
LITERAL = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/images/generations",
           "/v1/rerank", "/embed_sparse")


def body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
            "query": "q", "documents": ["d"]}


def arm_of(stack, caller: str) -> str:
    r = httpx.post(stack.url + "/v1/chat/completions", json=body("other"), timeout=30,
                   headers={**FULL, "x-caller": caller, "x-demo-status": "418"})
    return r.headers["x-continuum-experiment-variant"]


def server_errors(stack, variant: str) -> float:
    return metric(stack, "model_experiment_requests_total", experiment="other-ab", variant=variant,
                  status="server_error")


def test_envoys_503_and_504_on_arms_count_on_those_arms(realistic):  # noqa: F811
    callers: dict[str, str] = {}
    for i in range(64):
        callers.setdefault(arm_of(realistic, f"c{i}"), f"c{i}")
        if len(callers) == 2:
            break
    assert set(callers) == {"live", "gone"}
    before = {v: server_errors(realistic, v) for v in callers}
    refused = httpx.post(realistic.url + "/v1/chat/completions", json=body("other"), timeout=30,
                         headers={**FULL, "x-caller": callers["gone"]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "upstream_unavailable"
    slow = httpx.post(realistic.url + "/v1/chat/completions", json=body("other"), timeout=30,
                      headers={**FULL, "x-caller": callers["live"], "x-demo-delay-ms": "4000"})
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "upstream_timeout"
    assert metered(realistic)
    assert {v: server_errors(realistic, v) - before[v] for v in callers} == {"live": 1, "gone": 1}


def test_reserved_refusals_count_reserved_names_only(realistic):  # noqa: F811
    def refusals() -> float:
        return metric(realistic, "model_experiment_reserved_refusals_total", experiment="chat-ab")

    for path in LITERAL:
        before = refusals()
        unknown = httpx.post(realistic.url + path, json=body("no-such-model"), headers=FULL, timeout=30)
        assert unknown.status_code == 404
        for name in (*RESERVED, "sneaky"):
            r = httpx.post(realistic.url + path, json=body(name), headers=FULL, timeout=30)
            assert r.status_code == 404, (path, name, r.text)
            assert r.content == unknown.content.replace(b"no-such-model", name.encode()), (path, name)
        assert metered(realistic)
        # Five reserved names; the alias is just an unknown name where aliases do not apply.
        assert refusals() - before == len(RESERVED), path
    # Where aliases apply, the alias of a reserved model is a reserved refusal.
    before = refusals()
    r = httpx.post(realistic.url + "/v1/responses", json={"model": "sneaky", "input": "hi"}, headers=FULL, timeout=30)
    assert r.status_code == 404
    assert metric(realistic, "model_experiment_reserved_refusals_total", experiment="chat-ab") == before + 1

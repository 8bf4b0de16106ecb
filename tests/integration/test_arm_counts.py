"""Per-arm counts are exact with every feature on (tests/support/realistic.py):
Envoy's own 503 and 504 on an arm count on that arm, through every ingress
that runs experiments, streamed or not, by name, suffix or alias, and nothing
else moves; a reserved refusal is counted only where the name really is
reserved."""

from __future__ import annotations

import httpx
import pytest

from ..conftest import metered, metric
from ..support.realistic import RESERVED, otlp_receiver, realistic  # noqa: F401  (the fixtures)

pytestmark = pytest.mark.integration

FULL = {"authorization": "Bearer key-full"}
# Ingresses that do not apply model_aliases, with a body each accepts.
LITERAL = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/images/generations",
           "/v1/rerank", "/embed_sparse")


NARROW = {"authorization": "Bearer key-narrow"}
# Ingresses that run experiments, and the names each resolves to other-ab:
# suffixes apply on chat, model_aliases on Responses and Anthropic's Messages.
EXPERIMENTED = {
    "/v1/chat/completions": ("other", "other:nitro"),
    "/v1/completions": ("other",),
    "/v1/embeddings": ("other",),
    "/v1/responses": ("other", "via-alias"),
    "/v1/responses/compact": ("other",),
    "/anthropic/v1/messages": ("other", "via-alias"),
    "/v1/messages": ("other",),
    "/v1/images/generations": ("other",),
}
ARMS = {"other-ab": ("live", "gone"), "chat-ab": ("control", "candidate")}
CLASSES = ("success", "client_error", "server_error")


def body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "input": "hi",
            "query": "q", "documents": ["d"], "max_tokens": 8, **extra}


def arm_of(stack, caller: str) -> str:
    r = httpx.post(stack.url + "/v1/chat/completions", json=body("other"), timeout=30,
                   headers={**FULL, "x-caller": caller, "x-demo-status": "418"})
    return r.headers["x-continuum-experiment-variant"]


def server_errors(stack, variant: str) -> float:
    return metric(stack, "model_experiment_requests_total", experiment="other-ab", variant=variant,
                  status="server_error")


def one_caller_per_arm(stack) -> dict[str, str]:
    """A caller key for each of other-ab's two arms."""
    callers: dict[str, str] = {}
    for i in range(64):
        callers.setdefault(arm_of(stack, f"c{i}"), f"c{i}")
        if len(callers) == 2:
            break
    assert set(callers) == {"live", "gone"}
    return callers


def test_envoys_503_and_504_on_arms_count_on_those_arms(realistic):  # noqa: F811
    callers = one_caller_per_arm(realistic)
    before = {v: server_errors(realistic, v) for v in callers}
    refused = httpx.post(realistic.url + "/v1/chat/completions", json=body("other"), timeout=30,
                         headers={**FULL, "x-caller": callers["gone"]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "upstream_unavailable"
    slow = httpx.post(realistic.url + "/v1/chat/completions", json=body("other"), timeout=30,
                      headers={**FULL, "x-caller": callers["live"], "x-demo-delay-ms": "4000"})
    assert slow.status_code == 504 and slow.json()["error"]["code"] == "upstream_timeout"
    assert metered(realistic)
    assert {v: server_errors(realistic, v) - before[v] for v in callers} == {"live": 1, "gone": 1}


def counts(stack) -> dict[tuple[str, str, str], float]:
    return {(e, v, c): metric(stack, "model_experiment_requests_total", experiment=e, variant=v, status=c)
            for e, variants in ARMS.items() for v in variants for c in CLASSES}


def moved(stack, before: dict) -> dict:
    return {k: n - before[k] for k, n in counts(stack).items() if n != before[k]}


def test_503_and_504_count_on_their_arms_through_every_ingress_and_name(realistic, otlp_receiver):  # noqa: F811
    callers = one_caller_per_arm(realistic)
    errors = metric(realistic, "model_router_stream_errors_total")
    sent = []
    for path, names in EXPERIMENTED.items():
        for name in names:
            for stream in (False, True):
                case = (path, name, stream)
                before = counts(realistic)
                extra = {"stream": True} if stream else {}
                # The key with a token budget on other-ab meets the closed port; the other a silent engine.
                refused = httpx.post(realistic.url + path, json=body(name, **extra), timeout=30,
                                     headers={**FULL, "x-caller": callers["gone"]})
                slow = httpx.post(realistic.url + path, json=body(name, **extra), timeout=30,
                                  headers={**NARROW, "x-caller": callers["live"], "x-demo-delay-ms": "4000"})
                assert (refused.status_code, slow.status_code) == (503, 504), case
                sent += [refused.headers["x-request-id"], slow.headers["x-request-id"]]
                assert metered(realistic)
                assert moved(realistic, before) == {("other-ab", "gone", "server_error"): 1,
                                                    ("other-ab", "live", "server_error"): 1}, case
    # chat-ab (hidden arms, a budget for one key, the cache): a silent engine on each arm.
    for path in ("/v1/chat/completions", "/v1/responses", "/anthropic/v1/messages"):
        before = counts(realistic)
        for key in (FULL, NARROW):
            slow = httpx.post(realistic.url + path, json=body("chat"), timeout=30,
                              headers={**key, "x-demo-delay-ms": "4000"})
            assert slow.status_code == 504, path
            sent.append(slow.headers["x-request-id"])
        assert metered(realistic)
        assert moved(realistic, before) == {("chat-ab", "control", "server_error"): 1,
                                            ("chat-ab", "candidate", "server_error"): 1}, path
    assert metric(realistic, "model_router_stream_errors_total") == errors  # no accounting step failed
    # Tracing saw every one of them, as the failure it was.
    spans = otlp_receiver.wait_for(lambda sp: sp["attributes"].get("router.request_id") == sent[-1])
    assert spans
    traced = {sp["attributes"].get("router.request_id"): sp["attributes"].get("http.response.status_code")
              for sp in otlp_receiver.spans}
    assert all(traced.get(rid) in (503, 504) for rid in sent), [(rid, traced.get(rid)) for rid in sent]


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

"""Structured logs: with JSON lines at debug, every decision and refusal is one
JSON object on the sidecar's stderr, with the arm and models, and no key."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import orjson
import pytest

from sidecar.accounting import logs
from sidecar.accounting.metering import Entry

from ..support.configs import SPLIT_ARMS, split_config

KEY = "sk-log-team-very-secret-0123"
WRONG_KEY = "sk-wrong-key-also-secret-4567"
CONFIG = split_config("""
metering: {flush_interval_ms: 100}
api_keys:
  - {id: team-a, key: %s}
""") % KEY
ARM = SPLIT_ARMS


def _json_lines(text: str) -> list[dict]:
    """Every line of a sidecar's output (standard output and error), parsed."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        out.append(orjson.loads(line))  # a line that is not JSON fails the test here
    return out


def _wait_lines(stack, predicate, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in _json_lines(stack.log("sidecar-0")) if predicate(x)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(stack_factory):
    return stack_factory(CONFIG, sidecar_env={"MODEL_ROUTER_LOG_FORMAT": "json", "MODEL_ROUTER_LOG_LEVEL": "DEBUG"})


@pytest.mark.integration
def test_json_lines_for_decisions_and_refusals_never_a_key(stack):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "one two three"}], extra_headers={"x-caller": "logs"})
    arm = raw.headers["x-continuum-experiment-variant"]
    routed_id = raw.headers["x-request-id"]
    refused = httpx.post(stack.url + "/v1/chat/completions", json={"model": "nope", "messages": []},
                         headers={"authorization": f"Bearer {KEY}"})
    assert refused.status_code == 404
    unauthorized = httpx.post(stack.url + "/v1/chat/completions", json={"model": "chat", "messages": []},
                              headers={"authorization": f"Bearer {WRONG_KEY}", "x-api-key": WRONG_KEY})
    assert unauthorized.status_code == 401

    [decision] = _wait_lines(stack, lambda x: x.get("request_id") == routed_id)
    model, backend = ARM[arm]
    assert decision["level"] == "debug" and decision["msg"] == "decision"
    assert decision["logger"] == "model_router.decisions"
    assert {k: decision.get(k) for k in (
        "ingress", "key_id", "client_model", "experiment", "variant", "upstream_model", "backend", "status", "kind",
    )} == {
        "ingress": "/v1/chat/completions", "key_id": "team-a", "client_model": "chat", "experiment": "split",
        "variant": arm, "upstream_model": model, "backend": backend, "status": 200, "kind": "routed",
    }
    assert decision["ts"].endswith("+00:00") and decision["prompt_tokens"] == 3

    [not_found] = _wait_lines(stack, lambda x: x.get("request_id") == refused.headers["x-request-id"])
    assert (not_found["level"], not_found["msg"], not_found["status"], not_found["refusal"]) == (
        "info", "refusal", 404, "model_not_found")
    [denied] = _wait_lines(stack, lambda x: x.get("request_id") == unauthorized.headers["x-request-id"])
    assert (denied["level"], denied["status"], denied["refusal"]) == ("info", 401, "unauthorized")
    assert "key_id" not in denied

    text = stack.log("sidecar-0")
    assert any(x["level"] == "info" and x["logger"] == "model_router.server" for x in _json_lines(text))
    # The readiness line is a JSON record too, not a plain line in the stream.
    assert any(x["msg"].startswith("model-router sidecar ready") for x in _json_lines(text))
    for secret in (KEY, WRONG_KEY, "Bearer"):
        assert secret not in text


def test_text_is_the_default_and_fields_follow_the_message(monkeypatch, capsys):
    monkeypatch.delenv("MODEL_ROUTER_LOG_FORMAT", raising=False)
    assert logs.log_format() == "text" and logs.log_format("json") == "json"
    monkeypatch.setenv("MODEL_ROUTER_LOG_FORMAT", "json")
    assert logs.log_format() == "json"
    with pytest.raises(SystemExit):
        logs.log_format("xml")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        monkeypatch.setenv("MODEL_ROUTER_LOG_LEVEL", "INFO")
        logs.setup("text")
        entry = Entry({"kind": "refusal", "refusal": "unauthorized", "request_id": "r1"}, 401, 0.0, None, 0.001,
                      None, None, False, False)
        logs.DecisionLog().observe(entry)
        logs.DecisionLog().observe(Entry({"kind": "routed", "request_id": "r2"}, 200, 0.0, None, 0.001,
                                         None, None, False, False))  # debug: not shown at info
        err = capsys.readouterr().err
        assert "INFO model_router.decisions: refusal request_id=r1 kind=refusal refusal=unauthorized status=401" in err
        assert "r2" not in err
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_sidecar_that_cannot_start_says_why_in_json(tmp_path, workers):
    """Under the JSON format even the reason a sidecar cannot start is a JSON
    record (one worker: the gRPC listen fails; several: the supervisor's check)."""
    import socket
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    config.write_text('backends: [{name: a, url: "http://127.0.0.1:9", models: [m]}]\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "sidecar", "serve", "--config", str(config), "--log-format", "json",
                              "--workers", workers, "--grpc-listen", f"127.0.0.1:{port}",
                              "--admin-listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    records = _json_lines(out.stdout + out.stderr)
    assert any(f"127.0.0.1:{port}" in r["msg"] and r["level"] in ("error", "critical") for r in records), records

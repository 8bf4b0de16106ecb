"""Shadow arms through real Envoy: callers never see them, the candidate's
engine gets its share of copies with its own model, and its metrics move."""

from __future__ import annotations

import math
import socket
import threading
import time

import httpx
import orjson
import pytest

from sidecar.devstack.stack import free_port

from ..conftest import clear_demo_requests, demo_requests, envoy_stat, metered, metric

CHAT = "/v1/chat/completions"
SHARE = 0.3


class Silent:
    """A backend that takes connections and never answers (the request sits in its socket buffer)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.held: list[socket.socket] = []
        self.posts = 0  # connections whose request is a POST (not the monitor's probes)
        self.closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.held.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            first = conn.recv(4)
        except OSError:
            return
        if first == b"POST":
            with self.lock:
                self.posts += 1

    def release(self) -> None:
        """Close the connections held so far: the requests on them fail."""
        with self.lock:
            held, self.held = self.held, []
        for c in held:
            c.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        self.release()


def config(dead: str, silent: str, shadows: bool) -> str:
    def arm(text: str) -> str:
        return f", {text}" if shadows else ""

    return f"""
backends:
  - {{name: live, url: "demo://", models: [m-live]}}
  - {{name: cand, url: "demo://", models: [m-cand]}}
  - {{name: dead, url: "http://{dead}", models: [m-dead]}}
  - {{name: silent, url: "http://{silent}", models: [m-silent]}}
metering: {{flush_interval_ms: 50}}
cache: {{models: [chat-cached]}}
limits: [{{model: chat-budget, tokens: 1000000}}]
model_experiments:
  - name: share
    model: chat
    response_headers: true
    variants: [{{id: control, model: m-live, weight: 1}}{arm(f"{{id: cand, model: m-cand, shadow: {{share: {SHARE}}}}}")}]
  - name: full
    model: chat-full
    variants: [{{id: control, model: m-live, weight: 1}}{arm("{id: cand, model: m-cand, shadow: {share: 1}}")}]
  - name: dead
    model: chat-dead
    variants: [{{id: control, model: m-live, weight: 1}}{arm("{id: gone, model: m-dead, shadow: {share: 1}}")}]
  - name: slow
    model: chat-slow
    variants: [{{id: control, model: m-live, weight: 1}}{arm("{id: stuck, model: m-silent, shadow: {share: 1, max_in_flight: 2}}")}]
  - name: budget
    model: chat-budget
    variants: [{{id: control, model: m-live, weight: 1}}{arm("{id: cand, model: m-cand, shadow: {share: 1}}")}]
  - name: cached
    model: chat-cached
    variants: [{{id: control, model: m-live, weight: 1}}{arm("{id: cand, model: m-cand, shadow: {share: 1}}")}]
"""


@pytest.fixture(scope="module")
def silent():
    s = Silent()
    yield s
    s.close()


@pytest.fixture(scope="module")
def stacks(stack_factory, tmp_path_factory, silent):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    usage = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    shadowed = stack_factory(config(dead, silent.addr, True), usage_records=usage)
    plain = stack_factory(config(dead, silent.addr, False))
    return shadowed, plain, usage


def ask(stack, model: str, content: str = "hi", stream: bool = False, key: str = "k1") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    return httpx.post(stack.url + CHAT, json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


def posts(stack, backend: str) -> list[dict]:
    return [r for r in demo_requests(stack, backend) if r["method"] == "POST"]


def settled(stack, cluster: str, timeout: float = 60.0) -> int:
    """The copies Envoy sent to ``cluster`` once every one has finished and
    the sidecar has counted it."""
    deadline = time.monotonic() + timeout
    while True:
        sent = envoy_stat(stack, f"cluster.{cluster}.upstream_rq_total", exact=True)
        done = envoy_stat(stack, f"cluster.{cluster}.upstream_rq_completed", exact=True)
        counted = metric(stack, "model_experiment_shadow_requests_total", experiment=cluster.split("~", 1)[1])
        if sent == done == counted or time.monotonic() > deadline:
            return int(sent)
        time.sleep(0.05)


def visible(r: httpx.Response) -> tuple:
    """What a caller receives, but the values that differ per request anyway."""
    skip = {"date", "x-request-id", "x-envoy-upstream-service-time"}
    return r.status_code, sorted((k, v) for k, v in r.headers.items() if k not in skip), r.content


def test_callers_receive_the_same_bytes_with_and_without_a_shadow(stacks):
    shadowed, plain, _ = stacks
    for model, stream in (("chat-full", False), ("chat-full", True), ("chat-dead", False), ("chat-dead", True),
                          ("chat-slow", False), ("chat-slow", True)):
        with_shadow = ask(shadowed, model, "same words", stream)
        without = ask(plain, model, "same words", stream)
        assert with_shadow.status_code == 200
        assert visible(with_shadow) == visible(without), (model, stream)


def test_the_candidate_gets_its_share_with_its_own_model(stacks):
    shadowed, _, _ = stacks
    settled(shadowed, "shadow~share")
    clear_demo_requests(shadowed)
    before = settled(shadowed, "shadow~share")
    live_before = metric(shadowed, "model_experiment_requests_total", experiment="share")
    n = 300
    for i in range(n):
        r = ask(shadowed, "chat", f"question {i}", key=f"caller-{i}")
        assert r.status_code == 200 and r.json()["model"] == "m-live"
        assert "x-model-router-shadow" not in r.headers
        assert r.headers["x-continuum-experiment-variant"] == "control"
    copies = settled(shadowed, "shadow~share") - before
    # Five standard deviations of a binomial(n, share): a correct draw fails this about once in 1.7 million runs.
    assert abs(copies - n * SHARE) <= 5 * math.sqrt(n * SHARE * (1 - SHARE)), copies
    got = posts(shadowed, "cand")
    assert len(got) == copies
    assert all(r["json"]["model"] == "m-cand" for r in got)
    assert not any(k.startswith("x-model-router-") for r in got for k in r["headers"])
    live = posts(shadowed, "live")
    assert not any(k.startswith("x-model-router-") for r in live for k in r["headers"])
    # Each copy is a request a caller made: the question it carries is one the live engine saw.
    asked = {r["json"]["messages"][0]["content"] for r in live}
    assert all(r["json"]["messages"][0]["content"] in asked for r in got)
    # The live arm counts callers only.
    assert metric(shadowed, "model_experiment_requests_total", experiment="share") - live_before == n


def test_shadow_metrics_and_usage_records_move(stacks):
    shadowed, _, usage = stacks
    before = {s: metric(shadowed, "model_experiment_shadow_requests_total", experiment="full", status=s)
              for s in ("success", "server_error")}
    tokens = metric(shadowed, "model_experiment_shadow_tokens_total", experiment="full", kind="completion")
    ttft = metric(shadowed, "model_experiment_shadow_time_to_first_token_seconds_count", experiment="full")
    ids = [ask(shadowed, "chat-full", "count me", stream).headers["x-request-id"] for stream in (False, True)]
    settled(shadowed, "shadow~full")
    assert metric(shadowed, "model_experiment_shadow_requests_total", experiment="full", status="success") == before["success"] + 2
    assert metric(shadowed, "model_experiment_shadow_requests_total", experiment="full", status="server_error") == before["server_error"]
    assert metric(shadowed, "model_experiment_shadow_tokens_total", experiment="full", kind="completion") > tokens
    assert metric(shadowed, "model_experiment_shadow_time_to_first_token_seconds_count", experiment="full") == ttft + 1
    assert metric(shadowed, "model_experiment_shadow_request_duration_seconds_count", experiment="full") >= 2
    records = [orjson.loads(line) for line in usage.read_bytes().splitlines()]
    for rid in ids:
        mine = [r for r in records if r.get("request_id") == rid]
        live = [r for r in mine if not r.get("shadow")]
        copy = [r for r in mine if r.get("shadow")]
        assert [r["experiment_variant_id"] for r in live] == ["control"]
        assert [(r["experiment_variant_id"], r["upstream_model"], r["status"]) for r in copy] == [("cand", "m-cand", 200)]
        assert copy[0]["completion_tokens"] > 0


def test_a_dead_shadow_backend_changes_nothing_for_callers_and_shows_as_undelivered(stacks):
    shadowed, _, _ = stacks
    copies = metric(shadowed, "model_experiment_shadow_copies_total", experiment="dead")
    for i in range(5):
        r = ask(shadowed, "chat-dead", f"q{i}")
        assert r.status_code == 200 and r.json()["model"] == "m-live"
    assert metric(shadowed, "model_experiment_shadow_copies_total", experiment="dead") == copies + 5
    # Envoy fails each copy at the connection, mostly before the shadow filter's
    # stream reaches the sidecar (one that does counts as a server error).
    deadline = time.monotonic() + 30
    while envoy_stat(shadowed, "cluster.shadow~dead.upstream_cx_connect_fail", exact=True) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert envoy_stat(shadowed, "cluster.shadow~dead.upstream_cx_connect_fail", exact=True) >= 5
    assert metric(shadowed, "model_experiment_shadow_requests_total", experiment="dead", status="success") == 0
    assert metric(shadowed, "model_experiment_shadow_requests_total", experiment="dead") <= copies + 5


def test_a_silent_shadow_backend_holds_at_most_its_cap_and_callers_go_on(stacks, silent):
    shadowed, _, _ = stacks
    # The cap drops a copy through either breaker: past max_pending_requests while
    # it waits for a connection, or past max_requests when one is free (which of
    # the two depends on whether the pool's connections were up at that moment).
    overflows = ("cluster.shadow~slow.upstream_rq_pending_overflow", "cluster.shadow~slow.upstream_rq_active_overflow")

    def dropped() -> int:
        return sum(envoy_stat(shadowed, name, exact=True) for name in overflows)

    # Earlier tests' copies may still hold the cap: end them (a pending one
    # that then reaches a connection too), and start from an empty cap so
    # that only this test's copies are counted.
    deadline = time.monotonic() + 60
    while True:
        silent.release()
        if not (envoy_stat(shadowed, "cluster.shadow~slow.upstream_rq_active", exact=True)
                or envoy_stat(shadowed, "cluster.shadow~slow.upstream_rq_pending_active", exact=True)):
            break
        assert time.monotonic() < deadline, "earlier copies still hold the shadow cap"
        time.sleep(0.05)
    with silent.lock:
        silent.posts = 0
    copies_before = metric(shadowed, "model_experiment_shadow_copies_total", experiment="slow")
    dropped_before = dropped()
    for i in range(8):
        r = ask(shadowed, "chat-slow", f"q{i}", stream=bool(i % 2))
        assert r.status_code == 200
    # Every caller was answered while the candidate answered none of its copies:
    # Envoy kept at most max_in_flight of them on the candidate's connections, as
    # many waiting for one, and dropped the rest.
    copies = metric(shadowed, "model_experiment_shadow_copies_total", experiment="slow") - copies_before
    assert copies == 8

    def held() -> float:
        return copies - (dropped() - dropped_before)

    deadline = time.monotonic() + 60
    while (held() > 4 or not silent.posts) and time.monotonic() < deadline:
        time.sleep(0.05)
    # (On failure, Envoy's own account of the copies: the shadow clusters' stats and the shadow filter's.)
    assert 2 <= held() <= 4, httpx.get(f"http://{shadowed.envoy_admin}/stats", params={"filter": "shadow"}).text
    assert envoy_stat(shadowed, "cluster.shadow~slow.upstream_rq_active", exact=True) <= 2
    assert envoy_stat(shadowed, "cluster.shadow~slow.upstream_rq_pending_active", exact=True) <= 2
    assert 1 <= silent.posts <= 2  # one copy per connection, at most max_in_flight connections


def test_the_shadow_answer_never_reaches_the_cache(stacks):
    shadowed, _, _ = stacks
    first = ask(shadowed, "chat-cached", "cache me")
    settled(shadowed, "shadow~cached")
    again = ask(shadowed, "chat-cached", "cache me")
    assert again.headers.get("x-model-router-cache") == "hit"
    assert again.json()["model"] == first.json()["model"] == "m-live"
    assert again.json()["choices"] == first.json()["choices"]


def test_the_shadow_is_never_charged_to_the_callers_budget(stacks):
    shadowed, _, _ = stacks
    first = ask(shadowed, "chat-budget", "spend some tokens please")
    assert first.status_code == 200
    settled(shadowed, "shadow~budget")
    metered(shadowed)
    assert metric(shadowed, "model_experiment_shadow_tokens_total", experiment="budget", kind="completion") > 0
    second = ask(shadowed, "chat-budget", "again")
    spent = int(second.headers["x-ratelimit-limit-tokens"]) - int(second.headers["x-ratelimit-remaining-tokens"])
    assert spent == first.json()["usage"]["total_tokens"]  # the caller's own tokens, not its copy's too


def test_a_client_cannot_ask_for_a_copy(stacks):
    # The shadow header is the router's: Envoy strips a client's before any
    # route matches, so naming a shadow cluster copies nothing.
    shadowed, _, _ = stacks
    settled(shadowed, "shadow~full")
    clear_demo_requests(shadowed)
    before = settled(shadowed, "shadow~full")
    body = {"model": "m-live", "messages": [{"role": "user", "content": "copy me"}]}
    for value in ("shadow~full", "SHADOW~FULL", "shadow~full, shadow~full"):
        for name in ("x-model-router-shadow", "X-Model-Router-Shadow"):
            r = httpx.post(shadowed.url + CHAT, json=body, headers={name: value}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == "m-live"
    assert settled(shadowed, "shadow~full") == before
    assert posts(shadowed, "cand") == []

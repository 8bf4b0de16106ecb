"""``serve --workers N``: one sidecar process per worker, supervised.

Worker ``i`` serves the configured gRPC and admin ports plus ``i`` and is one
endpoint of Envoy's ext_proc cluster. The supervisor:

- restarts a worker that died, with the backoff of :mod:`sidecar.serve.restarts`,
  and exits 1 once one keeps dying (the others serve meanwhile);
- recycles a worker that has answered ``server.max_requests_per_worker``
  requests: it starts the replacement on the slot's other gRPC port (the
  generations alternate between the two; Envoy's cluster lists both and
  health-checks them) and the same admin port (both bind it with
  ``SO_REUSEPORT``). Once the replacement is ready the old worker drains: it
  reports NOT_SERVING, waits until Envoy's health check has seen that and sends
  it no new streams, then finishes what it has in flight and exits;
- forwards SIGTERM/SIGINT, then waits for every worker to drain;
- on Linux, takes its workers with it when it dies however it dies (even
  SIGKILL, which it cannot forward): each worker asks the kernel for SIGTERM
  when its parent goes (``PR_SET_PDEATHSIG``) and drains on it.

Workers talk back over a pipe named by ``MODEL_ROUTER_SUPERVISOR_FD``: one
line ``ready`` once serving, one line ``recycle`` when due.
"""

from __future__ import annotations

import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType

from ..config import address
from .restarts import RestartPolicy, Restarts

log = logging.getLogger("model_router.workers")

FD_ENV = "MODEL_ROUTER_SUPERVISOR_FD"
CRASHES_ENV = "MODEL_ROUTER_WORKER_CRASHES"
RECYCLES_ENV = "MODEL_ROUTER_WORKER_RECYCLES"


def supervised() -> bool:
    """Whether this process is a worker of a supervisor (and so shares its ports)."""
    return FD_ENV in os.environ


def notify(event: str) -> None:
    """Tell the supervisor, if any: ``ready`` or ``recycle``."""
    fd = os.environ.get(FD_ENV)
    if fd is not None:
        try:
            os.write(int(fd), event.encode() + b"\n")
        except OSError:
            pass  # the supervisor is gone; nothing to tell


def restarts_so_far() -> dict[str, int]:
    """How often this worker's slot was restarted before this process, by reason."""
    return {"crash": int(os.environ.get(CRASHES_ENV, "0")), "recycle": int(os.environ.get(RECYCLES_ENV, "0"))}


_PR_SET_PDEATHSIG = 1


def _with_parent(parent: int) -> Callable[[], None] | None:
    """What a forked worker runs before it starts: SIGTERM when the supervisor
    dies (kept across exec), so no worker outlives it; None where the kernel
    has no such request."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request: nobody would send the signal
            os._exit(1)

    return arm


def port_in_use(addr: str) -> bool:
    host, port = address.split(addr)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass
class _Child:
    popen: subprocess.Popen[bytes]
    fd: int
    standby: bool  # on the slot's second gRPC port
    buffer: bytes = b""


@dataclass
class _Slot:
    index: int
    restarts: Restarts
    current: _Child | None = None
    replacement: _Child | None = None  # started for a recycle, not ready yet
    retiring: list[_Child] = field(default_factory=list)
    restart_at: float | None = None
    gave_up: bool = False
    port_standby: bool = False  # the port a restart after a crash takes
    recycle_due: bool = False
    crashes: int = 0
    recycles: int = 0


class Supervisor:
    def __init__(
        self, argv: Callable[[int, bool], list[str]], count: int, policy: RestartPolicy | None = None
    ) -> None:
        self.argv = argv
        self.policy = policy or RestartPolicy()
        self.slots = [_Slot(i, Restarts(self.policy)) for i in range(count)]
        self.selector = selectors.DefaultSelector()
        self.stopping = False

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for slot in self.slots:
            slot.current = self._spawn(slot, standby=False)
        code = 0
        while not self.stopping:
            self._step(time.monotonic())
            if self._gave_up():
                code = 1
                self.stopping = True
        self._stop_all()
        return code

    # --------------------------------------------------------------- internals

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = True

    def _spawn(self, slot: _Slot, standby: bool) -> _Child:
        read, write = os.pipe()
        env = dict(os.environ, **{FD_ENV: str(write), CRASHES_ENV: str(slot.crashes),
                                  RECYCLES_ENV: str(slot.recycles)})
        popen = subprocess.Popen(self.argv(slot.index, standby), env=env, pass_fds=(write,),
                                 preexec_fn=_with_parent(os.getpid()))
        os.close(write)
        os.set_blocking(read, False)
        child = _Child(popen, read, standby)
        self.selector.register(read, selectors.EVENT_READ, (slot, child))
        return child

    def _step(self, now: float) -> None:
        for key, _ in self.selector.select(timeout=0.2):
            slot, child = key.data
            self._read(slot, child, now)
        for slot in self.slots:
            self._check(slot, time.monotonic())

    def _read(self, slot: _Slot, child: _Child, now: float) -> None:
        try:
            data = os.read(child.fd, 4096)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(child.fd)
            os.close(child.fd)
            child.fd = -1
            return
        child.buffer += data
        while b"\n" in child.buffer:
            line, child.buffer = child.buffer.split(b"\n", 1)
            self._event(slot, child, line.decode(errors="replace").strip(), now)

    def _event(self, slot: _Slot, child: _Child, event: str, now: float) -> None:
        if event == "ready":
            if child is slot.replacement:
                old, slot.current, slot.replacement = slot.current, child, None
                if old is not None:
                    log.info("worker %d recycled: pid %d drains, pid %d serves", slot.index, old.popen.pid,
                             child.popen.pid)
                    old.popen.send_signal(signal.SIGUSR1)
                    slot.retiring.append(old)
            slot.restarts.up(now)
        elif event == "recycle" and child is slot.current:
            slot.recycle_due = True

    def _check(self, slot: _Slot, now: float) -> None:
        slot.retiring = [c for c in slot.retiring if not self._reaped(c)]
        waited = slot.restart_at is None or now >= slot.restart_at
        if slot.recycle_due and slot.current is not None and slot.replacement is None and not slot.retiring and waited:
            # (A worker still draining holds the other port: the recycle waits for it.)
            slot.recycle_due = False
            slot.restart_at = None
            slot.recycles += 1
            slot.replacement = self._spawn(slot, standby=not slot.current.standby)
        if slot.replacement is not None and self._reaped(slot.replacement):
            log.error("worker %d: its replacement exited (%s) before it was ready; the old one keeps serving",
                      slot.index, slot.replacement.popen.returncode)
            slot.replacement = None
            self._crashed(slot, now)
            slot.recycle_due = not slot.gave_up  # try again after the backoff
        if slot.current is not None and self._reaped(slot.current):
            log.error("worker %d (pid %d) exited (%s)", slot.index, slot.current.popen.pid,
                      slot.current.popen.returncode)
            slot.port_standby = slot.current.standby
            slot.current = slot.replacement
            slot.replacement = None
            if slot.current is None:
                self._crashed(slot, now)
        if slot.current is None and slot.restart_at is not None and now >= slot.restart_at:
            slot.restart_at = None
            slot.current = self._spawn(slot, standby=slot.port_standby)

    def _crashed(self, slot: _Slot, now: float) -> None:
        slot.crashes += 1
        delay = slot.restarts.exited(now)
        if delay is None:
            log.error("worker %d exited %s; giving up", slot.index, slot.restarts.window())
            slot.restart_at = None
            slot.gave_up = True
            return
        log.warning("worker %d restarting in %.1f s", slot.index, delay)
        slot.restart_at = now + delay

    def _gave_up(self) -> bool:
        return any(slot.gave_up for slot in self.slots)

    def _reaped(self, child: _Child) -> bool:
        if child.popen.poll() is None:
            return False
        if child.fd >= 0:
            self.selector.unregister(child.fd)
            os.close(child.fd)
            child.fd = -1
        return True

    def _stop_all(self) -> None:
        children = [c for s in self.slots for c in (s.current, s.replacement, *s.retiring) if c is not None]
        for c in children:
            if c.popen.poll() is None:
                c.popen.send_signal(signal.SIGTERM)
        for c in children:
            try:
                c.popen.wait()
            except KeyboardInterrupt:
                c.popen.kill()
                c.popen.wait()


def serve_workers(worker_argv: Callable[[int, bool], list[str]], addresses: list[str], count: int) -> int:
    busy = [a for a in addresses if a and port_in_use(a)]
    if busy:
        log.error("%s already in use (is another model-router running?)", ", ".join(busy))  # in the log's format
        return 1
    return Supervisor(worker_argv, count).run()


def worker_addresses(grpc_listen: str, admin_listen: str, workers: int) -> tuple[list[str], list[str]]:
    """Worker i listens on the configured ports plus i."""
    def shifted(addr: str) -> list[str]:
        if not addr:
            return [""] * workers
        return [address.shifted(addr, i) for i in range(workers)]

    return shifted(grpc_listen), shifted(admin_listen)


def standby_addresses(addresses: Sequence[str]) -> list[str]:
    """Where each recycling worker's replacement listens: its port plus the
    number of workers (generations alternate between the two)."""
    return [address.shifted(a, len(addresses)) for a in addresses]

"""One ``llama-server`` process on a free loopback port, for the real-engine tests.

The binary comes from :mod:`tests.support.llama_build` (built by ``python -m
tests.support.servers``); the model from :mod:`tests.support.gguf_model`. ``kill()`` is a
crash (SIGKILL); ``start()`` brings the engine back on the same port.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sidecar.devstack.stack import free_port


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    aliases: tuple[str, ...]
    workdir: Path
    parallel: int = 2  # slots, which share the context
    ctx: int = 4096
    metrics: bool = True  # --metrics
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"llama-server-{self.port}.log"

    def argv(self) -> list[str]:
        argv = [str(self.binary), "-m", str(self.model), "--alias", ",".join(self.aliases),
                "--host", "127.0.0.1", "--port", str(self.port), "-c", str(self.ctx), "-t", "1",
                "-np", str(self.parallel), "--no-webui"]
        return [*argv, "--metrics"] if self.metrics else argv

    def start(self, timeout: float = 120.0) -> LlamaServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"llama-server did not load its model within {timeout} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def raw_metrics(self) -> dict[str, float]:
        """The engine's own ``/metrics`` page, unlabelled samples by name."""
        text = httpx.get(self.url + "/metrics", timeout=60).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

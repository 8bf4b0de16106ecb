"""``serve`` as the worker supervisor loads the config and nothing of the
serving process (gRPC, aiohttp, the handlers, the other subcommands) before it
starts its workers: it stays small for as long as it runs, and each worker
loads what it serves with in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sidecar

TEMPLATE = Path(sidecar.__file__).parent / "templates" / "ab-testing.yaml"

# Runs `serve --workers 2` up to the point where the supervisor would start
# the workers, and prints the modules loaded by then.
PROBE = r"""
import json, sys
import sidecar.serve.workers as workers

def started(*args, **kwargs):
    print(json.dumps(sorted(sys.modules)))
    return 0

workers.serve_workers = started
from sidecar.commands.main import main
sys.exit(main(sys.argv[1:]))
"""

SERVING = ("grpc", "grpc_health", "aiohttp", "google", "envoy", "uvloop", "redis")
NOT_SUPERVISING = ("sidecar.handlers", "sidecar.serve.server", "sidecar.devstack", "sidecar.deploy", "sidecar.routing")


def test_the_worker_supervisor_loads_only_the_config():
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "serve", "--config", str(TEMPLATE), "--workers", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "sidecar.config.schema" in loaded
    assert [m for m in loaded if m.split(".")[0] in SERVING] == []
    assert [m for m in loaded if m.startswith(NOT_SUPERVISING)] == []
    commands = {m for m in loaded if m.startswith("sidecar.commands.")}
    assert commands == {"sidecar.commands.main", "sidecar.commands.serve", "sidecar.commands.common"}

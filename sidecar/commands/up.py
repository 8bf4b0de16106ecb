"""``model-router up``: the local stack (:mod:`sidecar.devstack.stack`) in the foreground, until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

from ..devstack.stack import Stack, StackError, envoy_binary
from .common import load_config
from .generate import template_text


def add_arguments(u: argparse.ArgumentParser) -> None:
    u.add_argument("--config", help="config file (default: the ab-testing template)")
    u.add_argument("--listen", help="public host:port (default: envoy.listen from the config)")


def run(args: argparse.Namespace) -> int:
    if not os.environ.get("MODEL_ROUTER_ENVOY_IMAGE"):
        try:
            envoy_binary()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    tmp = None
    path = args.config
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="model-router-up-")
        path = str(Path(tmp.name) / "ab-testing.yaml")
        Path(path).write_text(template_text("ab-testing"), encoding="utf-8")
        print(f"no --config given: running the ab-testing template ({path})")
    loaded = load_config(path)
    if loaded is None:
        return 1
    cfg = loaded.config
    logs = Path(tempfile.mkdtemp(prefix="model-router-logs-"))
    # Under the product's supervisor when workers recycle (the default), as serve runs them.
    stack = Stack(Path(path), listen=args.listen, sidecars=cfg.server.workers, config_ports=True, workdir=logs,
                  supervised=bool(cfg.server.max_requests_per_worker))
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    model = cfg.model_experiments[0].model if cfg.model_experiments else next(
        (m for b in cfg.backends for m in (b.models or [])), "MODEL"
    )
    admin = "needs server.admin_token" if not cfg.server.admin_token else "token from server.admin_token"
    print(f"""
model-router is up.
  public URL (Envoy):   {stack.url}
  sidecar metrics:      http://{stack.sidecar_admin[0]}/metrics   (/admin/*: {admin})
  Envoy admin:          http://{stack.envoy_admin}
  logs (kept):          {stack.workdir}
  usage records:        {stack.usage_records}   (one JSON line per request; docs/metering.md)

Try it:
  curl -s {stack.url}/v1/chat/completions -H 'authorization: Bearer user-1' \\
       -H 'content-type: application/json' -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}'

See the split: 100 callers, one key each; each keeps its arm on every request.
  for i in $(seq 1 100); do curl -s -o /dev/null -D - {stack.url}/v1/chat/completions -H "authorization: Bearer user-$i" \\
       -H 'content-type: application/json' -d '{{"model": "{model}", "messages": []}}' | grep -i x-continuum-experiment-variant; done | sort | uniq -c

Press Ctrl-C to stop.""", flush=True)
    code = 0
    try:
        stack.supervise(lambda: stopping)  # restarts what dies; raises when it cannot
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print("stopping...", flush=True)
        stack.stop()
        if tmp is not None:
            tmp.cleanup()
        print(f"stopped; logs are in {logs}", flush=True)
    return code

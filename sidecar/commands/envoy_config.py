"""``model-router envoy-config``: the Envoy bootstrap for a config, printed or written."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..config.schema import Config
from ..deploy import envoy as envoyconf
from ..serve import grpc_auth
from ..serve.workers import worker_addresses
from .common import load_config, pairs


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument("--config", required=True)
    e.add_argument("--sidecar", action="append", metavar="HOST:PORT", help="ext_proc endpoint(s) (default: server.grpc_listen)")
    e.add_argument("--backend-url", action="append", metavar="NAME=URL", help="override a backend's URL")
    e.add_argument("--listen", help="public host:port (default: envoy.listen)")
    e.add_argument("--admin-listen", help="Envoy admin host:port (default: envoy.admin_listen)")
    e.add_argument("-o", "--output", metavar="FILE", help="write the bootstrap here (default: standard output)")
    e.add_argument("--grpc-secret-file", metavar="PATH",
                   help="the secret Envoy sends to the sidecar (overrides server.grpc_auth.secret)")
    e.add_argument("--create-secret", action="store_true",
                   help="with --grpc-secret-file: write a fresh secret there first when the file does not exist")


def _envoy_secret(cfg: Config, path: str | None, create: bool) -> str | None:
    """The gRPC secret the bootstrap carries: the file's (made first with
    ``create``, readable by its owner only), else the config's."""
    if path and create and not Path(path).exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(grpc_auth.generate() + "\n")
    return grpc_auth.secret_of(cfg.server.grpc_auth, path)


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args.config)
    if loaded is None:
        return 1
    cfg = loaded.config
    urls = pairs(args.backend_url, "--backend-url")
    for i, b in enumerate(cfg.backends):
        if b.is_demo and b.name not in urls:
            urls[b.name] = f"http://127.0.0.1:{18000 + i}"
            print(f"note: demo backend '{b.name}' mapped to {urls[b.name]} (use --backend-url to change)", file=sys.stderr)
    try:
        secret = _envoy_secret(cfg, args.grpc_secret_file, args.create_secret)
    except grpc_auth.SecretError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    boot = envoyconf.bootstrap(
        cfg, sidecar_addresses=args.sidecar or worker_addresses(cfg.server.grpc_listen, "", cfg.server.workers)[0],
        backend_urls=urls,
        listen=args.listen, admin_listen=args.admin_listen, grpc_secret=secret,
    )
    text = envoyconf.render(boot)
    if args.output:
        out = Path(args.output)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)  # whole or not at all: Envoy never reads half a file
        print(f"wrote {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

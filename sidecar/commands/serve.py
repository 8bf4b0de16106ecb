"""``model-router serve``: the sidecar, as one process or as a supervisor of one process per worker.

As the worker supervisor this process loads only the config (no gRPC, no
server) before it starts the workers: this module imports nothing else at
its top, and the server comes in where a process serves.
"""

from __future__ import annotations

import argparse
import sys

from ..serve import workers as workers_mod
from .common import load_config, pairs


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True)
    s.add_argument("--grpc-listen", help="host:port for the ext_proc gRPC server (overrides server.grpc_listen)")
    s.add_argument("--admin-listen", help="host:port for the admin HTTP server (overrides server.admin_listen)")
    s.add_argument("--backend-url", action="append", metavar="NAME=URL", help="override a backend's URL")
    s.add_argument("--workers", type=int, help="sidecar processes on consecutive ports (overrides server.workers)")
    s.add_argument("--usage-records", metavar="PATH",
                   help="append usage records (JSON lines) here; - for stdout (overrides metering.usage_records)")
    s.add_argument("--log-format", choices=("text", "json"),
                   help="log lines as text (default) or one JSON object each (env: MODEL_ROUTER_LOG_FORMAT)")
    s.add_argument("--grpc-secret-file", metavar="PATH",
                   help="the secret Envoy sends on the gRPC port (overrides server.grpc_auth.secret)")
    s.add_argument("--grpc-trust-network", action="store_true",
                   help="serve gRPC beyond loopback without server.grpc_auth: only where a NetworkPolicy (model-router "
                        "k8s writes one) or a mesh admits Envoy alone")
    s.add_argument("--admin-path-root", metavar="DIR",
                   help="PUT /admin/config may point file fields (metering.usage_records, ...) only inside DIR "
                        "(default: it may not change them)")
    s.add_argument("--max-requests-per-worker", type=int, metavar="N",
                   help="recycle a worker after about N requests; 0: never (overrides server.max_requests_per_worker)")
    s.add_argument("--no-supervisor", action="store_true",
                   help="one process, no worker supervisor: at server.max_requests_per_worker it goes unready, "
                        "drains and exits 0 for what runs it (Kubernetes, systemd) to start it again")


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args.config)
    if loaded is None:
        return 1
    cfg = loaded.config
    workers: int = args.workers or cfg.server.workers
    grpc_addrs, admin_addrs = workers_mod.worker_addresses(
        args.grpc_listen or cfg.server.grpc_listen, args.admin_listen or cfg.server.admin_listen, workers
    )
    overrides = pairs(args.backend_url, "--backend-url")
    if args.no_supervisor and workers != 1:
        print(f"error: --no-supervisor runs one process; {workers} workers asked for", file=sys.stderr)
        return 1
    bound: int = cfg.server.max_requests_per_worker if args.max_requests_per_worker is None else args.max_requests_per_worker
    if bound < 0:
        print("error: --max-requests-per-worker must be 0 or more", file=sys.stderr)
        return 1
    if workers_mod.supervised() or args.no_supervisor or (workers == 1 and not bound):
        from ..serve.server import serve

        serve(args.config, grpc_listen=grpc_addrs[0], admin_listen=admin_addrs[0],
              url_overrides=overrides, usage_records=args.usage_records, log_format=args.log_format,
              grpc_secret_file=args.grpc_secret_file, admin_path_root=args.admin_path_root,
              grpc_trust_network=args.grpc_trust_network, recycle_bound=args.max_requests_per_worker)
        return 0
    # One supervised process per worker, each its own ext_proc endpoint (see envoy-config).
    extra = [a for url in args.backend_url or [] for a in ("--backend-url", url)]
    if args.usage_records:
        extra += ["--usage-records", args.usage_records]
    if args.log_format:
        extra += ["--log-format", args.log_format]
    if args.grpc_secret_file:
        extra += ["--grpc-secret-file", args.grpc_secret_file]
    if args.admin_path_root:
        extra += ["--admin-path-root", args.admin_path_root]
    if args.grpc_trust_network:
        extra.append("--grpc-trust-network")
    if args.max_requests_per_worker is not None:
        extra += ["--max-requests-per-worker", str(args.max_requests_per_worker)]

    standby = workers_mod.standby_addresses(grpc_addrs) if bound else []

    def worker_argv(i: int, on_standby: bool) -> list[str]:
        grpc_listen = standby[i] if on_standby else grpc_addrs[i]
        return [sys.executable, "-m", "sidecar", "serve", "--config", args.config, "--workers", "1",
                "--grpc-listen", grpc_listen, "--admin-listen", admin_addrs[i], *extra]

    from ..accounting.logs import setup as setup_logging

    setup_logging(args.log_format)
    return workers_mod.serve_workers(worker_argv, grpc_addrs + standby + admin_addrs, workers)

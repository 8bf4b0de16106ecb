"""The ``model-router`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from importlib import resources
from pathlib import Path

TEMPLATES = ("ab-testing",)


def template_text(name: str) -> str:
    return resources.files("sidecar").joinpath("templates", f"{name}.yaml").read_text(encoding="utf-8")


def _pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for v in values or []:
        name, sep, url = v.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"{flag} expects NAME=URL, got {v!r}")
        out[name] = url
    return out


def load_config(path: str, env: dict[str, str] | None = None):
    """Load a config, printing warnings; on failure print every problem and return None."""
    from ..config.schema import ConfigError, load

    try:
        loaded = load(path, env)
    except ConfigError as exc:
        for e in exc.errors:
            print(f"error: {e}", file=sys.stderr)
        for w in exc.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(f"{path}: invalid ({len(exc.errors)} error(s))", file=sys.stderr)
        return None
    for w in loaded.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return loaded


def _quiet_grpc_for_json(argv: list[str]) -> None:
    """Under JSON logs gRPC's C core would write plain lines into the stream
    (the sidecar logs what it does about each failure): silence it before any
    module loads gRPC, subcommands' parsers included. An operator's
    GRPC_VERBOSITY still wins."""
    given = next((v for a, v in zip(argv, [*argv[1:], ""]) if a == "--log-format"), None)
    given = next((a.partition("=")[2] for a in argv if a.startswith("--log-format=")), given)
    if (given or os.environ.get("MODEL_ROUTER_LOG_FORMAT") or "").strip().lower() == "json":
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def cmd_serve(args) -> int:
    # Light imports first: as the worker supervisor this process loads only the
    # config; gRPC and the server come in where it serves.
    from ..serve import workers as workers_mod
    from ..serve.workers import standby_addresses, worker_addresses

    loaded = load_config(args.config)
    if loaded is None:
        return 1
    cfg = loaded.config
    workers = args.workers or cfg.server.workers
    grpc_addrs, admin_addrs = worker_addresses(
        args.grpc_listen or cfg.server.grpc_listen, args.admin_listen or cfg.server.admin_listen, workers
    )
    overrides = _pairs(args.backend_url, "--backend-url")
    if args.no_supervisor and workers != 1:
        print(f"error: --no-supervisor runs one process; {workers} workers asked for", file=sys.stderr)
        return 1
    bound = cfg.server.max_requests_per_worker if args.max_requests_per_worker is None else args.max_requests_per_worker
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

    standby = standby_addresses(grpc_addrs) if bound else []

    def worker_argv(i: int, on_standby: bool) -> list[str]:
        grpc_listen = standby[i] if on_standby else grpc_addrs[i]
        return [sys.executable, "-m", "sidecar", "serve", "--config", args.config, "--workers", "1",
                "--grpc-listen", grpc_listen, "--admin-listen", admin_addrs[i], *extra]

    from ..accounting.logs import setup as setup_logging

    setup_logging(args.log_format)
    return workers_mod.serve_workers(worker_argv, grpc_addrs + standby + admin_addrs, workers)


def cmd_validate(args) -> int:
    loaded = load_config(args.file)
    if loaded is None:
        return 1
    print(f"{args.file}: valid" + (f" ({len(loaded.warnings)} warning(s))" if loaded.warnings else ""))
    return 0


def cmd_generate(args) -> int:
    text = template_text(args.template)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _envoy_secret(cfg, path: str | None, create: bool) -> str | None:
    """The gRPC secret the bootstrap carries: the file's (made first with
    ``create``, readable by its owner only), else the config's."""
    from ..serve import grpc_auth

    if path and create and not Path(path).exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(grpc_auth.generate() + "\n")
    return grpc_auth.secret_of(cfg.server.grpc_auth, path)


def cmd_envoy_config(args) -> int:
    from ..deploy import envoy as envoyconf
    from ..serve import grpc_auth
    from ..serve.workers import worker_addresses

    loaded = load_config(args.config)
    if loaded is None:
        return 1
    cfg = loaded.config
    urls = _pairs(args.backend_url, "--backend-url")
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


def cmd_k8s(args) -> int:
    from .k8s import run

    return run(args)


def cmd_up(args) -> int:
    import tempfile

    from ..devstack.stack import Stack, StackError, envoy_binary

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

    def on_signal(signum, frame):
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


def cmd_demo_engine(args) -> int:
    from ..devstack.demo import engine as demo_engine

    return demo_engine.main(args)


def cmd_assign(args) -> int:
    from .assign import run

    return run(args)


def cmd_diff(args) -> int:
    from .diff import run

    return run(args)


def cmd_pause(args) -> int:
    from .pause import run

    return run(args)


def cmd_report(args) -> int:
    from .report import run

    return run(args)


def cmd_explain(args) -> int:
    from .explain import run

    return run(args)


def _add_experiments(sub) -> None:
    x = sub.add_parser("experiments", help="inspect model experiments")
    xsub = x.add_subparsers(dest="experiments_command", required=True)
    a = xsub.add_parser("assign", help="which arm a caller gets, and why")
    a.add_argument("--config", required=True)
    a.add_argument("--experiment", required=True, help="experiment name")
    a.add_argument("--key", required=True, help="the caller's sticky value (API key, user or header value)")
    a.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    a.add_argument("--json", action="store_true", help="print JSON")
    a.set_defaults(func=cmd_assign)
    df = xsub.add_parser("diff", help="which callers an edit moves to another arm, before it ships")
    df.add_argument("old", help="the config in service")
    df.add_argument("new", help="the edited config")
    callers = df.add_mutually_exclusive_group()
    callers.add_argument("--keys", metavar="FILE", help="sticky values, one per line: recompute each one's arm")
    callers.add_argument("--usage-records", metavar="FILE",
                         help="the router's usage records: recompute the key ids seen in each experiment")
    df.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    df.add_argument("--movers", type=int, default=20, metavar="N", help="movers listed per experiment (default 20)")
    df.add_argument("--json", action="store_true", help="print JSON, every mover included")
    df.set_defaults(func=cmd_diff)
    for verb, what in (("pause", "take an arm out of the race (its weight is kept)"), ("resume", "put a paused arm back")):
        pz = xsub.add_parser(verb, help=what + ", in the config file")
        pz.add_argument("--config", required=True, help="the config file the sidecars read")
        pz.add_argument("--experiment", required=True, help="experiment name")
        pz.add_argument("--variant", required=True, help="variant id")
        pz.set_defaults(func=cmd_pause)
    _add_report(xsub)


def _add_report(xsub) -> None:
    from .report import add_arguments

    r = xsub.add_parser("report", help="each arm against the control arm, with intervals safe to peek at")
    add_arguments(r)
    r.set_defaults(func=cmd_report)


def _add_explain(sub) -> None:
    ex = sub.add_parser("explain", help="why a request would be routed as it is, offline (nothing is sent)")
    ex.add_argument("--config", required=True)
    ex.add_argument("--request", required=True, metavar="FILE",
                    help='JSON {"method", "path", "headers", "body"}; - for standard input')
    ex.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    ex.add_argument("--json", action="store_true", help="print JSON, as POST /admin/explain answers")
    ex.set_defaults(func=cmd_explain)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="run the sidecar (gRPC ext_proc + admin HTTP)")
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
    s.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="model-router", description="Envoy ext_proc sidecar for LLM model routing.")
    sub = p.add_subparsers(dest="command", required=True)

    _add_serve(sub)

    u = sub.add_parser("up", help="run the local stack: Envoy, the sidecar and demo engines")
    u.add_argument("--config", help="config file (default: the ab-testing template)")
    u.add_argument("--listen", help="public host:port (default: envoy.listen from the config)")
    u.set_defaults(func=cmd_up)

    c = sub.add_parser("config", help="validate or generate config files")
    csub = c.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="check a config file; exit 0 when valid, 1 when not")
    v.add_argument("file")
    v.set_defaults(func=cmd_validate)
    g = csub.add_parser("generate", help="print a commented, runnable config")
    g.add_argument("--template", choices=TEMPLATES, default="ab-testing")
    g.add_argument("-o", "--output")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("envoy-config", help="print the Envoy bootstrap for a config")
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
    e.set_defaults(func=cmd_envoy_config)

    from .k8s import add_arguments as add_k8s

    k = sub.add_parser("k8s", help="print or write Kubernetes, Istio and Envoy Gateway manifests for a config")
    add_k8s(k)
    k.set_defaults(func=cmd_k8s)

    _add_experiments(sub)
    _add_explain(sub)

    d = sub.add_parser("demo-engine", help="run the built-in demo upstream engine")
    try:
        from ..devstack.demo import engine as demo_engine

        demo_engine.add_arguments(d)
    except ImportError:
        pass
    d.set_defaults(func=cmd_demo_engine)
    return p


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    _quiet_grpc_for_json(given)
    if given[:1] == ["serve"]:
        # The other commands' parsers import their modules (gRPC, aiohttp, the
        # manifests...): serve, and so the worker supervisor, loads none of them.
        p = argparse.ArgumentParser(prog="model-router")
        _add_serve(p.add_subparsers(dest="command", required=True))
        args = p.parse_args(argv)
    else:
        args = build_parser().parse_args(argv)
    return args.func(args) or 0

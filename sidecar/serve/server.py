"""``model-router serve``: the gRPC ext_proc server plus the admin HTTP port."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import signal
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import metrics
from ..accounting.budgets import Budgets
from ..accounting.logs import DecisionLog, announce, fatal
from ..accounting.logs import setup as setup_logging
from ..accounting.metering import AccessLogService, JsonLinesSink, Meter
from ..accounting.tracing import Tracer
from ..backends.monitor import Monitor
from ..backends.state import BackendState
from ..config import address
from ..config import guard as config_guard
from ..config import schema as config_mod
from ..config.schema import GrpcAuth
from ..contract import HEALTH_FAILURES, HEALTH_INTERVAL_S
from ..experiments import diff as experiments_diff
from ..experiments import feedback, srm
from ..handlers.extproc import Processor
from ..handlers.ratelimit import RateLimitService
from ..payload import response_ids
from ..routing import admin_token, explain, listing, snapshot
from ..stores import cache
from . import admin_config, grpc_auth, workers
from .admin_config import AdminView, Guard

log = logging.getLogger("model_router.server")

_ADMIN_BODY_LIMIT = 16 * 1024 * 1024  # a config or a request to explain
# Unready before draining, when a process without a supervisor reaches its bound:
# as long as the generated pods' preStop sleep.
RETIRE_WAIT_S = 10.0


def prime_metrics(config: config_mod.Config) -> None:
    """Every labelled series a config implies, at zero: the router's own, the cache's and feedback's."""
    metrics.prime(config)
    if config.cache is not None:
        cache.prime(config)
    feedback.prime(config)


class Runtime:
    """Holds the current snapshot; a reload swaps it in one assignment."""

    def __init__(
        self, path: str | Path, url_overrides: Mapping[str, str] | None = None, usage_records: str | None = None,
        grpc_secret_file: str | None = None, admin_path_root: str | None = None,
        recycle_bound: int | None = None,
    ):
        self.path = Path(path)
        self.admin_path_root = admin_path_root  # where the admin API may point file fields
        self.admin_writes = asyncio.Lock()  # one admin config write at a time in this process
        self.grpc_secret_file = grpc_secret_file  # overrides server.grpc_auth's secret
        self.url_overrides = dict(url_overrides or {})
        loaded = config_mod.load(self.path)
        for w in loaded.warnings:
            log.warning("config: %s", w)
        self.id_key = self._id_key(loaded.config)
        self.snapshot = snapshot.build(loaded.config, self.url_overrides, id_key=self.id_key)
        self._stamp = self._file_stamp()
        self.ready = False
        self.monitor: Monitor | None = None
        self._http: aiohttp.ClientSession | None = None
        self.usage_records = usage_records  # overrides metering.usage_records
        self._sink: JsonLinesSink | None = None
        bound = loaded.config.server.max_requests_per_worker if recycle_bound is None else recycle_bound
        # Each worker draws its own bound near the configured one, so they do not recycle together.
        self.recycle_after = int(bound * random.uniform(0.9, 1.1)) if bound else 0
        self.requests = 0
        self.on_due: Callable[[], None] | None = None  # without a supervisor: what to do at the bound
        self.budgets = Budgets(lambda: self.snapshot)
        prime_metrics(loaded.config)
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LOADED.set(time.time())

    def _id_key(self, config: config_mod.Config) -> bytes:
        """The key sealing response ids: from the gRPC secret every replica
        shares; without one, this process's own (ids last as long as it).
        Read at start, like the gRPC gate: Envoy's secret changes with a restart."""
        try:
            secret = grpc_auth.secret_of(config.server.grpc_auth, self.grpc_secret_file)
        except grpc_auth.SecretError as exc:
            raise SystemExit(f"error: {exc}") from None
        return response_ids.derive(secret) if secret else response_ids.PROCESS_KEY

    def http_session(self) -> aiohttp.ClientSession:
        """One client session for the sidecar's own upstream calls (the :online loop)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._sink is not None:
            self._sink.close()

    def usage_sink(self) -> JsonLinesSink | None:
        """Where usage records go under the current config (reopened when it changes)."""
        path = self.usage_records or self.snapshot.config.metering.usage_records
        if self._sink is not None and self._sink.path != path:
            self._sink.close()
            self._sink = None
        if self._sink is None and path:
            try:
                self._sink = JsonLinesSink(path)
            except OSError as exc:
                log.error("usage records: cannot open %s: %s", path, exc)
        return self._sink

    def set_discovered(self, discovered: dict[str, tuple[str, ...]]) -> None:
        """The monitor found new model lists: rebuild the snapshot around them."""
        self.snapshot = snapshot.build(self.snapshot.config, self.url_overrides, discovered, self.id_key)
        log.info("model lists discovered: %s", {k: len(v) for k, v in discovered.items()})

    def count_request(self) -> None:
        """One more request decided here; once the bound is reached the
        supervisor hears, or without one the process retires (``on_due``)."""
        self.requests += 1
        if self.requests == self.recycle_after:
            if workers.supervised():
                log.info("%d requests served: asking for a replacement", self.requests)
                workers.notify("recycle")
            elif self.on_due is not None:
                log.info("%d requests served: leaving the endpoints, draining and exiting to be started again",
                         self.requests)
                self.on_due()

    def backend_states(self) -> Mapping[str, BackendState]:
        return self.monitor.states if self.monitor is not None else {}

    def report_response(self, backend: str, status: int | None) -> None:
        if self.monitor is not None:
            self.monitor.report_response(backend, status)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def reload_if_changed(self) -> bool | None:
        """Reload when the file changed. True: applied, False: rejected, None: unchanged."""
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        return self.reload()

    def candidate(self, text: str) -> config_mod.Loaded:
        """Config text from the admin API validated as a reload validates a
        file, and not applied; it may change file paths only inside
        ``admin_path_root``. Raises :class:`~sidecar.config.schema.ConfigError`."""
        loaded = config_mod.parse(text)
        paths = config_guard.path_errors(self.snapshot.config, loaded.config, self.admin_path_root)
        if paths:
            raise config_mod.ConfigError(paths, loaded.warnings)
        try:
            snapshot.build(loaded.config, self.url_overrides, self.snapshot.discovered)
        except Exception as exc:
            raise config_mod.ConfigError([f"(root): {type(exc).__name__}"], loaded.warnings) from None
        return loaded

    def reload(self, mark_seen: bool = False) -> bool:
        """Load the file again; ``mark_seen``: the watcher need not reload this version."""
        if mark_seen:
            self._stamp = self._file_stamp()
        try:
            loaded = config_mod.load(self.path)
            new = snapshot.build(loaded.config, self.url_overrides, self.snapshot.discovered, self.id_key)
        except Exception as exc:  # any failure rejects the edit; the watcher must live on
            metrics.CONFIG_RELOADS.labels("failure").inc()
            problems = exc.errors if isinstance(exc, config_mod.ConfigError) else [type(exc).__name__]
            log.error("config reload rejected, the previous config keeps serving: %s", "; ".join(problems))
            return False
        for w in loaded.warnings:
            log.warning("config: %s", w)
        self.snapshot = new
        prime_metrics(loaded.config)
        metrics.CONFIG_RELOADS.labels("success").inc()
        metrics.CONFIG_LOADED.set(time.time())
        log.info("config reloaded from %s", self.path)
        return True


def _admin_app(runtime: Runtime) -> web.Application:
    def authorized(request: web.Request) -> bool:
        given = admin_token.bearer(request.headers.get("authorization", ""))
        # Header bytes that are not UTF-8 arrive as surrogate escapes; compare raw bytes.
        return admin_token.matches(runtime.snapshot.config.server.admin_token, given.encode("utf-8", "surrogateescape"))

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        if runtime.ready:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "starting"}, status=503)

    async def metrics_view(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.REGISTRY), headers={"content-type": CONTENT_TYPE_LATEST})

    async def reload_view(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": "admin token required"}, status=401)
        ok = await asyncio.to_thread(runtime.reload)
        return web.json_response({"reloaded": ok}, status=200 if ok else 422)

    async def models_view(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": "admin token required"}, status=401)
        return web.json_response(listing.admin_view(runtime.snapshot))

    async def backends_view(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": "admin token required"}, status=401)
        monitor = runtime.monitor
        if monitor is None:  # before the monitor starts no backend has a state
            return web.json_response({"backends": {}})
        now = time.monotonic()
        out = {}
        for name, st in monitor.states.items():
            tps, waiting, running = monitor.load(st, now)
            info = runtime.snapshot.backends.get(name)
            check = info.config.health_check if info is not None else None
            out[name] = {
                "healthy": st.healthy, "held_out_s": max(0.0, st.held_out_until - now),
                "health_check": check.kind if check is not None else None, "probe_failures": st.probe_failures,
                "admissible": monitor.admissible(st, now),
                "engine": st.engine, "metrics": st.metrics,
                "throughput_tps": tps, "waiting": waiting, "running": running,
                "scrape_age_s": None if st.scraped_at is None else now - st.scraped_at,
                "models": list(st.models) if st.models is not None else None, "models_ok": st.models_ok,
            }
        return web.json_response({"backends": out})

    def guarded(handler: AdminView) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def view(request: web.Request) -> web.Response:
            if not authorized(request):
                return web.json_response({"error": "admin token required"}, status=401)
            return await handler(runtime, request)

        return view

    app = web.Application(client_max_size=_ADMIN_BODY_LIMIT)
    app.router.add_get("/admin/memory", guarded(_memory))
    app.router.add_get("/admin/models", models_view)
    app.router.add_get("/admin/backends", backends_view)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_view)
    app.router.add_post("/admin/reload", reload_view)
    app.router.add_post("/admin/config", guarded(_dry_run))
    app.router.add_post("/admin/explain", guarded(_explain))
    admin_config.add_routes(app, guarded)
    _add_experiment_routes(app, guarded)
    return app


def _add_experiment_routes(app: web.Application, guarded: Guard) -> None:
    from ..experiments import admin

    admin.add_routes(app, guarded)


async def _memory(_runtime: Runtime, _request: web.Request) -> web.Response:
    return web.json_response(memory_report())


def memory_report() -> dict[str, Any]:
    """What the process holds, for chasing growth: RSS, Python's allocated
    blocks and tracked objects, and tracemalloc's figures when it runs
    (``PYTHONTRACEMALLOC=1`` in the sidecar's environment)."""
    out: dict[str, Any] = {"allocated_blocks": sys.getallocatedblocks(), "gc_objects": len(gc.get_objects())}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        top = tracemalloc.take_snapshot().statistics("lineno")[:10]
        out["tracemalloc"] = {
            "current_bytes": current, "peak_bytes": peak,
            "top": [{"where": str(s.traceback), "bytes": s.size, "count": s.count} for s in top],
        }
    return out


async def _dry_run(runtime: Runtime, request: web.Request) -> web.Response:
    """``POST /admin/config?dry_run=1``: what a config would do to experiment assignments."""
    if request.query.get("dry_run") != "1":
        return web.json_response({"error": "POST /admin/config serves dry runs (?dry_run=1); "
                                           "PUT /admin/config applies a config"}, status=400)
    try:
        text = (await request.read()).decode("utf-8")
    except web.HTTPRequestEntityTooLarge:
        return web.json_response({"error": f"the config is larger than {_ADMIN_BODY_LIMIT} bytes"}, status=413)
    except UnicodeDecodeError:
        return web.json_response({"error": "the body must be the config's YAML text, in UTF-8"}, status=400)
    current = runtime.snapshot.config

    def preview() -> dict[str, Any]:
        # Off the event loop: parsing and validating a large config never stalls requests.
        loaded = runtime.candidate(text)
        found = experiments_diff.diff(current, loaded.config, time.time())
        redacted: dict[str, Any] = config_guard.redact(
            {"dry_run": True, "warnings": loaded.warnings, **found.to_dict()}, loaded.substituted)
        return redacted

    try:
        answer = await asyncio.to_thread(preview)
    except config_mod.ConfigError as exc:
        return web.json_response(
            {"error": "the config is invalid", "errors": exc.errors, "warnings": exc.warnings}, status=422
        )
    return web.json_response(answer)


async def _explain(runtime: Runtime, request: web.Request) -> web.Response:
    """``POST /admin/explain``: the decision trace of a request, with live monitor data; nothing is sent."""
    try:
        spec = explain.RequestSpec.from_json(orjson.loads(await request.read()))
    except web.HTTPRequestEntityTooLarge:
        return web.json_response({"error": f"the request is larger than {_ADMIN_BODY_LIMIT} bytes"}, status=413)
    except orjson.JSONDecodeError:
        return web.json_response({"error": "the body must be JSON: {method, path, headers, body}"}, status=400)
    except explain.SpecError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    doc = explain.explain(runtime.snapshot, spec, runtime.backend_states(), time.time(), time.monotonic(), live=True)
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


class _SinkOf:
    """The runtime's current usage sink, looked up per batch."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def write(self, records: list[dict[str, Any]]) -> None:
        sink = self.runtime.usage_sink()
        if sink is not None:
            sink.write(records)


def _grpc_gate(
    auth: GrpcAuth, secret_file: str | None, listen: str, trust_network: bool,
) -> tuple[grpc_auth.Gate, grpc.ServerCredentials | None]:
    """Who may call the gRPC port (sidecar.serve.grpc_auth); an unauthenticated port
    listens on loopback only, unless told a NetworkPolicy guards it."""
    try:
        secret = grpc_auth.secret_of(auth, secret_file)
        credentials = grpc_auth.server_credentials(auth.tls) if auth.tls is not None else None
    except grpc_auth.SecretError as exc:
        raise SystemExit(f"error: {exc}") from None
    if secret is None and credentials is None and not grpc_auth.is_loopback(listen) and not trust_network:
        raise SystemExit(f"error: the gRPC port {listen} is beyond loopback and unauthenticated: set "
                         "server.grpc_auth.secret (or secret_file, or tls) and give Envoy the same secret "
                         "(model-router envoy-config writes it into the bootstrap), or pass --grpc-trust-network "
                         "where a NetworkPolicy admits Envoy alone")
    return grpc_auth.Gate(secret, auth), credentials


async def serve_async(
    config_path: str,
    *,
    grpc_listen: str | None = None,
    admin_listen: str | None = None,
    url_overrides: Mapping[str, str] | None = None,
    usage_records: str | None = None,
    grpc_secret_file: str | None = None,
    admin_path_root: str | None = None,
    grpc_trust_network: bool = False,
    recycle_bound: int | None = None,
) -> None:
    runtime = Runtime(config_path, url_overrides, usage_records, grpc_secret_file, admin_path_root, recycle_bound)
    cfg = runtime.snapshot.config.server
    grpc_listen = grpc_listen or cfg.grpc_listen
    admin_listen = admin_listen or cfg.admin_listen
    # A supervised worker shares its admin port with its replacement while it drains.
    shared = workers.supervised()
    limit = cfg.max_body_bytes + 1024 * 1024
    gate, credentials = _grpc_gate(cfg.grpc_auth, grpc_secret_file, grpc_listen, grpc_trust_network)
    for service in grpc_auth.GUARDED_SERVICES:  # a refusal's first count is an increase
        metrics.GRPC_UNAUTHENTICATED.labels(service)
    server = grpc.aio.server(
        interceptors=[grpc_auth.Interceptor(gate, lambda s: metrics.GRPC_UNAUTHENTICATED.labels(s).inc())],
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    )
    processor = Processor(runtime)
    pbg.add_ExternalProcessorServicer_to_server(processor, server)
    def server_of(backend: str) -> tuple[str, int] | None:
        info = runtime.snapshot.backends.get(backend)
        return (info.host, info.port) if info is not None else None

    tracer = Tracer(lambda: runtime.snapshot.config.tracing, server_of=server_of)
    sample_ratio = srm.Tracker(lambda: runtime.snapshot.config)
    metrics.REGISTRY.register(srm.SrmCollector(sample_ratio))
    meter = Meter(runtime.report_response, _SinkOf(runtime), observers=(tracer, DecisionLog(), runtime.budgets, sample_ratio))
    access_log = AccessLogService(meter)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitService(lambda: runtime.snapshot), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    try:
        from ..experiments.service import add_to_server

        add_to_server(server, runtime)
    except ImportError:
        pass
    try:
        port = server.add_secure_port(grpc_listen, credentials) if credentials else server.add_insecure_port(grpc_listen)
    except RuntimeError:
        port = 0
    if port == 0:
        fatal(f"cannot listen for gRPC on {grpc_listen} (address in use?)")
    await server.start()
    tracer.start()

    runner = web.AppRunner(_admin_app(runtime), access_log=None)
    await runner.setup()
    host, aport = address.split(admin_listen)
    site = web.TCPSite(runner, host, aport, reuse_port=shared or None)
    try:
        await site.start()
    except OSError as exc:
        await server.stop(grace=0)
        fatal(f"cannot listen for the admin port on {admin_listen}: {exc.strerror}")
    for reason, n in workers.restarts_so_far().items():
        metrics.WORKER_RESTARTS.labels(reason).set(n)
    monitor = runtime.monitor = Monitor(lambda: runtime.snapshot, on_models_changed=runtime.set_discovered)
    await monitor.start()
    runtime.budgets.start(time.time)
    runtime.ready = True
    await health_service.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("model-router sidecar: gRPC on %s, admin on http://%s", grpc_listen, admin_listen)
    announce(f"model-router sidecar ready: gRPC {grpc_listen}, admin http://{admin_listen}")
    workers.notify("ready")

    stop = asyncio.Event()
    grace = float(cfg.drain_timeout_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    recycling = False

    def recycle() -> None:
        # Replaced: nothing waits for this process, so in-flight streams get as
        # long as an upstream exchange may take.
        nonlocal grace, recycling
        grace = float(runtime.snapshot.config.envoy.upstream_timeout_s or 86_400)
        recycling = True
        stop.set()

    loop.add_signal_handler(signal.SIGUSR1, recycle)

    retiring = False

    def retire() -> None:
        # No supervisor (serve --no-supervisor): leave the endpoints, drain and
        # exit 0 for whatever runs this process (Kubernetes, systemd) to start it again.
        nonlocal grace, retiring
        grace = float(runtime.snapshot.config.envoy.upstream_timeout_s or 86_400)
        retiring = True
        stop.set()

    runtime.on_due = retire

    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(runtime.snapshot.config.server.reload_interval_ms / 1000)
            try:
                # In a thread: a large or pathological file never stalls requests.
                await asyncio.to_thread(runtime.reload_if_changed)
            except Exception:
                log.exception("config watcher")

    watcher = asyncio.create_task(watch())
    await stop.wait()
    watcher.cancel()
    if recycling:
        # Serve on until Envoy's health check has found the replacement...
        await asyncio.sleep(HEALTH_INTERVAL_S + 0.5)
    runtime.ready = False
    await health_service.enter_graceful_shutdown()
    if recycling:
        # ...and has seen this one go NOT_SERVING: until then it may open streams here.
        await asyncio.sleep(HEALTH_INTERVAL_S * HEALTH_FAILURES + 1.5)
    if retiring:
        # Until Kubernetes has taken the pod out of its endpoints (readiness)
        # and Envoy's health check has seen NOT_SERVING, streams may still come.
        await asyncio.sleep(RETIRE_WAIT_S)
    await _drain(server, processor, access_log, grace, runtime.snapshot.config.metering.flush_interval_ms / 1000)
    await tracer.close()
    processor.json_budget.close()
    await monitor.stop()
    await runtime.budgets.stop(time.time())
    await runtime.close()
    await runner.cleanup()


async def _drain(server: grpc.aio.Server, processor: Processor, access_log: AccessLogService, grace: float, flush_s: float) -> None:
    """Stop taking streams (GOAWAY: Envoy opens new ones elsewhere), let the
    ext_proc streams in flight finish, then end the access-log streams once
    Envoy has had time to flush the entries of those requests."""
    stopping = asyncio.create_task(server.stop(grace=grace))
    deadline = time.monotonic() + grace
    while processor.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    access_log.close(linger=2 * flush_s + 0.5)
    await stopping


def serve(config_path: str, log_format: str | None = None, **kwargs: Any) -> None:
    setup_logging(log_format)
    try:
        import uvloop

        uvloop.run(serve_async(config_path, **kwargs))
    except ImportError:
        asyncio.run(serve_async(config_path, **kwargs))

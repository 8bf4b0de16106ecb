"""``model-router serve``: starts the gRPC services and the admin port, recycles, drains."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pbg
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .. import metrics
from ..accounting.logs import DecisionLog, announce, fatal
from ..accounting.logs import setup as setup_logging
from ..accounting.metering import AccessLogService, Meter
from ..backends.monitor import Monitor
from ..config import address
from ..config.schema import GrpcAuth
from ..contract import HEALTH_FAILURES, HEALTH_INTERVAL_S
from ..experiments import srm
from ..handlers.extproc import Processor
from ..handlers.ratelimit import RateLimitService
from . import grpc_auth, workers
from .admin import admin_app
from .runtime import Runtime

log = logging.getLogger("model_router.server")

# Unready before draining, when a process without a supervisor reaches its bound:
# as long as the generated pods' preStop sleep.
RETIRE_WAIT_S = 10.0


def meter_of(runtime: Runtime, sample_ratio: srm.Tracker) -> Meter:
    """The access log's accounting as the server runs it: metrics, passive
    health, usage records, and every observer (spans, the decision log,
    token budgets, the sample-ratio tracker)."""
    observers = (runtime.tracer, DecisionLog(), runtime.budgets, sample_ratio)
    return Meter(runtime.report_response, runtime.usage_sink, observers=observers)


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


@dataclass
class _Services:
    """The gRPC server and the services on it that the shutdown reaches."""

    server: grpc.aio.Server
    processor: Processor
    access_log: AccessLogService
    health: health.aio.HealthServicer


def _grpc_services(runtime: Runtime, gate: grpc_auth.Gate) -> _Services:
    """Every gRPC service on one server behind the port's gate: ext_proc, the
    access log, rate limits, health, and the assignment service when built."""
    limit = runtime.snapshot.config.server.max_body_bytes + 1024 * 1024
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
    sample_ratio = srm.Tracker(lambda: runtime.snapshot.config)
    metrics.REGISTRY.register(srm.SrmCollector(sample_ratio))
    access_log = AccessLogService(meter_of(runtime, sample_ratio))
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimitService(lambda: runtime.snapshot), server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    try:
        from ..experiments.service import add_to_server

        add_to_server(server, runtime)
    except ImportError:
        pass
    return _Services(server, processor, access_log, health_service)


def _listen(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None) -> None:
    try:
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        fatal(f"cannot listen for gRPC on {listen} (address in use?)")


async def _admin_site(runtime: Runtime, admin_listen: str, shared: bool, server: grpc.aio.Server) -> web.AppRunner:
    runner = web.AppRunner(admin_app(runtime), access_log=None)
    await runner.setup()
    host, aport = address.split(admin_listen)
    site = web.TCPSite(runner, host, aport, reuse_port=shared or None)
    try:
        await site.start()
    except OSError as exc:
        await server.stop(grace=0)
        fatal(f"cannot listen for the admin port on {admin_listen}: {exc.strerror}")
    return runner


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
    gate, credentials = _grpc_gate(cfg.grpc_auth, grpc_secret_file, grpc_listen, grpc_trust_network)
    services = _grpc_services(runtime, gate)
    _listen(services.server, grpc_listen, credentials)
    await services.server.start()
    runtime.tracer.start()
    runner = await _admin_site(runtime, admin_listen, shared, services.server)
    for reason, n in workers.restarts_so_far().items():
        metrics.WORKER_RESTARTS.labels(reason).set(n)
    monitor = runtime.monitor = Monitor(lambda: runtime.snapshot, on_models_changed=runtime.set_discovered)
    await monitor.start()
    runtime.budgets.start(time.time)
    runtime.ready = True
    await services.health.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("model-router sidecar: gRPC on %s, admin on http://%s", grpc_listen, admin_listen)
    announce(f"model-router sidecar ready: gRPC {grpc_listen}, admin http://{admin_listen}")
    workers.notify("ready")

    leaving, grace = await _until_told(runtime, float(cfg.drain_timeout_s))
    await _leave(runtime, services, leaving, grace)
    await monitor.stop()
    await runtime.budgets.stop(time.time())
    await runtime.close()
    await runner.cleanup()


async def _until_told(runtime: Runtime, grace: float) -> tuple[str | None, float]:
    """Serve, reloading the config as it changes, until a stop signal or a
    reason to leave: (why this process leaves before a stop signal, the drain's
    grace). Leaving is "recycle" (the supervisor has started its replacement)
    or "retire" (no supervisor: leave the endpoints, drain and exit 0 for
    Kubernetes or systemd to start it again)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    leaving: str | None = None

    def leave(reason: str) -> None:
        # Nothing waits for this process: in-flight streams get as long as an
        # upstream exchange may take.
        nonlocal grace, leaving
        grace = float(runtime.snapshot.config.envoy.upstream_timeout_s or 86_400)
        leaving = reason
        stop.set()

    loop.add_signal_handler(signal.SIGUSR1, leave, "recycle")
    runtime.on_due = lambda: leave("retire")

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
    return leaving, grace


async def _leave(runtime: Runtime, services: _Services, leaving: str | None, grace: float) -> None:
    """Go unready in the order Envoy's health checks (and Kubernetes) need,
    then drain the gRPC services."""
    if leaving == "recycle":
        # Serve on until Envoy's health check has found the replacement...
        await asyncio.sleep(HEALTH_INTERVAL_S + 0.5)
    runtime.ready = False
    await services.health.enter_graceful_shutdown()
    if leaving == "recycle":
        # ...and has seen this one go NOT_SERVING: until then it may open streams here.
        await asyncio.sleep(HEALTH_INTERVAL_S * HEALTH_FAILURES + 1.5)
    if leaving == "retire":
        # Until Kubernetes has taken the pod out of its endpoints (readiness)
        # and Envoy's health check has seen NOT_SERVING, streams may still come.
        await asyncio.sleep(RETIRE_WAIT_S)
    await _drain(services.server, services.processor, services.access_log, grace,
                 runtime.snapshot.config.metering.flush_interval_ms / 1000)
    await runtime.tracer.close()
    services.processor.close()


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

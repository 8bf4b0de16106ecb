"""The admin HTTP port: health, metrics, reload, models, backends, memory,
explain and config dry runs, behind the admin token where they need it."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import metrics
from ..config import guard as config_guard
from ..config import schema as config_mod
from ..experiments import diff as experiments_diff
from ..routing import admin_token, explain, listing
from . import admin_config
from .admin_config import AdminView, Guard
from .runtime import Runtime

_ADMIN_BODY_LIMIT = 16 * 1024 * 1024  # a config or a request to explain


def admin_app(runtime: Runtime) -> web.Application:
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


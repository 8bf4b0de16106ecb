"""The admin API's config writes: apply a whole config, pause or resume an arm.

Each write validates the new text as a reload would (the loader, then a
snapshot build), writes the file atomically and reloads it at once; the other
replicas reading the same file reload it on their next check
(``server.reload_interval_ms``). A rejected config leaves the file untouched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..config import edit as config_edit
from ..config import schema as config_mod

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("model_router.admin")

# An admin view that needs the runtime, and what wraps it into an aiohttp
# handler behind the admin token.
AdminView = Callable[["Runtime", web.Request], Awaitable[web.Response]]
Guard = Callable[[AdminView], Callable[[web.Request], Awaitable[web.Response]]]


class Rejected(Exception):
    def __init__(self, errors: list[str], warnings: list[str]) -> None:
        self.errors, self.warnings = errors, warnings
        super().__init__("; ".join(errors))


class WriteFailed(Exception):
    """The config was valid but the file could not be replaced (read-only mount, permissions)."""


def apply(runtime: Runtime, text: str) -> config_mod.Loaded:
    """Validate ``text``, write it over the config file and reload, under the
    file's write lock. Blocking: the views run it off the event loop.
    Raises :class:`Rejected` or :class:`WriteFailed`; a rejected config leaves the file untouched."""
    masked = config_edit.still_masked(text)
    try:
        loaded = runtime.candidate(text)
    except config_mod.ConfigError as exc:
        raise Rejected(masked + exc.errors, exc.warnings) from None
    if masked:
        raise Rejected(masked, loaded.warnings)
    try:
        with config_edit.locked(runtime.path):
            config_edit.write_atomic(runtime.path, text)
    except OSError as exc:
        raise WriteFailed(f"cannot write {runtime.path}: {exc.strerror or type(exc).__name__}") from None
    if not runtime.reload(mark_seen=True):
        # Validated a moment ago: only an environment change in between gets here.
        raise Rejected(["(root): written, but the reload rejected it; see the sidecar's log"], loaded.warnings)
    log.info("config applied through the admin API to %s", runtime.path)
    return loaded


def set_paused(runtime: Runtime, experiment: str, variant: str, paused: bool) -> tuple[bool, list[str]]:
    """Pause or resume an arm in the file (read, edit and apply under the
    file's write lock): (changed, warnings). Raises :class:`config_edit.EditError`,
    OSError, UnicodeDecodeError, :class:`Rejected` or :class:`WriteFailed`."""
    with config_edit.locked(runtime.path):
        text = runtime.path.read_text(encoding="utf-8")
        new, changed = config_edit.set_paused(text, experiment, variant, paused)
        if not changed:
            return False, []
        masked = config_edit.still_masked(new)
        try:
            loaded = runtime.candidate(new)
        except config_mod.ConfigError as exc:
            raise Rejected(masked + exc.errors, exc.warnings) from None
        if masked:
            raise Rejected(masked, loaded.warnings)
        try:
            config_edit.write_atomic(runtime.path, new)
        except OSError as exc:
            raise WriteFailed(f"cannot write {runtime.path}: {exc.strerror or type(exc).__name__}") from None
    if not runtime.reload(mark_seen=True):
        raise Rejected(["(root): written, but the reload rejected it; see the sidecar's log"], loaded.warnings)
    return True, loaded.warnings


def _invalid(exc: Rejected) -> web.Response:
    return web.json_response(
        {"error": "the config is invalid", "errors": exc.errors, "warnings": exc.warnings}, status=422
    )


async def put_config(runtime: Runtime, request: web.Request) -> web.Response:
    """``PUT /admin/config``: the body is the config's YAML text."""
    try:
        text = (await request.read()).decode("utf-8")
    except web.HTTPRequestEntityTooLarge:
        return web.json_response({"error": "the config is larger than the admin port accepts"}, status=413)
    except UnicodeDecodeError:
        return web.json_response({"error": "the body must be the config's YAML text, in UTF-8"}, status=400)
    try:
        async with runtime.admin_writes:
            loaded = await asyncio.to_thread(apply, runtime, text)
    except Rejected as exc:
        return _invalid(exc)
    except WriteFailed as exc:
        return web.json_response({"error": str(exc)}, status=500)
    return web.json_response({"applied": True, "path": str(runtime.path), "warnings": loaded.warnings})


async def get_config(runtime: Runtime, _request: web.Request) -> web.Response:
    """``GET /admin/config``: the file as written, secrets masked."""
    try:
        text = runtime.path.read_text(encoding="utf-8")
        body = config_edit.masked(text)
    except (OSError, UnicodeDecodeError) as exc:
        return web.json_response({"error": f"cannot read {runtime.path}: {type(exc).__name__}"}, status=500)
    except config_edit.EditError as exc:
        return web.json_response({"error": f"the file on disk cannot be shown: {exc}"}, status=500)
    return web.Response(text=body, content_type="application/yaml")


def pause_view(paused: bool) -> AdminView:
    """``POST /admin/experiments/{experiment}/variants/{variant}/pause`` (or ``/resume``)."""

    async def view(runtime: Runtime, request: web.Request) -> web.Response:
        experiment, variant = request.match_info["experiment"], request.match_info["variant"]
        try:
            async with runtime.admin_writes:
                changed, warnings = await asyncio.to_thread(set_paused, runtime, experiment, variant, paused)
        except config_edit.EditError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except (OSError, UnicodeDecodeError) as exc:
            return web.json_response({"error": f"cannot read {runtime.path}: {type(exc).__name__}"}, status=500)
        except Rejected as exc:
            return _invalid(exc)
        except WriteFailed as exc:
            return web.json_response({"error": str(exc)}, status=500)
        out: dict[str, Any] = {"experiment": experiment, "variant": variant, "paused": paused, "changed": changed}
        if changed:
            out["warnings"] = warnings
        return web.json_response(out)

    return view


def add_routes(app: web.Application, guarded: Guard) -> None:
    app.router.add_get("/admin/config", guarded(get_config))
    app.router.add_put("/admin/config", guarded(put_config))
    base = "/admin/experiments/{experiment}/variants/{variant}"
    app.router.add_post(base + "/pause", guarded(pause_view(True)))
    app.router.add_post(base + "/resume", guarded(pause_view(False)))

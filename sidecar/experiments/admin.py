"""``GET /admin/experiments/{experiment}/report`` (admin token): the readout, as the command's ``--json`` prints it.

The source is the usage-records file this sidecar writes when there is one
(exact, every process's records when they share the file); otherwise this
process's own metrics (its share of the traffic since it started).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from aiohttp import web

from . import records


class Runtime(Protocol):
    """What the report needs of the serving process's runtime (``sidecar.serve.runtime.Runtime``)."""

    usage_records: str | None
    snapshot: Any


def _records_path(runtime: Runtime) -> str | None:
    path = runtime.usage_records or runtime.snapshot.config.metering.usage_records
    return None if not path or path == "-" else path


def report(runtime: Runtime, name: str) -> dict[str, Any]:
    """Raises KeyError for an unknown experiment, RecordsError for an unreadable file."""
    config = runtime.snapshot.config
    experiment = records.experiments_of(config, name)[0]
    path = _records_path(runtime)
    if path is not None:
        return records.report_from_records(config, experiment, list(records.read(path)))
    from . import samples

    return samples.report_from_registry(config, experiment)


async def _report_view(runtime: Runtime, request: web.Request) -> web.Response:
    name = request.match_info["experiment"]
    try:
        doc = await asyncio.to_thread(report, runtime, name)
    except KeyError:
        return web.json_response({"error": f"no experiment named {name!r}"}, status=404)
    except records.RecordsError as exc:
        return web.json_response({"error": str(exc)}, status=503)
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


def add_routes(app: web.Application, guarded: Callable[[Any], Any]) -> None:
    app.router.add_get("/admin/experiments/{experiment}/report", guarded(_report_view))

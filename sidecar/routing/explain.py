"""Decision explain: a request's routing decision, traced, and nothing dispatched.

:func:`explain` runs the request path's own stages (the key gate, the
listing and passthrough rules, :func:`sidecar.routing.decide`) on a request
described as a client would send it, with a :class:`~sidecar.routing.trace.Trace`
that every stage fills. ``POST /admin/explain`` answers it with the
monitor's live states, ``model-router explain`` offline without them, and a
request through Envoy carrying ``x-model-router-explain: 1`` and the admin
token gets :meth:`Trace.summary` in a response header (:func:`wanted`).

Headers in the router's namespaces (``x-model-router-*``, ``x-continuum-*``)
are dropped first, as Envoy drops a client's copies before the sidecar sees
them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .. import errors, routing
from ..payload.body import named_models_or_error
from . import admin_token, listing
from .ingress import canonical, family_for, lookup, path_problem
from .ingress import listing_path as listing_of
from .selection import BackendView
from .snapshot import EXPLAIN_HEADER as HEADER
from .snapshot import ROUTER_HEADER_PREFIXES, Snapshot
from .trace import Trace

__all__ = ["HEADER", "RequestSpec", "SpecError", "explain", "wanted"]

_FIELDS = ("method", "path", "headers", "body")


class SpecError(ValueError):
    """A request description that cannot be explained; the message says why."""


@dataclass(frozen=True)
class RequestSpec:
    """A request as a client would send it."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    @classmethod
    def from_json(cls, obj: object) -> RequestSpec:
        """``{"method", "path", "headers", "body"}``: ``path`` is required, ``method``
        defaults to POST, ``body`` is a string (sent as its UTF-8 bytes) or any
        JSON value (sent serialized)."""
        if not isinstance(obj, dict):
            raise SpecError("the request must be a JSON object with method, path, headers and body")
        unknown = sorted(set(obj) - set(_FIELDS))
        if unknown:
            raise SpecError(f"unknown field '{unknown[0]}': a request has {', '.join(_FIELDS)}")
        method, path = obj.get("method", "POST"), obj.get("path")
        if not isinstance(method, str) or not method:
            raise SpecError("'method' must be a non-empty string")
        if not isinstance(path, str) or not path.startswith("/"):
            raise SpecError("'path' is required: a string starting with '/'")
        headers = obj.get("headers") or {}
        if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise SpecError("'headers' must be an object of header names to string values")
        body = obj.get("body")
        try:
            raw = b"" if body is None else body.encode("utf-8") if isinstance(body, str) else orjson.dumps(body)
        except (UnicodeEncodeError, TypeError):
            raise SpecError("'body' must be valid Unicode text or a JSON value") from None
        return cls(method.upper(), path, {k.lower(): v for k, v in headers.items()}, raw)


def wanted(headers: Mapping[str, str], token: str | None) -> bool:
    """Whether a request through Envoy asks for its trace with the admin token.
    (Header values arrive as latin-1 text of the raw bytes.)"""
    if headers.get(HEADER, "").strip() != "1":
        return False
    return admin_token.matches(token, headers.get(admin_token.HEADER, "").encode("latin-1", "replace"))


def explain(
    snap: Snapshot, spec: RequestSpec, states: Mapping[str, BackendView], now: float, mono: float, *, live: bool,
) -> dict[str, Any]:
    """The decision for ``spec`` under ``snap`` and the monitor's ``states``, as JSON."""
    trace = Trace()
    headers = {k: v for k, v in spec.headers.items() if not k.startswith(ROUTER_HEADER_PREFIXES)}
    _run(snap, spec, headers, trace, states, now, mono)
    return {
        "request": {"method": spec.method, "path": spec.path},
        "dropped_headers": sorted(set(spec.headers) - set(headers)),
        "monitor": "live: the monitor's current states" if live else (
            "none: explained offline, without live monitor data; every backend counts as healthy "
            "with unknown load, so :nitro and the saturation gate have nothing to measure"),
        "dispatched": False,
        **trace.to_dict(),
        "summary": trace.summary(),
    }


def _run(
    snap: Snapshot, spec: RequestSpec, headers: dict[str, str], trace: Trace,
    states: Mapping[str, BackendView], now: float, mono: float,
) -> None:
    """The adapter's stages, in the adapter's order."""
    path = canonical(spec.path)
    ingress, family = lookup(path), family_for(path)
    problem = path_problem(spec.path)
    if problem is not None:
        trace.stage("ingress", f"refused: {problem}", path=spec.path)
        trace.conclude(errors.error("invalid_request", problem, family))
        return
    trace.stage("ingress", f"{ingress.path} ({family}, {ingress.body} body)" if ingress is not None
                else "not a model endpoint", path=path, family=family)
    caller = routing.authenticate(snap, headers, family, trace)
    if isinstance(caller, errors.Reply):
        trace.conclude(caller)
        return
    if ingress is None:
        listed = listing_of(path)
        if listed is not None:
            trace.stage("listing", f"{listed}: answered by the sidecar, filtered for the key")
            trace.conclude(listing.answer(snap, listed, spec.method, caller.key))
            return
        models = named_models_or_error(path, spec.body, headers.get("content-type", ""))
        if isinstance(models, list):
            trace.stage("passthrough", f"names the models {models}" if models else "names no model", models=models)
        else:
            trace.stage("passthrough", f"refused: {models}")
        trace.conclude(routing.passthrough(snap, path, caller, family, models))
        return
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if spec.body and encoding not in ("", "identity"):
        trace.conclude(errors.unsupported_encoding(encoding, family))
        return
    if len(spec.body) > snap.max_body_bytes:
        trace.conclude(errors.too_large(snap.max_body_bytes, family))
        return
    req = routing.Request(
        ingress=ingress, path=path, headers=headers, body=spec.body, caller=caller, now=now,
        pick=0, rand=random.random(), random_bytes=os.urandom, states=states, mono=mono, trace=trace,
    )
    trace.conclude(routing.decide(snap, req))

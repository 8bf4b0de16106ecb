"""Decision explain: a request's routing decision, traced, and nothing dispatched.

:func:`explain` runs the request path's own stages (the key gate, the
listing, follow-up and passthrough rules, :func:`sidecar.routing.decide`, all
through :mod:`sidecar.routing.dispatch` as the ext_proc handler runs them) on a request
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

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from . import admin_token, dispatch
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
    """The request path's own dispatch, traced."""
    head = dispatch.at_headers(snap, spec.path, headers, spec.method, body_follows=bool(spec.body), trace=trace)
    if head.outcome is not None:
        trace.conclude(head.outcome)
        return
    live = dispatch.Live(now=now, mono=mono, rand=random.random(), shadow_rand=random.random(), states=states)
    trace.conclude(dispatch.at_body(snap, head, spec.body, headers, live, trace))

"""Who is calling and what they asked for: the key gate and the parse stage."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..config.schema import ApiKey, Experiment
from ..errors import Reply
from ..payload.body import BodyError, check_model_name, parse_json, query_model
from ..payload.formdata import FormField, form_model
from .ingress import Ingress
from .selection import BackendView
from .snapshot import Snapshot
from .trace import Trace


@dataclass(frozen=True)
class Caller:
    """Who is calling: the presented key (if any) and its config entry."""

    api_key: str | None
    key: ApiKey | None


def presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    if key and key.strip():
        return key.strip()
    return None


def authenticate(snap: Snapshot, headers: Mapping[str, str], family: str, trace: Trace | None = None) -> Caller | Reply:
    """The key gate; with no ``api_keys`` section every caller is admitted."""
    key = presented_key(headers)
    if snap.keys is None:
        if trace is not None:
            trace.stage("authenticate", "admitted: no api_keys section", key_presented=key is not None)
        return Caller(key, None)
    if key is None:
        if trace is not None:
            trace.stage("authenticate", "refused: no API key")
        return errors.error("unauthorized", "An API key is required (Authorization: Bearer or x-api-key).", family)
    entry = snap.keys.get(key)
    if entry is None:
        if trace is not None:
            trace.stage("authenticate", "refused: the key is not in api_keys")
        return errors.error("unauthorized", "The API key is not valid.", family)
    if trace is not None:
        trace.stage("authenticate", f"admitted as key id {entry.id}", key_id=entry.id)
    return Caller(key, entry)


@dataclass(slots=True)
class Request:
    """One request as the decision sees it. The adapter supplies the clocks,
    the round-robin counter, the random source and the monitor's states, so
    a decision is reproducible in a unit test."""

    ingress: Ingress
    path: str
    headers: Mapping[str, str]
    body: bytes
    caller: Caller
    now: float = 0.0
    pick: int = 0  # round-robin counter
    rand: float = 0.0  # uniform in [0, 1)
    shadow_rand: float = 1.0  # uniform in [0, 1), the shadow copy's own draw (1.0: never copied)
    random_bytes: Callable[[int], bytes] = os.urandom
    states: Mapping[str, BackendView] = field(default_factory=dict)  # backend -> monitor state
    mono: float = 0.0  # monotonic clock, the monitor's time base
    trace: Trace | None = None  # filled by every stage when set (explain)
    spent: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # token budgets: rule id -> (window, tokens)


@dataclass
class Parsed:
    """The model a request names, and where it sits in the request."""

    model: str
    json: dict[str, Any] | None = None
    form_field: FormField | None = None


def parse(req: Request) -> Parsed:
    """Read the model from the body, the multipart form or the query; raises BodyError."""
    kind = req.ingress.body
    if kind == "json":
        data = parse_json(req.body)
        if "model" not in data:
            raise BodyError("missing_model", "The request body has no 'model' field.")
        return Parsed(check_model_name(data["model"]), data)
    if kind == "multipart":
        model, f = form_model(req.body, req.headers.get("content-type", ""))
        return Parsed(model, form_field=f)
    named = query_model(req.path)
    if named is None:
        raise BodyError("missing_model", "The 'model' query parameter is required.")
    return Parsed(check_model_name(named))


def sticky_value(exp: Experiment, req: Request, parsed: Parsed) -> str | None:
    """The value an experiment hashes to keep a caller on one arm."""
    key = exp.sticky_key
    if key == "api_key":
        return req.caller.api_key
    if key == "user":
        data = parsed.json or {}
        if req.ingress.family == "anthropic":
            meta = data.get("metadata")
            value = meta.get("user_id") if isinstance(meta, dict) else None
        else:
            value = data.get("user")
        return value if isinstance(value, str) else None
    if key == "none":
        return None
    return req.headers.get(exp.sticky_header or "")

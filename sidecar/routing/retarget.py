"""A fallback attempt: the request as a hop's backend gets it.

Envoy runs this (through ``sidecar/handlers/hop_stream.py``) on every attempt after the
first of a request whose route named hops, that is after an attempt failed
upstream. The decision left what is needed in its metadata (``retry``: the
hops, the chain's origin, the path below the backend's base path, whether a
suffix edit must go); Envoy's attempt count says which hop this attempt is
for. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..payload.body import BodyError, parse_json, set_top_level
from .limits import BUDGET_SEPARATOR
from .route import CREDENTIAL_HEADERS, Meta, upstream_auth
from .snapshot import Snapshot

REASON = "upstream_error"  # the previous attempt failed: connect failure, reset, 5xx or 429


@dataclass(frozen=True, slots=True)
class Retarget:
    body: bytes
    path: str
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    meta: Meta  # merged into the decision's metadata


def _retry(decision: Mapping[str, Any]) -> dict[str, Any]:
    try:
        plan = orjson.loads(str(decision.get("retry") or "{}"))
    except orjson.JSONDecodeError:
        return {}
    return plan if isinstance(plan, dict) else {}


def hop_for(plan: Mapping[str, Any], attempt: int) -> tuple[str, str] | None:
    """(backend, model) of attempt ``attempt`` (2 for the first hop), or None."""
    hops = plan.get("hops")
    if attempt < 2 or not isinstance(hops, list) or attempt - 2 >= len(hops):
        return None
    hop = hops[attempt - 2]
    if isinstance(hop, list) and len(hop) == 2 and all(isinstance(x, str) for x in hop):
        return hop[0], hop[1]
    return None


def _charged_to(plan: Mapping[str, Any], attempt: int) -> Meta:
    """The hop's limits replace the origin's: its tokens go to its own budgets."""
    charged = plan.get("limits")
    entry = charged[attempt - 2] if isinstance(charged, list) and attempt - 2 < len(charged) else None
    if not isinstance(entry, list) or not entry or not all(isinstance(x, str) for x in entry):
        return {"limit_model": "", "budgets": ""}
    return {"limit_model": entry[0], "budgets": BUDGET_SEPARATOR.join(entry[1:])}


def retarget(snap: Snapshot, decision: Mapping[str, Any], attempt: int, body: bytes) -> Retarget | None:
    """The hop's request, or None when this attempt cannot be retargeted (no
    hop for it, a backend this config does not have, a body that is not a
    JSON object): it then goes on unchanged."""
    plan = _retry(decision)
    hop = hop_for(plan, attempt)
    origin = plan.get("origin")
    if hop is None or not isinstance(origin, str) or hop[0] not in snap.backends:
        return None
    backend_name, upstream = hop
    backend = snap.backends[backend_name]
    try:
        data = parse_json(body)
    except BodyError:
        return None
    if plan.get("drop_effort") and "reasoning_effort" in data:
        del data["reasoning_effort"]  # a suffix's edit: a hop inherits no suffix
        data["model"] = upstream
        new_body = orjson.dumps(data)
    else:
        new_body = set_top_level(body, {"model": upstream}, data)
    sets, removes = upstream_auth(snap, backend)
    if not sets and decision.get("auth_replaced"):
        removes = CREDENTIAL_HEADERS + removes  # an earlier attempt's backend key never travels on
    meta: Meta = {
        "backend": backend_name, "upstream_model": upstream,
        "fallback_from": origin, "fallback_to": upstream, "fallback_reason": REASON,
        # The served model is named unless it is a hidden arm's; "" removes the header.
        "x_fallback_model": upstream if upstream not in snap.reserved else "",
    }
    meta.update(_charged_to(plan, attempt))
    if sets:
        meta["auth_replaced"] = True
    if decision.get("suffix"):
        meta.update(suffix_applied=False, x_model_variant_applied="false")
    path = backend.base_path + str(plan.get("path") or "/")
    return Retarget(new_body, path, sets + (("content-length", str(len(new_body))),), removes, meta)

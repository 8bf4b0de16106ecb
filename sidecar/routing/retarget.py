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

from ..decision import Decision, Fields, Retry
from ..payload.body import BodyError, parse_json, set_top_level
from .route import CREDENTIAL_HEADERS, Meta, upstream_auth
from .snapshot import Snapshot

REASON = "upstream_error"  # the previous attempt failed: connect failure, reset, 5xx or 429


@dataclass(frozen=True, slots=True)
class Retarget:
    body: bytes
    path: str
    set_headers: tuple[tuple[str, str], ...]
    remove_headers: tuple[str, ...]
    decision: Decision  # merged into the decision's metadata

    @property
    def meta(self) -> Meta:
        """:attr:`decision`, encoded."""
        return self.decision.encode()


def hop_for(plan: Retry, attempt: int) -> tuple[str, str] | None:
    """(backend, model) of attempt ``attempt`` (2 for the first hop), or None."""
    if attempt < 2 or attempt - 2 >= len(plan.hops):
        return None
    return plan.hops[attempt - 2]


def _charged_to(plan: Retry, attempt: int) -> Fields:
    """The hop's limits replace the origin's: its tokens go to its own budgets."""
    entry = plan.limits[attempt - 2] if attempt - 2 < len(plan.limits) else None
    if entry is None:
        return {"limit_model": "", "budgets": ()}
    return {"limit_model": entry[0], "budgets": entry[1:]}


def retarget(snap: Snapshot, decision: Decision | Mapping[str, Any], attempt: int, body: bytes) -> Retarget | None:
    """The hop's request, or None when this attempt cannot be retargeted (no
    hop for it, a backend this config does not have, a body that is not a
    JSON object): it then goes on unchanged."""
    if not isinstance(decision, Decision):
        decision = Decision.decode(decision)
    plan = decision.retry_plan() or _NO_HOPS
    hop = hop_for(plan, attempt)
    origin = plan.origin
    if hop is None or origin is None or hop[0] not in snap.backends:
        return None
    backend_name, upstream = hop
    backend = snap.backends[backend_name]
    try:
        data = parse_json(body)
    except BodyError:
        return None
    if plan.drop_effort and "reasoning_effort" in data:
        del data["reasoning_effort"]  # a suffix's edit: a hop inherits no suffix
        data["model"] = upstream
        new_body = orjson.dumps(data)
    else:
        new_body = set_top_level(body, {"model": upstream}, data)
    sets, removes = upstream_auth(snap, backend)
    if not sets and decision.auth_replaced:
        removes = CREDENTIAL_HEADERS + removes  # an earlier attempt's backend key never travels on
    meta: Fields = {
        "backend": backend_name, "upstream_model": upstream,
        "fallback_from": origin, "fallback_to": upstream, "fallback_reason": REASON,
        # The served model is named unless it is a hidden arm's; "" removes the header.
        "x_fallback_model": upstream if upstream not in snap.reserved else "",
    }
    meta.update(_charged_to(plan, attempt))
    if sets:
        meta["auth_replaced"] = True
    if decision.suffix:
        meta.update({"suffix_applied": False, "x_model_variant_applied": False})
    path = backend.base_path + (plan.path or "/")
    return Retarget(new_body, path, sets + (("content-length", str(len(new_body))),), removes, Decision(**meta))


_NO_HOPS = Retry((), None, (), None, False)

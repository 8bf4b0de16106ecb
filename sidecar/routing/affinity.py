"""Responses API affinity: calls about a stored response go to the backend holding it.

The owner comes from the id itself (:mod:`sidecar.payload.response_ids`), sealed by
the router: only the key that created a response may ask about it, and a
follow-up still passes the gates a create of the id's model on the id's
backend would pass. Every refusal is the answer an id the router never handed
out gets, so an id, forged or another key's, learns nothing about backends,
keys or hidden models.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from .. import errors
from ..errors import Reply
from ..payload.response_ids import Owner, untag
from .context import Caller
from .reservation import reserved_by
from .route import ResponsePlan, Route, upstream_auth
from .snapshot import BackendInfo, Snapshot


def owner_backend(snap: Snapshot, caller: Caller, response_id: str) -> tuple[Owner, BackendInfo, str] | None:
    """``(owner, its backend, the engine's id)`` when the id names a backend this
    caller may reach for the id's model; None otherwise, whatever the reason."""
    found = untag(response_id, snap.id_key)
    if found is None:
        return None
    owner, upstream = found
    if owner.key_id != (caller.key.id if caller.key is not None else ""):
        return None  # another key's response
    backend = snap.backends.get(owner.backend)
    if backend is None or not backend.config.enabled or backend.internal or backend.family != "openai":
        return None
    key = caller.key
    if key is not None and key.allowed_backends is not None and owner.backend not in key.allowed_backends:
        return None
    if key is not None and key.allowed_models is not None and owner.model not in key.allowed_models:
        return None
    if reserved_by(snap, owner.model) is not None:
        return None  # the router never hands out such an id: a create of a reserved name is refused
    return owner, backend, upstream


def follow_up(snap: Snapshot, path: str, response_id: str, about: str, caller: Caller) -> Route | Reply:
    """Retrieve, delete, cancel or list the input items of one stored response."""
    placed = owner_backend(snap, caller, response_id)
    if placed is None:
        return errors.response_not_found(response_id)
    owner, backend, upstream = placed
    query = path.partition("?")[2]
    new_path = f"{backend.base_path}/v1/responses/{quote(upstream, safe='')}{about}" + ("?" + query if query else "")
    plan = ResponsePlan(family="openai", kind="follow_up", not_found=response_id, response_id=upstream)
    if about != "/input_items":
        # The answer is the stored response (an input items list carries neither
        # its id nor a model): it gets the id and model name the create's answer had.
        plan.id_tag = owner.payload()
        plan.rewrite_model = owner.model if owner.rewrite else None
    set_headers, remove_headers = upstream_auth(snap, backend)
    return Route(backend, owner.model, "", path=new_path, set_headers=set_headers, remove_headers=remove_headers,
                 plan=plan)


def continued(snap: Snapshot, caller: Caller, data: dict[str, Any]) -> tuple[str, str] | Reply | None:
    """``(owner backend, the engine's id)`` of the response a create continues
    (``previous_response_id``), a refusal when the router cannot place it, or
    None when the request continues nothing."""
    prev = data.get("previous_response_id")
    if not isinstance(prev, str):
        return None
    placed = owner_backend(snap, caller, prev)
    if placed is None:
        return errors.previous_response_not_found(prev)
    return placed[1].name, placed[2]

"""Which way a request goes, from its headers and then its body.

A request is refused, answered by the router itself (a model listing), routed
by the id of a stored response (a Responses API follow-up), judged on the
models a path outside the ingress table names (passthrough), or decided from
its body (an ingress). The ext_proc handler and explain both run this module,
so the live path and its explanation cannot drift apart.

:func:`at_headers` takes what the headers decide; when it leaves the outcome
open, :func:`at_body` decides with the body. Both fill a trace when given one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from .. import errors
from ..errors import Reply
from ..payload.body import named_models_or_error
from . import listing
from .affinity import follow_up
from .context import Caller, Request, authenticate
from .decide import decide
from .ingress import Family, Ingress, canonical, family_for, lookup, path_problem
from .ingress import follow_up as follow_up_of
from .ingress import listing_path as listing_of
from .passthrough import passthrough
from .route import Route
from .selection import BackendView
from .snapshot import Snapshot
from .trace import Trace

Kind = Literal["refused", "listing", "follow_up", "passthrough", "ingress"]


@dataclass(slots=True)  # not frozen: one per request, and a frozen __init__ sets each field through object.__setattr__
class Head:
    """What a request's headers decide. ``outcome`` is None when the body decides.
    Nothing changes one after it is made."""

    path: str  # canonical
    family: Family
    kind: Kind
    ingress: Ingress | None = None
    caller: Caller | None = None
    outcome: Route | Reply | None = None


@dataclass(slots=True)  # not frozen, as Head
class Live:
    """What the serving process supplies to a decision: clocks, the round-robin
    counter, randomness, the monitor's states and the token budgets spent.
    Nothing changes one after it is made."""

    now: float = 0.0
    mono: float = 0.0
    pick: int = 0
    rand: float = 0.0
    shadow_rand: float = 1.0  # 1.0: never copied to a shadow arm
    states: Mapping[str, BackendView] = field(default_factory=dict)
    spent: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    random_bytes: Callable[[int], bytes] = os.urandom


def at_headers(
    snap: Snapshot, raw_path: str, headers: Mapping[str, str], method: str, *, body_follows: bool,
    trace: Trace | None = None,
) -> Head:
    """The headers' part of the decision. ``body_follows``: a body is on its way."""
    path = canonical(raw_path)
    ingress = lookup(path)
    family = ingress.family if ingress is not None else family_for(path)
    problem = path_problem(raw_path)
    if problem is not None:
        if trace is not None:
            trace.stage("ingress", f"refused: {problem}", path=raw_path)
        return Head(path, family, "refused", outcome=errors.error("invalid_request", problem, family))
    if trace is not None:
        trace.stage("ingress", f"{ingress.path} ({family}, {ingress.body} body)" if ingress is not None
                    else "not a model endpoint", path=path, family=family)
    caller = authenticate(snap, headers, family, trace)
    if isinstance(caller, Reply):
        return Head(path, family, "refused", ingress, outcome=caller)
    refusal = _unreadable(snap, headers, family, body_follows)
    if refusal is not None:
        return Head(path, family, "refused", ingress, caller, refusal)
    if ingress is not None:
        return Head(path, family, "ingress", ingress, caller)
    about = follow_up_of(path)
    if about is not None:
        if trace is not None:
            trace.stage("follow_up", f"about the stored response {about[0]}")
        return Head(path, family, "follow_up", None, caller, follow_up(snap, path, *about, caller))
    listed = listing_of(path)
    if listed is not None:
        if trace is not None:
            trace.stage("listing", f"{listed}: answered by the sidecar, filtered for the key")
        return Head(path, family, "listing", None, caller, listing.answer(snap, listed, method, caller.key))
    # Refuse at once what no body can change (passthrough off, a restricted key).
    early = passthrough(snap, path, caller, family, [])
    return Head(path, family, "passthrough", None, caller, early if isinstance(early, Reply) else None)


def at_body(
    snap: Snapshot, head: Head, body: bytes, headers: Mapping[str, str], live: Live, trace: Trace | None = None,
) -> Route | Reply:
    """The body's part of the decision, for a head whose outcome is open."""
    assert head.caller is not None and head.outcome is None, "at_body follows an open at_headers"
    if len(body) > snap.max_body_bytes:
        return errors.too_large(snap.max_body_bytes, head.family)
    if head.ingress is None:
        models = named_models_or_error(head.path, body, headers.get("content-type", ""))
        if trace is not None and isinstance(models, list):
            trace.stage("passthrough", f"names the models {models}" if models else "names no model", models=models)
        elif trace is not None:
            trace.stage("passthrough", f"refused: {models}")
        return passthrough(snap, head.path, head.caller, head.family, models)
    # Every field, in Request's order (keywords cost about 0.1 µs each on the request path).
    return decide(snap, Request(
        head.ingress, head.path, headers, body, head.caller, live.now, live.pick, live.rand, live.shadow_rand,
        live.random_bytes, live.states, live.mono, trace, live.spent,
    ))


def _unreadable(snap: Snapshot, headers: Mapping[str, str], family: Family, body_follows: bool) -> Reply | None:
    """A body the router cannot read: compressed, or declared over the limit."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if body_follows and encoding not in ("", "identity"):
        return errors.unsupported_encoding(encoding, family)
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > snap.max_body_bytes:
        return errors.too_large(snap.max_body_bytes, family)
    return None


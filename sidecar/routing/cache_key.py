"""The response cache's stage of the decision: may this request's answer be
cached, and under which key. Pure: the store itself is :mod:`sidecar.stores.cache`.

The key is a digest of what decides the answer and who may read it:

- the ingress;
- the resolved route: the upstream model, the backends the request may use
  after the key's allow-list and the arm's pin (not the one backend picked,
  which moves with load);
- the experiment and variant when one resolved (never the sticky window), so
  one arm never answers from another arm's entries, even when both dispatch
  the same model to the same backend;
- the scope: the caller's key id by default, everyone with ``scope: shared``;
- the request body as the backend gets it, in a canonical form: keys sorted,
  whitespace gone, and without the fields that do not change the answer (the
  model, which the route stands for, ``stream: false``, and identifiers the
  answer does not echo);
- the query string, as sent (``?api-version=`` chooses an API version);
- every request header the backend gets but those known not to change an
  answer (credentials, transport, tracing, SDK telemetry, request ids, the
  router's own): engines read ``anthropic-version``, ``anthropic-beta``,
  ``openai-beta`` and headers of their own, and a header an engine reads is a
  header two callers must agree on before one may have the other's answer.

A suffix changes the key only through the route it resolves to (``:thinking``
adds a field the backend sees); ``:online`` and streamed requests are never
cached. Entries hold the backend's answer before the router renames its
model (a suffixed name, ``response_model: client``): each hit gets the
rename its own request calls for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from ..config.schema import Cache
from .context import Request
from .route import CachePlan, Route

VERSION = b"mr-cache-v1"

# Per ingress, the top-level fields that change neither the answer nor its
# bytes (the Responses API echoes user and metadata, so it keeps them).
_IGNORED: Mapping[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"model", "user"}),
    "/v1/completions": frozenset({"model", "user"}),
    "/v1/embeddings": frozenset({"model", "user"}),
    "/v1/responses": frozenset({"model"}),
    "/anthropic/v1/messages": frozenset({"model", "metadata"}),
}


# Request headers that never change an answer: left out of the key so that
# clients differing only in them share entries.
_NEUTRAL_HEADERS = frozenset({
    ":authority", ":method", ":path", ":scheme", "host", "authorization", "x-api-key", "content-length",
    "content-type", "accept", "accept-encoding", "accept-language", "connection", "keep-alive", "te", "via",
    "user-agent", "origin", "referer", "cookie", "forwarded", "priority", "cache-control", "pragma",
    "x-request-id", "x-client-request-id", "idempotency-key", "x-real-ip", "traceparent", "tracestate", "baggage",
    "openai-organization", "openai-project", "x-data-parallel-rank",
})
_NEUTRAL_PREFIXES = ("x-forwarded-", "x-envoy-", "x-b3-", "b3", "sec-", "x-stainless-", "x-model-router-",
                     "x-continuum-")


def answer_headers(headers: Mapping[str, str], sticky: str | None = None) -> list[tuple[str, str]]:
    """The request headers that may change the answer, sorted. ``sticky``: the
    experiment's sticky header, which chose the arm (already in the key)."""
    return sorted(
        (k, v) for k, v in headers.items()
        if k not in _NEUTRAL_HEADERS and not k.startswith(_NEUTRAL_PREFIXES) and k != sticky
    )


def directives(headers: Mapping[str, str]) -> frozenset[str]:
    """The request's ``cache-control`` directives, lower case."""
    value = headers.get("cache-control", "")
    return frozenset(d.strip().partition("=")[0].lower() for d in value.split(",") if d.strip())


def opted_in(cfg: Cache, client_model: str, experiment: str | None) -> bool:
    if not cfg.enabled:
        return False
    if cfg.models is None and cfg.experiments is None:
        return True
    return client_model in (cfg.models or ()) or (experiment is not None and experiment in (cfg.experiments or ()))


def scope(cfg: Cache, req: Request) -> str:
    """Who may read an entry: one key id, one presented key (no api_keys
    section: only its digest enters the key), nobody in particular, or all."""
    if cfg.scope == "shared":
        return "*"
    caller = req.caller
    if caller.key is not None:
        return "id:" + caller.key.id
    if caller.api_key is not None:
        return "key:" + hashlib.sha256(caller.api_key.encode()).hexdigest()
    return "anonymous"


def canonical_body(path: str, data: Mapping[str, Any]) -> bytes:
    # A copy and a few removals, not a walk over every member: the work stays native.
    kept = dict(data)
    for k in _IGNORED.get(path, frozenset({"model"})):
        kept.pop(k, None)
    if kept.get("stream") is False:
        del kept["stream"]
    return orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)


def key_of(
    cfg: Cache, req: Request, route: Route, data: Mapping[str, Any], backends: list[str] | None,
    sticky: str | None = None,
) -> str:
    plan = route.plan
    material = orjson.dumps([
        req.ingress.path, route.upstream_model, backends,
        plan.experiment if plan is not None else None, plan.variant if plan is not None else None,
        scope(cfg, req), req.path.partition("?")[2], answer_headers(req.headers, sticky),
    ])
    h = hashlib.sha256(VERSION + b"\x00" + material + b"\x00")
    h.update(canonical_body(req.ingress.path, data))
    return h.hexdigest()


def plan_cache(
    cfg: Cache | None, req: Request, route: Route, data: Mapping[str, Any] | None, backends: list[str] | None,
    sticky: str | None = None,
) -> tuple[CachePlan | None, str]:
    """The cache plan for a routed request, or None, and why (for the trace).

    ``data`` is the JSON body as the backend gets it; ``backends`` the sorted
    backends the request may use (None: any that serves the model); ``sticky``
    the experiment's sticky header, if it has one."""
    if cfg is None:
        return None, "no cache section"
    plan = route.plan
    if not req.ingress.cacheable or data is None or plan is None or plan.kind != "routed":
        return None, "this endpoint is not cached"
    if not opted_in(cfg, route.client_model, plan.experiment):
        return None, "not opted in" if cfg.enabled else "the cache is disabled"
    if data.get("stream") is True:
        return None, "streamed"
    if plan.suffix == "online":
        return None, ":online is never cached"
    if route.hops:
        # The answer may come from a later hop of the chain, another route than the key names.
        return None, "a failed attempt may move to another model in this request"
    wanted = directives(req.headers)
    if "no-store" in wanted:
        return None, "the client sent cache-control: no-store"
    read = "no-cache" not in wanted
    if not read and cfg.scope == "shared":
        # A shared entry is everyone's answer: one caller's no-cache must not rewrite it.
        return None, "the client sent cache-control: no-cache (a shared entry is neither read nor replaced)"
    key = key_of(cfg, req, route, data, backends, sticky)
    verdict = "lookup, then store a miss" if read else "store only: the client sent cache-control: no-cache"
    return CachePlan(key, read, cfg.ttl_s, cfg.max_entry_bytes), verdict

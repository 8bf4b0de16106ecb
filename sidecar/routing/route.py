"""What a decision hands to the adapter: the route, and the plan for its answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..decision import Decision, Fields, Retry, encode
from .attempts import Hop, composite_cluster
from .memo import PerSnapshot
from .snapshot import BackendInfo, Snapshot

if TYPE_CHECKING:
    from .limits import LimitPlan

Meta = dict[str, "str | bool | float"]  # a decision, encoded


@dataclass(slots=True)
class ResponsePlan:
    """What a routed request's answer carries: its attribution, published to
    Envoy as dynamic metadata, and what (if anything) must change in it."""

    family: str
    kind: str = "routed"  # routed | count_tokens (counted for tokens only) | follow_up (about a stored response)
    estimate: tuple[int, int] | None = None  # (prompt, completion) charged when no usage arrives (routing.limits.estimate)
    background: bool = False  # a Responses API create answered before it runs
    rewrite_model: str | None = None  # top-level model to write into the response
    read_usage: bool = False  # the response's token usage is counted
    strip_injected_usage: bool = False
    experiment: str | None = None
    variant: str | None = None
    assignment: str | None = None  # "sticky" | "random"
    caller: str | None = None  # sticky only: the caller key's first 8 bytes, hex (the SRM sample's id)
    attribute: bool = False  # send x-continuum-experiment[-variant]
    suffix: str | None = None  # nitro | floor | thinking | online
    suffix_applied: bool = True
    fallback: Fallback | None = None
    # For the hops a failed attempt moves to (set only when there are some):
    chain_origin: str | None = None  # the model the fallback is counted from
    hop_path: str | None = None  # the upstream path without the backend's base path
    drop_effort: bool = False  # the suffix added reasoning_effort: a hop removes it
    cache: CachePlan | None = None
    id_tag: str | None = None  # put before the Responses API ids of the answer (sidecar.payload.response_ids)
    # A follow-up's id as the client sent it: the engine's 404 becomes the
    # router's own, so no answer tells an id the engine lost from one never issued.
    not_found: str | None = None
    response_id: str | None = None  # a follow-up: the engine's id of the stored response it is about

    @property
    def needs_response(self) -> bool:
        """Whether the sidecar must see the response body: to change it, or
        to store it in the response cache."""
        return (self.rewrite_model is not None or self.strip_injected_usage or self.cache is not None
                or self.id_tag is not None or self.not_found is not None)

    def decision(self) -> Decision:
        """The decision as Envoy dynamic metadata: read back by the access log
        (metrics, usage records), by the route's response headers (``x_*``
        keys) and by the response processor."""
        return Decision.of(self.fields())

    def fields(self) -> Fields:
        """:meth:`decision`'s keyword arguments."""
        m: Fields = {"kind": self.kind, "family": self.family}
        if self.estimate is not None and self.kind == "routed":
            m["estimate"] = self.estimate
        if self.background:
            m["background"] = True
        if self.response_id is not None:
            m["response_id"] = self.response_id
        if self.experiment is not None:
            m.update({"experiment": self.experiment, "variant": self.variant or "",
                      "assignment": self.assignment or ""})
            if self.caller is not None:
                m["caller"] = self.caller
            if self.attribute:
                m.update({"x_experiment": self.experiment, "x_experiment_variant": self.variant or ""})
        if self.suffix is not None:
            m.update({"suffix": self.suffix, "suffix_applied": self.suffix_applied,
                      "x_model_variant": self.suffix})
            if not self.suffix_applied:
                m["x_model_variant_applied"] = False
        if self.fallback is not None:
            m.update({"fallback_from": self.fallback.origin, "fallback_to": self.fallback.served,
                      "fallback_reason": self.fallback.reason})
            if self.fallback.announce:
                m["x_fallback_model"] = self.fallback.served
        if self.needs_response:
            m.update({"rewrite_model": self.rewrite_model or "", "strip_usage": self.strip_injected_usage})
            if self.id_tag is not None:
                m["id_tag"] = self.id_tag
            if self.not_found is not None:
                m["not_found"] = self.not_found
        if self.cache is not None:
            # The response processor stores the answer the client gets under this key.
            m.update({"cache_key": self.cache.key, "cache_ttl_s": self.cache.ttl_s,
                      "cache_max_bytes": self.cache.max_entry_bytes, "x_cache": "miss" if self.cache.read else "bypass"})
        return m

    def metadata(self) -> Meta:
        """:meth:`decision`, encoded."""
        return encode(self.fields())


@dataclass(frozen=True, slots=True)
class CachePlan:
    """The response cache's part of a routed request's plan."""

    key: str  # hex digest (sidecar.routing.cache_key)
    read: bool  # look the key up first (False: the client sent cache-control: no-cache)
    ttl_s: int
    max_entry_bytes: int


@dataclass(frozen=True, slots=True)
class Fallback:
    """A request served by a hop of its model's fallback chain."""

    origin: str  # the model the request (or its arm) dispatches first
    served: str  # the hop's model
    reason: str  # no_admissible_backend (at selection) | upstream_error (after a failed attempt)
    announce: bool  # name the served model in a response header (never a reserved one)


@dataclass(slots=True)
class Route:
    backend: BackendInfo
    client_model: str
    upstream_model: str
    body: bytes | None = None  # replacement request body, None = unchanged
    path: str | None = None  # replacement :path, None = unchanged
    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    plan: ResponsePlan | None = None
    limits: LimitPlan | None = None  # the limits the request falls under
    hops: tuple[Hop, ...] = ()  # where a failed attempt moves to
    shadow: tuple[str, str] | None = None  # (cluster, arm id): Envoy copies this request to a shadow arm

    @property
    def cluster(self) -> str:
        """The Envoy cluster the request goes to: its backend's, or the
        composite of the backend and its hops."""
        return composite_cluster(self.backend.name, self.hops) if self.hops else self.backend.name

    def decision(self) -> Decision:
        return Decision.of(self.fields())

    def fields(self) -> Fields:
        """:meth:`decision`'s keyword arguments (one dict: this runs for every routed request)."""
        m: Fields = self.plan.fields() if self.plan is not None else {"kind": "passthrough"}
        if self.limits is not None:
            m.update(self.limits.fields())
        m["backend"] = self.backend.name
        if self.hops and self.plan is not None:
            # For the hop filter, in one field (each field costs in every access-log entry):
            # attempt n + 1 goes to hops[n - 1] = [backend, model].
            plan = self.plan
            m["retry"] = Retry(
                tuple((h.backend, h.upstream_model) for h in self.hops), plan.chain_origin,
                tuple((h.limit_model, *h.budgets) for h in self.hops), plan.hop_path, plan.drop_effort,
            ).encode()
            if self.backend.api_key:
                m["auth_replaced"] = True  # a hop without a key of its own removes this one
        if self.client_model:
            m.update({"client_model": self.client_model, "upstream_model": self.upstream_model})
        return m

    def metadata(self) -> Meta:
        """:meth:`decision`, encoded: the metadata Envoy gets."""
        return encode(self.fields())


# The client's address as Envoy reports it to upstreams.
CLIENT_ADDRESS_HEADERS = ("x-forwarded-for", "x-envoy-external-address")
# Where a key travels, in either API family.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")


def credentials(backend: BackendInfo) -> tuple[tuple[str, str], ...]:
    """The backend's own key as its API family expects it (none without an ``api_key``).
    The request path and the monitor's polls both send it this way."""
    if not backend.api_key:
        return ()
    if backend.family == "anthropic":
        return (("x-api-key", backend.api_key),)
    return (("authorization", f"Bearer {backend.api_key}"),)


Auth = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]  # (headers to set, headers to remove)
_auth: PerSnapshot[Auth] = PerSnapshot()


def upstream_auth(snap: Snapshot, backend: BackendInfo) -> Auth:
    """Credentials toward the backend (a router key never travels upstream),
    and the client's address removed where it must not go (once per snapshot and backend)."""
    found = _auth.find(snap, backend.name)
    return found if found is not None else _auth.keep(backend.name, _upstream_auth(snap, backend))


def _upstream_auth(snap: Snapshot, backend: BackendInfo) -> Auth:
    forward = backend.config.forward_client_address
    hidden = CLIENT_ADDRESS_HEADERS if not (backend.tls is False if forward is None else forward) else ()
    sent = credentials(backend)
    if sent:
        return sent, (*(h for h in CREDENTIAL_HEADERS if h != sent[0][0]), *hidden)
    if snap.keys is not None:
        return (), (*CREDENTIAL_HEADERS, *hidden)
    return (), hidden

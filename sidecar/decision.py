"""The decision as it crosses Envoy: one typed codec for the dynamic metadata
the sidecar writes in the ``contract.NAMESPACE`` namespace.

Routing and the request handler write a decision as its typed keyword
arguments (:class:`Fields`, or a :class:`Decision` built from them);
``encode`` gives the metadata Envoy gets (string, bool and number values
under the keys below). The response stream, the fallback hop stream and the
access log (metering, budgets, spans, logs, the sample-ratio check) read it
back (``decode``, from the ``Struct`` or the plain mapping they receive). A
key no reader knows is dropped on decoding; a key that is missing, or whose
value has another type, reads as ``None``.

The attributes are the keys. The generated Envoy configuration names the
ones it reads (the ``x_*`` keys become response headers) with the constants
below.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypedDict, Unpack, cast

import orjson

if TYPE_CHECKING:  # (imported by the worker supervisor's logging too, which loads no protobuf)
    from google.protobuf import struct_pb2

# Keys the generated Envoy configuration names (``%DYNAMIC_METADATA(ns:key)%``, matchers).
KIND = "kind"
FAMILY = "family"
REPLY = "reply"  # present on the sidecar's own answers
CLIENT_MODEL = "client_model"
LIMIT_MODEL = "limit_model"
X_RL_UNIT = "x_rl_unit"
X_RL_LIMIT = "x_rl_limit"
X_RATELIMIT_LIMIT_TOKENS = "x_ratelimit_limit_tokens"
X_RATELIMIT_REMAINING_TOKENS = "x_ratelimit_remaining_tokens"
X_RATELIMIT_RESET_TOKENS = "x_ratelimit_reset_tokens"
X_EXPERIMENT = "x_experiment"
X_EXPERIMENT_VARIANT = "x_experiment_variant"
X_MODEL_VARIANT = "x_model_variant"
X_MODEL_VARIANT_APPLIED = "x_model_variant_applied"
X_FALLBACK_MODEL = "x_fallback_model"
X_EXPLAIN = "x_explain"
X_CACHE = "x_cache"
X_REQUEST_ID = "x_request_id"
SHAPE = "shape"  # a routed answer's shape (``shape_of``); "" on every other write of the namespace

BUDGET_SEPARATOR = "\n"  # between rule ids in ``budgets`` (no model name has a control character)


class Fields(TypedDict, total=False):
    """The keyword arguments of :class:`Decision` (its fields, each optional). A dict of them is
    what the request path builds and encodes, so it never holds None.."""

    kind: str
    reply: str
    refusal: str
    request_id: str
    x_request_id: str
    ingress: str
    key_id: str
    span_id: str
    x_explain: str
    x_cache: str
    family: str
    backend: str
    client_model: str
    upstream_model: str
    retry: str
    auth_replaced: bool
    estimate: tuple[int, int]
    background: bool
    response_id: str
    experiment: str
    variant: str
    assignment: str
    caller: str
    x_experiment: str
    x_experiment_variant: str
    suffix: str
    suffix_applied: bool
    x_model_variant: str
    x_model_variant_applied: bool
    fallback_from: str
    fallback_to: str
    fallback_reason: str
    x_fallback_model: str
    rewrite_model: str
    strip_usage: bool
    id_tag: str
    not_found: str
    cache_key: str
    cache_ttl_s: int
    cache_max_bytes: int
    limit_model: str
    limit_refused: str
    x_rl_unit: str
    x_rl_limit: str
    budgets: tuple[str, ...]
    reserved: tuple[int, float]
    x_ratelimit_limit_tokens: str
    x_ratelimit_remaining_tokens: str
    x_ratelimit_reset_tokens: str
    feedback_for: str
    feedback_name: str
    feedback_value: bool | float
    feedback_replaces: bool
    feedback_revision: int
    feedback_comment: str


@dataclass(frozen=True, init=False)
class Decision:
    """One request's decision; ``None``: the key is not in the metadata.

    Built from keyword arguments (only the keys given are set) and merged
    with ``|`` (the right side's keys win, as Envoy merges a namespace)."""

    # What answered, and the request's own values.
    kind: str | None = None  # routed | passthrough | count_tokens | follow_up | refusal | answered | listing | shed | cache_hit | feedback
    reply: str | None = None  # "sidecar" on the sidecar's own answers (Envoy's reply mapping leaves them alone)
    refusal: str | None = None  # the refusal's error code
    request_id: str | None = None
    x_request_id: str | None = None  # Anthropic ingresses: returned as ``request-id``
    ingress: str | None = None  # the ingress path
    key_id: str | None = None
    span_id: str | None = None  # the router's span, named upstream
    x_explain: str | None = None  # the decision trace's summary
    x_cache: str | None = None  # hit | miss | bypass
    # The route.
    family: str | None = None  # openai | anthropic
    backend: str | None = None
    client_model: str | None = None
    upstream_model: str | None = None
    retry: str | None = None  # the fallback hops, JSON (:class:`Retry`)
    auth_replaced: bool | None = None  # the backend's key replaced the client's
    estimate: tuple[int, int] | None = None  # (prompt, completion) charged when no usage arrives
    background: bool | None = None  # a background Responses API create
    response_id: str | None = None  # a follow-up: the engine's id of the stored response
    # The experiment arm.
    experiment: str | None = None
    variant: str | None = None
    assignment: str | None = None  # sticky | random
    caller: str | None = None  # sticky: the caller key's hash, hex
    x_experiment: str | None = None
    x_experiment_variant: str | None = None
    # The variant suffix.
    suffix: str | None = None
    suffix_applied: bool | None = None
    x_model_variant: str | None = None
    x_model_variant_applied: bool | None = None  # on the wire "true" / "false" (a header value)
    # The fallback.
    fallback_from: str | None = None
    fallback_to: str | None = None
    fallback_reason: str | None = None
    x_fallback_model: str | None = None  # "" removes the header
    # The response stream's work.
    rewrite_model: str | None = None  # "": leave the model
    strip_usage: bool | None = None
    id_tag: str | None = None
    not_found: str | None = None
    cache_key: str | None = None
    cache_ttl_s: int | None = None  # on the wire a string of digits
    cache_max_bytes: int | None = None  # on the wire a string of digits
    # Limits.
    limit_model: str | None = None  # "" on a hop charged to no limit
    limit_refused: str | None = None  # tokens: a spent budget refused it
    x_rl_unit: str | None = None
    x_rl_limit: str | None = None
    budgets: tuple[str, ...] | None = None  # rule ids; on the wire joined by BUDGET_SEPARATOR
    reserved: tuple[int, float] | None = None  # (tokens, the time whose windows hold them); "n@t" on the wire
    x_ratelimit_limit_tokens: str | None = None
    x_ratelimit_remaining_tokens: str | None = None
    x_ratelimit_reset_tokens: str | None = None
    # Accepted feedback.
    feedback_for: str | None = None
    feedback_name: str | None = None
    feedback_value: bool | float | None = None
    feedback_replaces: bool | None = None
    feedback_revision: int | None = None
    feedback_comment: str | None = None

    # An instance holds only the keys that are set (the rest read as the class's None).
    def __init__(self, **values: Unpack[Fields]) -> None:
        self.__dict__.update(values if None not in values.values() else  # (an untyped caller's None)
                             {k: v for k, v in values.items() if v is not None})

    @staticmethod
    def of(fields: Fields) -> Decision:
        """The decision of a dict of keyword arguments (taken over, not copied)."""
        return _made(cast(dict[str, Any], fields))

    def __or__(self, other: Decision) -> Decision:
        if not other.__dict__:
            return self
        return _made({**self.__dict__, **other.__dict__})

    def __bool__(self) -> bool:
        """Whether any key is set (an empty decision: the sidecar never decided)."""
        return bool(self.__dict__)

    def without(self, *keys: str) -> Decision:
        """This decision without ``keys`` (constants of this module)."""
        return _made({k: v for k, v in self.__dict__.items() if k not in keys})

    def encode(self) -> dict[str, str | bool | float]:
        """The metadata Envoy gets: the keys that are set, in wire types."""
        return encode(cast(Fields, self.__dict__))

    @classmethod
    def decode(cls, metadata: struct_pb2.Struct | Mapping[str, Any]) -> Decision:
        """From the namespace's ``Struct`` (a metadata context, an access-log
        entry) or from a plain mapping of wire values."""
        if isinstance(metadata, dict):
            return _from_plain(metadata)
        if hasattr(metadata, "fields"):  # a Struct (a Mapping too, but one read in Python)
            return _from_struct(metadata)
        return _from_plain(metadata)

    def retry_plan(self) -> Retry | None:
        """The fallback hops ``retry`` names, or None without (readable) ones."""
        return Retry.decode(self.retry) if self.retry is not None else None


KEYS = tuple(f.name for f in fields(Decision))
# Keys whose values are (nearly) unique to one request. The request handler
# builds each shape of answer once and sets these on a copy: a new key of
# that kind belongs here (left out, every request would build its own
# skeleton: still correct, but as slow as building the answer field by field).
PER_REQUEST = frozenset((
    "request_id", "x_request_id", "key_id", "caller", "x_explain", "cache_key", "span_id", "estimate", "reserved",
    "not_found", "response_id", "x_ratelimit_remaining_tokens", "x_ratelimit_reset_tokens",
))
EMPTY = Decision()
# The shape names a routed answer's keys other than the request's own: a digest
# of them, tagged with the PER_REQUEST set that split them (a reader whose set
# differs, another release's, reads such a decision whole).
_TAG = hashlib.blake2b(",".join(sorted(PER_REQUEST)).encode(), digest_size=3).hexdigest()
SHAPES = 4096  # shapes a reader keeps before starting over


def unshaped(d: Decision) -> dict[str, Any]:
    """The metadata of every write but a routed answer's: ``d`` encoded, and
    an empty ``shape``. Envoy merges a write into the namespace's keys already
    there, so a shape an earlier answer named no longer describes them."""
    out = d.encode()
    out[SHAPE] = ""
    return out


def shape_of(md: Mapping[str, Any]) -> str:
    """The ``shape`` of a routed answer whose metadata, without the request's
    own keys (PER_REQUEST), is ``md`` (in wire types)."""
    digest = hashlib.blake2b(orjson.dumps(md, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
    return f"{digest}.{_TAG}"


def encode(fields: Fields) -> dict[str, Any]:
    """A dict of keyword arguments straight to the wire, as :meth:`Decision.encode`
    (the request path's answer builds no Decision)."""
    out: dict[str, Any] = dict(fields)
    for k, enc in _ENCODE.items():
        if k in out:
            out[k] = enc(out[k])
    return out


def _made(values: dict[str, Any]) -> Decision:
    d = object.__new__(Decision)
    d.__dict__.update(values)
    return d


@dataclass(frozen=True, slots=True)
class Retry:
    """The fallback hops of a route, for the hop filter (``retry``): attempt
    n + 1 goes to ``hops[n - 1]``, charged to ``limits[n - 1]`` (its limit
    model, then its budgets). An entry that does not read is None."""

    hops: tuple[tuple[str, str] | None, ...]
    origin: str | None  # the model the fallback is counted from
    limits: tuple[tuple[str, ...] | None, ...]
    path: str | None  # the upstream path without the backend's base path
    drop_effort: bool  # the suffix added reasoning_effort: a hop removes it

    def encode(self) -> str:
        return orjson.dumps({
            "hops": [list(h) if h is not None else None for h in self.hops], "origin": self.origin,
            "limits": [list(x) if x is not None else None for x in self.limits],
            "path": self.path or "/", "drop_effort": self.drop_effort,
        }).decode()

    @staticmethod
    def decode(text: str) -> Retry | None:
        try:
            plan = orjson.loads(text or "{}")
        except orjson.JSONDecodeError:
            return None
        if not isinstance(plan, dict):
            return None
        hops, limits, origin, path = plan.get("hops"), plan.get("limits"), plan.get("origin"), plan.get("path")
        return Retry(
            tuple(_hop(h) for h in hops) if isinstance(hops, list) else (),
            origin if isinstance(origin, str) else None,
            tuple(_charged(x) for x in limits) if isinstance(limits, list) else (),
            str(path) if path else None,
            bool(plan.get("drop_effort")),
        )


def _hop(h: Any) -> tuple[str, str] | None:
    if isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and isinstance(h[1], str):
        return h[0], h[1]
    return None


def _charged(x: Any) -> tuple[str, ...] | None:
    if isinstance(x, list) and x and all(isinstance(s, str) for s in x):
        return tuple(x)
    return None


# ---------------------------------------------------------------- wire types

def _digits(v: Any) -> int | None:
    return int(v) if isinstance(v, str) and v.isdigit() else None


def _estimate(v: Any) -> tuple[int, int] | None:
    if not isinstance(v, str):
        return None
    prompt, _, completion = v.partition(",")
    return (int(prompt), int(completion)) if prompt.isdigit() and completion.isdigit() else None


def _reserved(v: Any) -> tuple[int, float] | None:
    if not isinstance(v, str):
        return None
    amount, _, at = v.partition("@")
    try:
        return int(amount), float(at)
    except ValueError:
        return None


def _budgets(v: Any) -> tuple[str, ...] | None:
    if not isinstance(v, str):
        return None
    return tuple(v.split(BUDGET_SEPARATOR)) if v else ()


def _applied(v: Any) -> bool | None:
    return v == "true" if v in ("true", "false") else None


def _feedback_value(v: Any) -> bool | float | None:
    return v if isinstance(v, (bool, int, float)) else None


def _revision(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


_ENCODE: dict[str, Callable[[Any], str | bool | float]] = {
    "estimate": lambda v: f"{v[0]},{v[1]}",
    "reserved": lambda v: f"{v[0]}@{v[1]!r}",
    "budgets": BUDGET_SEPARATOR.join,
    "cache_ttl_s": str,
    "cache_max_bytes": str,
    "x_model_variant_applied": lambda v: "true" if v else "false",
}
# Keys whose wire value is not the field's value, and the reading of it.
_DECODE: dict[str, Callable[[Any], Any]] = {
    "estimate": _estimate,
    "reserved": _reserved,
    "budgets": _budgets,
    "cache_ttl_s": _digits,
    "cache_max_bytes": _digits,
    "x_model_variant_applied": _applied,
    "feedback_value": _feedback_value,
    "feedback_revision": _revision,
}
_BOOL_KEYS = frozenset(("auth_replaced", "background", "suffix_applied", "strip_usage", "feedback_replaces"))
_STRING_KEYS = frozenset(KEYS) - _BOOL_KEYS - frozenset(_DECODE)


def _from_plain(m: Mapping[str, Any]) -> Decision:
    out: dict[str, Any] = {}
    for k, v in m.items():
        if k in _STRING_KEYS:
            if isinstance(v, str):
                out[k] = v
        elif k in _BOOL_KEYS:
            if isinstance(v, bool):
                out[k] = v
        elif (dec := _DECODE.get(k)) is not None and (typed := dec(v)) is not None:
            out[k] = typed
    return _made(out)


def _from_struct(struct: struct_pb2.Struct) -> Decision:
    return _EVERY_KEY(struct)


class Reader:
    """Decodes a namespace's ``Struct``, reading only the keys it was built
    with (the rest read as unset), for a reader that uses only those: each
    value read from a ``Struct`` builds a wrapper object. Build one per set
    of keys, not per decision.

    A routed answer names its ``shape``: a reader reads a shape's keys the
    first time it meets it, and after that only the request's own
    (PER_REQUEST). A ``Struct`` with keys its shape does not account for (a
    write that left the shape in place) is read whole, and so is one whose
    shape was cut by another PER_REQUEST set."""

    __slots__ = ("bools", "decoders", "own_others", "own_strings", "shapes", "strings")

    def __init__(self, keys: Iterable[str]) -> None:
        wanted = frozenset(keys)
        self.strings, self.bools = _STRING_KEYS & wanted, _BOOL_KEYS & wanted
        self.decoders = {k: dec for k, dec in _DECODE.items() if k in wanted}
        self.own_strings = tuple(sorted(PER_REQUEST & self.strings))
        self.own_others = tuple(sorted(PER_REQUEST - self.strings))  # (those not wanted only counted)
        # shape: the values of its keys that are wanted, and how many keys it has
        self.shapes: dict[str, tuple[dict[str, Any], int]] = {}

    def __call__(self, struct: struct_pb2.Struct) -> Decision:
        fields_ = struct.fields
        if SHAPE not in fields_ or not (shape := fields_[SHAPE].string_value):
            return _made(self._whole(fields_))
        known = self.shapes.get(shape)
        if known is None:
            out = self._whole(fields_)
            if shape.endswith(_TAG):
                if len(self.shapes) >= SHAPES:
                    self.shapes.clear()
                size = sum(1 for k in fields_ if k not in PER_REQUEST)
                self.shapes[shape] = ({k: v for k, v in out.items() if k not in PER_REQUEST}, size)
            return _made(out)
        out = known[0].copy()
        size = known[1]
        for k in self.own_strings:  # (the usual kind, read here rather than through _read)
            if k in fields_:
                size += 1
                v = fields_[k]
                text = v.string_value
                if text or v.WhichOneof("kind") == "string_value":
                    out[k] = text
        for k in self.own_others:
            if k in fields_:
                size += 1
                self._read(k, fields_, out)
        return _made(out) if size == len(fields_) else _made(self._whole(fields_))

    def _whole(self, fields_: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in fields_:  # (items() goes through the Mapping mixin, in Python)
            self._read(k, fields_, out)
        return out

    def _read(self, k: str, fields_: Any, out: dict[str, Any]) -> None:
        """Key ``k`` into ``out``, if wanted and of its type."""
        if k in self.strings:
            v = fields_[k]
            text = v.string_value  # "" also when the value is not a string: then ask which it is
            if text or v.WhichOneof("kind") == "string_value":
                out[k] = text
        elif k in self.bools:
            v = fields_[k]
            if v.WhichOneof("kind") == "bool_value":
                out[k] = v.bool_value
        elif (dec := self.decoders.get(k)) is not None:
            v = fields_[k]
            if (which := v.WhichOneof("kind")) in _SCALARS and (typed := dec(getattr(v, which))) is not None:
                out[k] = typed


_SCALARS = frozenset(("string_value", "bool_value", "number_value"))
_EVERY_KEY = Reader(KEYS)

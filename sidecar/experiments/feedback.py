"""``POST /v1/feedback``: an outcome a caller reports on a request it made, counted on the arm that served it.

    {"request_id": "<the x-request-id the router returned>", "name": "thumbs_up", "value": true,
     "comment": "optional text, kept only in the usage records"}

The name must be one of the config's ``feedback_metrics``; a boolean metric
takes ``true``/``false``, a float metric a finite number. Only the key that
made the request may report on it: to any other key, and for a request the
router did not serve in an experiment (or no longer remembers), the answer is
the same 404. One value per request and name: a later one replaces the
earlier, and the metrics count it as a correction (the earlier value is
retracted), never as a second outcome.

:func:`parse` and :func:`owner_of` are pure; :class:`Feedback` keeps the join
(:mod:`.join`) and counts.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from prometheus_client import Counter, Histogram

from .. import errors
from ..decision import EMPTY, Decision, Fields
from ..errors import Reply
from ..metrics import REGISTRY
from .join import JoinStore, Served, Unavailable

if TYPE_CHECKING:
    from ..config.schema import Config

PATH = "/v1/feedback"
MAX_ID = 256
MAX_COMMENT = 4096
MAX_BODY = 64 * 1024
_FIELDS = frozenset(("request_id", "name", "value", "comment"))

GIVEN = Counter(
    "model_experiment_feedback",
    "Requests given feedback, per arm and metric (a replaced value is not counted again: see corrections).",
    ["experiment", "variant", "name"], registry=REGISTRY,
)
CORRECTIONS = Counter(
    "model_experiment_feedback_corrections",
    "Feedback that replaced an earlier value for the same request and metric.",
    ["experiment", "variant", "name"], registry=REGISTRY,
)
VALUE = Counter(
    "model_experiment_feedback_value",
    "Sum of the feedback values given (true = 1), replacements included; subtract "
    "model_experiment_feedback_value_retracted_total for the current sum.",
    ["experiment", "variant", "name"], registry=REGISTRY,
)
RETRACTED = Counter(
    "model_experiment_feedback_value_retracted",
    "Sum of the feedback values later replaced by another value for the same request and metric.",
    ["experiment", "variant", "name"], registry=REGISTRY,
)
DISTRIBUTION = Histogram(
    "model_experiment_feedback_distribution",
    "Float feedback values as given (replacements included), per arm and metric.",
    ["experiment", "variant", "name"], registry=REGISTRY,
    buckets=(0, 0.1, 0.25, 0.5, 0.75, 1, 2, 3, 4, 5, 7.5, 10, 25, 50, 100),
)
REFUSED = Counter(
    "model_router_feedback_refused_total",
    "Feedback refused: invalid (400, 405, 413), unknown (404: no such request for this key) or unavailable "
    "(503: the shared join store did not answer).",
    ["reason"], registry=REGISTRY,
)


def is_feedback(path: str) -> bool:
    """Whether a (canonical) request path is the feedback endpoint."""
    return path.partition("?")[0].rstrip("/").lower() == PATH


@dataclass(frozen=True, slots=True)
class Given:
    request_id: str
    name: str
    value: bool | float
    comment: str | None

    @property
    def number(self) -> float:
        return float(self.value)


def _invalid(message: str, param: str | None = None) -> Reply:
    return errors.error("invalid_feedback", message, "openai", param)


def parse(body: bytes, config: Config) -> Given | Reply:
    """The feedback a body gives, or the 400 that says what is wrong with it."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return errors.error("invalid_json", "The body must be a JSON object.", "openai")
    if not isinstance(doc, dict):
        return _invalid("The body must be a JSON object with request_id, name and value.")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        return _invalid(f"Unknown field '{unknown[0][:64]}'; feedback takes request_id, name, value and comment.",
                        unknown[0][:64])
    rid, name, value, comment = doc.get("request_id"), doc.get("name"), doc.get("value"), doc.get("comment")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID or not rid.isprintable():
        return _invalid(f"request_id must be the x-request-id the router returned (a string of 1 to {MAX_ID} "
                        f"printable characters).", "request_id")
    kinds = {m.name: m.type for m in config.feedback_metrics}
    if not isinstance(name, str) or name not in kinds:
        known = ", ".join(sorted(kinds)) or "none are configured"
        return _invalid(f"name must be a feedback metric the router declares ({known}).", "name")
    if kinds[name] == "boolean" and not isinstance(value, bool):
        return _invalid(f"'{name}' is a boolean metric: value must be true or false.", "value")
    if kinds[name] == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
        return _invalid(f"'{name}' is a float metric: value must be a finite number.", "value")
    if comment is not None and (not isinstance(comment, str) or len(comment) > MAX_COMMENT):
        return _invalid(f"comment must be a string of at most {MAX_COMMENT} characters.", "comment")
    assert isinstance(value, (bool, int, float))
    return Given(rid, name, value if isinstance(value, bool) else float(value), comment)


def owner_of(key_id: str | None, presented_key: str | None) -> str:
    """Whose request it is: the key's id, a digest of a key the config does not list, or "" without one."""
    if key_id is not None:
        return "id:" + key_id
    if presented_key is not None:
        return "key:" + hashlib.sha256(presented_key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return ""


def not_found(request_id: str) -> Reply:
    return errors.error(
        "request_not_found",
        f"No request '{request_id}' made with this key in an experiment is known to the router "
        "(unknown, outside any experiment, made with another key, or older than the feedback window).",
        "openai", "request_id",
    )


def _accepted(given: Given, replaced: bool) -> Reply:
    body = {"object": "feedback", "request_id": given.request_id, "name": given.name, "value": given.value,
            "replaced": replaced}
    return Reply(200, orjson.dumps(body))


class Feedback:
    """The join and the counting; the ext_proc adapter calls :meth:`record` and :meth:`handle`."""

    def __init__(self) -> None:
        self.join = JoinStore()

    def record(self, config: Config, request_id: str | None, owner: Callable[[], str], experiment: str | None,
               variant: str | None) -> None:
        """A routed request's arm, when feedback metrics are declared (no I/O;
        never raises). ``owner`` is asked only then."""
        if config.feedback_metrics and request_id and experiment and variant:
            self.join.record(config, request_id, Served(owner(), experiment, variant))

    async def handle(self, config: Config, method: str, owner: str, body: bytes) -> tuple[Reply, Decision]:
        """The answer to a feedback call and the metadata its usage record is made from."""
        if method.upper() != "POST":
            REFUSED.labels("invalid").inc()
            return errors.error("method_not_allowed", "Feedback is sent with POST.", "openai"), EMPTY
        given = errors.too_large(MAX_BODY, "openai") if len(body) > MAX_BODY else parse(body, config)
        if isinstance(given, Reply):
            REFUSED.labels("invalid").inc()
            return given, EMPTY
        try:
            served = await self.join.find(config, given.request_id)
            stored = None
            if served is not None and served.owner == owner:
                stored = await self.join.give(config, given.request_id, given.name, given.number)
        except Unavailable:
            REFUSED.labels("unavailable").inc()
            return errors.error("feedback_unavailable", "Feedback cannot be recorded right now; retry shortly.",
                                "openai"), EMPTY
        if served is None or stored is None:
            REFUSED.labels("unknown").inc()
            return not_found(given.request_id), EMPTY
        previous = stored.previous
        _count(served, given, previous)
        meta: Fields = {"kind": "feedback", "feedback_for": given.request_id, "experiment": served.experiment,
                        "variant": served.variant, "feedback_name": given.name, "feedback_value": given.value,
                        "feedback_replaces": previous is not None, "feedback_revision": stored.revision}
        if given.comment is not None:
            meta["feedback_comment"] = given.comment
        return _accepted(given, previous is not None), Decision.of(meta)


def _count(served: Served, given: Given, previous: float | None) -> None:
    labels = (served.experiment, served.variant, given.name)
    if previous is None:
        GIVEN.labels(*labels).inc()
    else:
        CORRECTIONS.labels(*labels).inc()
        if previous:
            RETRACTED.labels(*labels).inc(previous)
    if given.number:
        VALUE.labels(*labels).inc(given.number)
    if not isinstance(given.value, bool):
        DISTRIBUTION.labels(*labels).observe(given.number)


def prime(config: Config) -> None:
    """Every arm's feedback series at zero, so rate() sees the first event."""
    for m in config.feedback_metrics:
        for e in config.model_experiments:
            for v in e.variants:
                for family in (GIVEN, CORRECTIONS, VALUE, RETRACTED):
                    family.labels(e.name, v.id, m.name)
                if m.type == "float":
                    DISTRIBUTION.labels(e.name, v.id, m.name)
    for reason in ("invalid", "unknown", "unavailable"):
        REFUSED.labels(reason)

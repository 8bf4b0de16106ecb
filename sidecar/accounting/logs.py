"""The sidecar's log lines: text (the default) or one JSON object per line,
and one line per request decision, made from its access-log entry.

``serve --log-format json`` (or ``MODEL_ROUTER_LOG_FORMAT=json``) switches
every line to JSON; ``MODEL_ROUTER_LOG_LEVEL`` sets the level. Decisions log
at debug and refusals at info, from the entries Envoy sends after each
request, so the request path does no logging work. A line names the key's
``id``, never the key nor any header value.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

import orjson

from ..decision import EMPTY, Decision
from .entries import NOTHING, Reads

if TYPE_CHECKING:  # the worker supervisor logs too, and loads no gRPC
    from .metering import Entry

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

decisions = logging.getLogger("model_router.decisions")

def _fields(d: Decision) -> tuple[tuple[str, str | None], ...]:
    """The decision's log fields, in the order a line shows them."""
    return (
        ("request_id", d.request_id),
        ("ingress", d.ingress),
        ("key_id", d.key_id),
        ("client_model", d.client_model),
        ("experiment", d.experiment),
        ("variant", d.variant),
        ("assignment", d.assignment),
        ("suffix", d.suffix),
        ("upstream_model", d.upstream_model),
        ("backend", d.backend),
        ("fallback_from", d.fallback_from),
        ("kind", d.kind),
        ("refusal", d.refusal),
    )


_REFUSALS = ("refusal", "shed")
_READS = Reads(name for name, _ in _fields(EMPTY))


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...fields}``, one object per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """The classic line, with a record's fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def log_format(requested: str | None = None) -> str:
    """The format asked for: the argument, else ``MODEL_ROUTER_LOG_FORMAT``, else text."""
    fmt = (requested or os.environ.get("MODEL_ROUTER_LOG_FORMAT") or "text").strip().lower()
    if fmt not in FORMATS:
        raise SystemExit(f"error: log format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


_chosen = "text"


def announce(message: str) -> None:
    """A line for whoever started the process, on standard output: plain
    text, or under the JSON format one JSON record like every other line."""
    if _chosen == "json":
        record = logging.LogRecord("model_router", logging.INFO, __file__, 0, message, None, None)
        message = JsonFormatter().format(record)
    print(message, flush=True)


def fatal(message: str) -> NoReturn:
    """Log why the process cannot run, in the chosen format, and exit 1."""
    logging.getLogger("model_router").critical(message)
    raise SystemExit(1)


def setup(requested: str | None = None) -> None:
    """Send every logger's lines to standard error in the chosen format."""
    global _chosen
    _chosen = log_format(requested)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if _chosen == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("MODEL_ROUTER_LOG_LEVEL", "INFO").upper())


def decision_fields(entry: Entry) -> dict[str, Any]:
    """What a decision's line says; pure."""
    out: dict[str, Any] = {name: value for name, value in _fields(entry.decision) if value}
    out["status"] = entry.status
    if entry.total_s is not None:
        out["duration_ms"] = round(entry.total_s * 1000, 3)
    if entry.prompt_tokens is not None:
        out["prompt_tokens"] = entry.prompt_tokens
    if entry.completion_tokens is not None:
        out["completion_tokens"] = entry.completion_tokens
    return out


class DecisionLog:
    """A metering observer: one line per request the sidecar decided."""

    def reads(self) -> Reads:
        """The decision's keys a line shows, while lines are written (refusals at INFO)."""
        return _READS if decisions.isEnabledFor(logging.INFO) else NOTHING

    def observe(self, entry: Entry) -> None:
        d = entry.decision
        kind = d.kind
        if kind is None:
            return  # Envoy answered without the sidecar
        refused = bool(d.refusal) or kind in _REFUSALS
        level = logging.INFO if refused else logging.DEBUG
        if decisions.isEnabledFor(level):
            decisions.log(level, "refusal" if refused else "decision", extra={"fields": decision_fields(entry)})

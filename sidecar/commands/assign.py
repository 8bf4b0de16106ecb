"""``model-router experiments assign``: which arm a caller gets, and why.

    model-router experiments assign --config FILE --experiment NAME --key VALUE [--at TIME] [--json]

``--experiment`` takes an experiment name or its client model. ``--key`` is
the caller's sticky value (API key, ``user`` field or header value, per the
experiment's ``sticky_key``). ``--at`` is a unix time (``1767225600``,
``1767649064.5``) or an ISO-8601 instant (``2026-01-05T21:37:45Z``,
``2026-01-05T22:37:45+01:00``; without an offset it is UTC); the default is
now. It only matters with ``sticky_ttl``.

The answer comes from :func:`sidecar.experiments.service.answer`, the function the
gRPC ``Assignment`` service uses. ``--json`` prints
:meth:`~sidecar.experiments.service.Answer.to_dict`.

Exit status: 0 with an answer; 1 for an invalid config (every error is
printed, as ``config validate`` does) or an unknown experiment; 2 for an
``--at`` value that is not a time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import UTC, datetime

from ..experiments.service import Answer, InvalidArgument, UnknownExperiment, answer
from .common import load_config


def add_arguments(a: argparse.ArgumentParser) -> None:
    a.add_argument("--config", required=True)
    a.add_argument("--experiment", required=True, help="experiment name")
    a.add_argument("--key", required=True, help="the caller's sticky value (API key, user or header value)")
    a.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    a.add_argument("--json", action="store_true", help="print JSON")


def parse_time(text: str) -> float:
    """A unix time or an ISO-8601 instant (naive means UTC) as unix seconds."""
    s = text.strip()
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"--at must be a finite unix time, got {text!r}")
        return value
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(
            f"--at must be a unix time or an ISO-8601 instant such as 2026-01-05T21:37:45Z, got {text!r}"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _iso(t: float) -> str:
    try:
        dt = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return "(outside the calendar range)"
    spec = "seconds" if t == math.floor(t) else "microseconds"
    return dt.isoformat(timespec=spec).replace("+00:00", "Z")


def _unix(t: float) -> str:
    return str(int(t)) if t == math.floor(t) and abs(t) < 2**63 else repr(t)


def _duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render(a: Answer, key: str) -> str:
    """The human-readable answer."""
    lines = [
        f"experiment      {a.experiment} (client model '{a.client_model}', sticky_key {a.sticky_key})",
        f"key             {key!r}",
    ]
    if a.sticky:
        lines.append("assignment      sticky: the same key gets the same arm on every replica")
    elif a.sticky_key == "none":
        lines.append("assignment      random: sticky_key is none, so every request draws anew; this is one draw")
    else:
        lines.append("assignment      random: a blank key is no sticky value, so every request draws anew; this is one draw")
    lines += [
        f"arm             {a.variant_id}",
        f"upstream model  {a.variant_model}",
        f"at              {_iso(a.unix_time)} (unix {_unix(a.unix_time)})",
    ]
    if a.sticky_ttl is None:
        lines.append("window          none: no sticky_ttl, the arm changes only if the variants or weights do")
    elif a.next_boundary is None:
        lines.append(f"window          none: sticky_ttl {_duration(a.sticky_ttl)} applies to sticky keys only")
    else:
        start = a.window_start
        assert start is not None  # a window with a boundary and a sticky_ttl has a start
        lines.append(
            f"window          {a.window} of sticky_ttl {_duration(a.sticky_ttl)} ({a.sticky_ttl} s): "
            f"from {_iso(start)} (unix {_unix(start)})"
        )
        lines.append(
            f"window ends     {_iso(a.next_boundary)} (unix {_unix(a.next_boundary)}); "
            "the key is re-drawn then"
        )

    rows = [("", "variant", "model", "weight", "u", "score")]
    for s in a.scores:
        mark = "*" if s.variant_id == a.variant_id else ""
        if s.u is None:
            rows.append((mark, s.variant_id, s.model, str(s.weight), "-", "inf (weight 0: not in the race)"))
        else:
            rows.append((mark, s.variant_id, s.model, str(s.weight), f"{s.u:.12g}", f"{s.score:.12g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("")
    for r in rows:
        cells = [
            r[0].ljust(widths[0]),
            r[1].ljust(widths[1]),
            r[2].ljust(widths[2]),
            r[3].rjust(widths[3]),
            r[4].ljust(widths[4]),
            r[5],
        ]
        lines.append("  ".join(cells).rstrip())
    lines += [
        "",
        "Smallest score wins (* marks the winner). score = -ln(u) / weight, where u in (0, 1] comes from",
        "SHA-256 of the caller key and the variant id (random bytes for a random draw); weights set the",
        f"odds, not the outcome for one key. Algorithm {a.algorithm}: docs/assignment.md.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point for ``model-router experiments assign`` (see the module docstring)."""
    loaded = load_config(args.config)
    if loaded is None:
        return 1
    at = None
    if args.at is not None:
        try:
            at = parse_time(args.at)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        a = answer(loaded.config, args.experiment, args.key, at)
    except UnknownExperiment as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 1
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if args.at is not None else 1
    if args.json:
        print(json.dumps(a.to_dict(), ensure_ascii=False, indent=2, allow_nan=False))
    else:
        print(render(a, args.key))
    return 0

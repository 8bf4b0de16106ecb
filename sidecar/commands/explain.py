"""``model-router explain``: a request's routing decision, offline.

    model-router explain --config FILE --request FILE [--at TIME] [--json]

``--request`` names a JSON file ``{"method", "path", "headers", "body"}``
describing the request as a client would send it (``-`` reads standard
input). The decision runs on the config with no monitor data: every backend
counts as healthy with unknown load, and the output says so. ``--json``
prints the document ``POST /admin/explain`` answers.

Exit status: 0 with a trace; 1 for an invalid config; 2 for a request file
that cannot be read or used, or an ``--at`` value that is not a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..routing import snapshot
from ..routing.explain import RequestSpec, SpecError, explain
from .assign import parse_time
from .common import load_config


def add_arguments(ex: argparse.ArgumentParser) -> None:
    ex.add_argument("--config", required=True)
    ex.add_argument("--request", required=True, metavar="FILE",
                    help='JSON {"method", "path", "headers", "body"}; - for standard input')
    ex.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    ex.add_argument("--json", action="store_true", help="print JSON, as POST /admin/explain answers")


def _load_request(path: str) -> RequestSpec:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read --request {path}: {exc}") from None
    try:
        return RequestSpec.from_json(json.loads(text))
    except json.JSONDecodeError as exc:
        raise SpecError(f"--request {path} is not JSON: {exc}") from None


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


def _table(rows: Sequence[tuple[str, ...]], indent: str = "                ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _scores(stage: dict[str, Any]) -> list[str]:
    rows = [("", "variant", "model", "weight", "u", "score")]
    for s in stage["scores"]:
        mark = "*" if s["variant_id"] == stage["arm"] else ""
        score = _g(s["score"]) if s["score"] is not None else "inf (weight 0: not in the race)"
        rows.append((mark, s["variant_id"], s["model"], str(s["weight"]), _g(s["u"]), score))
    return _table(rows)


def _candidate_facts(c: dict[str, Any]) -> str:
    filters = c.get("filters")
    if filters is None:
        parts = []
    elif c.get("monitor") is None:
        parts = ["no monitor data: admitted"]
    else:
        parts = [f"{k} {v}" for k, v in filters.items()]
    ranker = c.get("ranker") or {}
    if "missing" in ranker:
        parts.append(f"nothing to rank by: {ranker['missing']}")
    elif "throughput_tps" in ranker:
        parts.append(f"throughput {_g(ranker['throughput_tps'])} tok/s, scraped {_g(ranker['scrape_age_s'])} s ago")
    elif "estimated_cost_usd" in ranker:
        parts.append(f"estimated cost ${_g(ranker['estimated_cost_usd'])}")
    return "; ".join(parts)


def _steps(a: dict[str, Any]) -> list[str]:
    out = []
    if "preferred" in a:
        p = a["preferred"]
        out.append(f"x-backend {p['backend']}: " + ("won" if p["won"] else "not an admitted candidate, ignored"))
    if "ranker" in a:
        r = a["ranker"]
        out.append(f"ranker {r['name']}: " + ("applied" if r["applied"] else "not applied, no candidate measured"))
    if "picker" in a:
        out.append(f"picker {a['picker']['strategy']} among {', '.join(a['picker']['among'])}")
    return [f"                {s}" for s in out]


def _attempt(a: dict[str, Any]) -> list[str]:
    lines = [f"selection     {a['role']} attempt: model '{a['model']}' -> {a['chosen'] or 'no admissible backend'}"]
    lines += _steps(a)
    rows = [("backend", "verdict", "what it rests on")]
    rows += [(c["backend"], c.get("verdict", ""), _candidate_facts(c)) for c in a["candidates"]]
    return lines + (_table(rows) if len(rows) > 1 else [])


def render(doc: dict[str, Any]) -> str:
    req = doc["request"]
    lines = [f"request       {req['method']} {req['path']}", f"monitor       {doc['monitor']}"]
    if doc["dropped_headers"]:
        lines.append(f"dropped       {', '.join(doc['dropped_headers'])} (the router's namespaces; Envoy drops them)")
    for stage in doc["stages"]:
        lines.append(f"{stage['stage']:<13} {stage['verdict']}")
        if stage["stage"] == "experiment" and stage.get("scores"):
            if stage["window"] is not None:
                lines.append(f"                window {stage['window']} of sticky_ttl {stage['sticky_ttl']} s")
            lines += _scores(stage)
    for a in doc["selection"]:
        lines += _attempt(a)
    if doc["outcome"] is not None:
        lines.append(f"outcome       {doc['outcome']['verdict']}")
    lines.append("nothing was dispatched")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point for ``model-router explain`` (see the module docstring)."""
    loaded = load_config(args.config)
    if loaded is None:
        return 1
    try:
        at = parse_time(args.at) if args.at is not None else time.time()
        spec = _load_request(args.request)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    doc = explain(snapshot.build(loaded.config), spec, {}, at, time.monotonic(), live=False)
    print(json.dumps(doc, ensure_ascii=False, indent=2) if args.json else render(doc))
    return 0

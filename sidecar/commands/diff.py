"""``model-router experiments diff``: what an edit does to experiment assignments.

    model-router experiments diff OLD.yaml NEW.yaml [--keys FILE | --usage-records FILE]
                                  [--at TIME] [--json] [--movers N]

Both configs are loaded as ``config validate`` loads them. ``--keys`` names a
file of sticky values, one per line (used byte for byte; blank lines are
skipped, as a blank sticky value is a random draw). ``--usage-records`` reads
the JSON lines the router writes (``metering.usage_records``) and recomputes
the distinct key ids seen in each experiment, through the old config's
``api_keys``; movers are then named by key id, never by key. ``--at`` is the
instant (as for ``experiments assign``; it matters with ``sticky_ttl``).
``--movers`` caps the movers listed per experiment in the table (``--json``
lists every one).

Exit status: 0 with a diff; 1 when a config is invalid; 2 for an ``--at``
value that is not a time or a keys file that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..experiments.diff import Diff, ExperimentDiff, KeyList, SeenKeys, diff
from .assign import parse_time
from .common import load_config

_FROM_TO = " -> "


def add_arguments(df: argparse.ArgumentParser) -> None:
    df.add_argument("old", help="the config in service")
    df.add_argument("new", help="the edited config")
    callers = df.add_mutually_exclusive_group()
    callers.add_argument("--keys", metavar="FILE", help="sticky values, one per line: recompute each one's arm")
    callers.add_argument("--usage-records", metavar="FILE",
                         help="the router's usage records: recompute the key ids seen in each experiment")
    df.add_argument("--at", help="unix time or ISO-8601 instant (default: now); matters with sticky_ttl")
    df.add_argument("--movers", type=int, default=20, metavar="N", help="movers listed per experiment (default 20)")
    df.add_argument("--json", action="store_true", help="print JSON, every mover included")


class InputError(ValueError):
    """A keys or usage-records file that cannot be used."""


def read_keys(path: str) -> KeyList:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read --keys {path}: {exc}") from None
    return KeyList(tuple(text.splitlines()))


def read_usage_records(path: str, keys: dict[str, str]) -> SeenKeys:
    """The distinct key ids per experiment, in order of first appearance; unreadable lines are skipped."""
    seen: dict[str, dict[str, None]] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                exp, key_id = record.get("experiment_id"), record.get("key_id")
                if isinstance(exp, str) and isinstance(key_id, str):
                    seen.setdefault(exp, {})[key_id] = None
    except OSError as exc:
        raise InputError(f"cannot read --usage-records {path}: {exc}") from None
    return SeenKeys({exp: tuple(ids) for exp, ids in seen.items()}, keys)


def _pct(share: float) -> str:
    return f"{share:.2%}"


def _table(rows: Sequence[tuple[str, ...]], indent: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _arms(e: ExperimentDiff) -> list[str]:
    rows = [("variant", "model", "weight", "share")]
    for a in e.arms:
        model = a.old_model if a.old_model == a.new_model else f"{a.old_model or '-'}{_FROM_TO}{a.new_model or '-'}"
        weight = str(a.old_weight) if a.old_weight == a.new_weight else f"{a.old_weight}{_FROM_TO}{a.new_weight}"
        share = _pct(float(a.old_share))
        if a.old_share != a.new_share:
            share += _FROM_TO + _pct(float(a.new_share))
        rows.append((a.variant_id, model or "-", weight, share))
    return _table(rows, "    ")


def render_experiment(e: ExperimentDiff, movers: int) -> list[str]:
    side = e.new or e.old
    assert side is not None
    lines = [f"experiment {e.name} (client model '{side.model}', sticky_key {side.sticky_key}): {e.status}"]
    if e.reshuffle:
        lines.append("  RESHUFFLE: every caller is drawn afresh")
    lines += [f"  note: {n}" for n in e.notes]
    lines += _arms(e) if e.arms else []
    if e.expected is None:
        return lines
    moving, minimum = float(e.moving_share or 0), float(e.minimum_share or 0)
    lines.append(f"  expected: {_pct(moving)} of sticky callers change arm "
                 f"(the fewest the new shares allow: {_pct(minimum)})")
    moves = sorted(((s, f, t) for (f, t), s in e.expected.items() if f != t), key=lambda m: (-m[0], m[1], m[2]))
    lines += _table([(f, "->", t, _pct(float(s))) for s, f, t in moves], "    ") if moves else []
    if e.observed is None:
        lines.append(f"  observed: none ({e.observed_note})")
        return lines
    o = e.observed.to_dict()
    share = f" ({_pct(o['share'])})" if o["share"] is not None else ""
    lines.append(f"  observed: {o['movers']} of {o['keys']} callers change arm{share}, from {o['source']}")
    lines += _table([(m["from"], "->", m["to"], str(m["count"])) for m in o["moves"]], "    ") if o["moves"] else []
    shown = e.observed.movers[:movers]
    if shown:
        more = len(e.observed.movers) - len(shown)
        lines.append("  movers:" + (f" the first {len(shown)}; {more} more with --json" if more else ""))
        lines += _table([(c, f, "->", t) for c, f, t in shown], "    ")
    return lines


def render(d: Diff, movers: int = 20) -> str:
    if not d.experiments:
        return "neither config has model_experiments: no assignment changes"
    blocks = ["\n".join(render_experiment(e, movers)) for e in d.experiments]
    return "\n\n".join(blocks) + (
        "\n\nShares are exact for the published hash (mr-exp-v1, docs/assignment.md); "
        "observed movers are recomputed key by key."
    )


def run(args: argparse.Namespace) -> int:
    """Entry point for ``model-router experiments diff`` (see the module docstring)."""
    old, new = load_config(args.old), load_config(args.new)
    if old is None or new is None:
        return 1
    try:
        at = parse_time(args.at) if args.at is not None else time.time()
        source: KeyList | SeenKeys | None = None
        if args.keys is not None:
            source = read_keys(args.keys)
        elif args.usage_records is not None:
            keys = {k.id: k.key for k in old.config.api_keys or ()}
            source = read_usage_records(args.usage_records, keys)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    d = diff(old.config, new.config, at, source)
    if args.json:
        print(json.dumps(d.to_dict(), ensure_ascii=False, indent=2))
    else:
        print(render(d, args.movers))
    return 0

"""``model-router experiments pause|resume``: take an arm out of the race, or back in.

The edit is made on the config file (validated by the loader, written
atomically); every sidecar reading that file reloads it within
``server.reload_interval_ms``. Only the paused arm's sticky callers move; the
others keep their arm, and resuming gives each caller its earlier arm back.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import config as config_mod
from . import config_edit, reassignment


def run(args) -> int:
    paused = args.experiments_command == "pause"
    path = Path(args.config)
    try:
        text = path.read_text(encoding="utf-8")
        new, changed = config_edit.set_paused(text, args.experiment, args.variant, paused)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {path}: {exc}", file=sys.stderr)
        return 1
    except config_edit.EditError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    verb = "paused" if paused else "resumed"
    if not changed:
        print(f"{args.experiment}/{args.variant} is already {verb}; {path} is unchanged")
        return 0
    try:
        loaded = config_mod.parse(new)
    except config_mod.ConfigError as exc:
        for e in exc.errors:
            print(f"error: {e}", file=sys.stderr)
        print(f"{path}: unchanged, the edit would make it invalid", file=sys.stderr)
        return 1
    for w in loaded.warnings:
        print(f"warning: {w}", file=sys.stderr)
    config_edit.write_atomic(path, new)
    print(f"{verb} {args.experiment}/{args.variant} in {path}; {_movement(loaded.config, args, paused)}")
    return 0


def _movement(config: config_mod.Config, args, paused: bool) -> str:
    """Which share of sticky callers changes arm: those the arm holds while in the race."""
    exp = next(e for e in config.model_experiments if e.name == args.experiment)
    racing = [(v.id, v.weight if v.id == args.variant else v.race_weight) for v in exp.variants]
    share = float(reassignment.shares(racing).get(args.variant, 0))
    if paused:
        return f"its callers ({share:.1%} of sticky callers) move to the other arms by weight; no one else moves"
    return f"its earlier callers ({share:.1%} of sticky callers) come back to it; no one else moves"

"""``model-router experiments pause|resume``: take an arm out of the race, or back in.

The edit is made on the config file (validated by the loader, written
atomically); every sidecar reading that file reloads it within
``server.reload_interval_ms``. Only the paused arm's sticky callers move; the
others keep their arm, and resuming gives each caller its earlier arm back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import edit as config_edit
from ..config import schema as config_mod
from ..experiments import reassignment


def add_arguments(pz: argparse.ArgumentParser) -> None:
    pz.add_argument("--config", required=True, help="the config file the sidecars read")
    pz.add_argument("--experiment", required=True, help="experiment name")
    pz.add_argument("--variant", required=True, help="variant id")


def run(args: argparse.Namespace) -> int:
    """Entry point for both verbs: ``args.experiments_command`` says which."""
    paused = args.experiments_command == "pause"
    path = Path(args.config)
    try:
        # Under the file's write lock: a sidecar's admin API writing the same
        # file waits, and neither edit is lost.
        with config_edit.locked(path):
            return _edit(args, path, paused)
    except OSError as exc:
        print(f"error: cannot lock {path} for writing: {exc.strerror or exc}", file=sys.stderr)
        return 1


def _edit(args: argparse.Namespace, path: Path, paused: bool) -> int:
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
    introduced, already = _problems(new, text)
    if introduced:
        for e in introduced:
            print(f"error: {e}", file=sys.stderr)
        print(f"{path}: unchanged, the edit would make it invalid", file=sys.stderr)
        return 1
    for e in already:
        # Typically ${ENV} references this shell does not set; the sidecars' environment judges them.
        print(f"warning: not checked here, the file already fails with: {e}", file=sys.stderr)
    try:
        config_edit.write_atomic(path, new)
    except OSError as exc:
        print(f"error: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    share = _movement(config_edit.set_paused(text, args.experiment, args.variant, True)[0], args, paused)
    print(f"{verb} {args.experiment}/{args.variant} in {path}; {share}")
    return 0


def _problems(new: str, old: str) -> tuple[list[str], list[str]]:
    """(errors the edit introduces, errors the file had before it), by the loader."""
    try:
        config_mod.parse(new)
        return [], []
    except config_mod.ConfigError as exc:
        errors = exc.errors
    try:
        config_mod.parse(old)
        before: list[str] = []
    except config_mod.ConfigError as exc:
        before = exc.errors
    return [e for e in errors if e not in before], [e for e in errors if e in before]


def _movement(paused_text: str, args: argparse.Namespace, paused: bool) -> str:
    """Which share of sticky callers changes arm: those the arm holds while in the race."""
    import yaml

    doc = yaml.safe_load(paused_text)
    exp = next(e for e in doc["model_experiments"] if e.get("name") == args.experiment)
    racing = []
    for v in exp["variants"]:
        w = v.get("weight")
        w = w if isinstance(w, int) and not isinstance(w, bool) else 0
        racing.append((v["id"], w if v["id"] == args.variant or not v.get("paused") else 0))
    share = float(reassignment.shares(racing).get(args.variant, 0)) if any(w for _, w in racing) else 0.0
    if paused:
        return f"its callers ({share:.1%} of sticky callers) move to the other arms by weight; no one else moves"
    return f"its earlier callers ({share:.1%} of sticky callers) come back to it; no one else moves"

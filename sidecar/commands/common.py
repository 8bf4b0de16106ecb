"""What several subcommands share: loading a config as ``config validate`` does, and ``NAME=URL`` options."""

from __future__ import annotations

import sys

from ..config.schema import ConfigError, Loaded, load


def pairs(values: list[str] | None, flag: str) -> dict[str, str]:
    """``NAME=URL`` values of a repeatable option as a dict; exits on a malformed one."""
    out = {}
    for v in values or []:
        name, sep, url = v.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"{flag} expects NAME=URL, got {v!r}")
        out[name] = url
    return out


def load_config(path: str, env: dict[str, str] | None = None) -> Loaded | None:
    """Load a config, printing warnings; on failure print every problem and return None."""
    try:
        loaded = load(path, env)
    except ConfigError as exc:
        for e in exc.errors:
            print(f"error: {e}", file=sys.stderr)
        for w in exc.warnings:
            print(f"warning: {w}", file=sys.stderr)
        print(f"{path}: invalid ({len(exc.errors)} error(s))", file=sys.stderr)
        return None
    for w in loaded.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return loaded

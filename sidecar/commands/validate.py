"""``model-router config validate``: check a config file; exit 0 when valid, 1 when not."""

from __future__ import annotations

import argparse

from .common import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file")


def run(args: argparse.Namespace) -> int:
    loaded = load_config(args.file)
    if loaded is None:
        return 1
    print(f"{args.file}: valid" + (f" ({len(loaded.warnings)} warning(s))" if loaded.warnings else ""))
    return 0

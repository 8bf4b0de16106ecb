"""``model-router demo-engine``: the built-in demo upstream engine (:mod:`sidecar.devstack.demo.engine`)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    try:
        from ..devstack.demo import engine
    except ImportError:  # its server library is missing: the command is listed, without options
        return
    engine.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..devstack.demo import engine

    return engine.main(args)

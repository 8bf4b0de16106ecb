"""The ``model-router`` command: the parser, assembled from one table of subcommands, and the dispatch.

Each subcommand is a module of this package with ``add_arguments(parser)``
and ``run(args) -> int``. A module is imported only when its parser is
built: ``serve`` builds its own alone, so the worker supervisor loads none of
the others (gRPC, aiohttp, the manifests...).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Command(Protocol):
    """A subcommand's module."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Sub:
    """A subcommand: its name, its line in the parent's help, and its module."""

    name: str
    help: str
    module: Callable[[], Command]


@dataclass(frozen=True)
class Group:
    """Subcommands under one name; the one given is in ``args.<dest>``."""

    name: str
    help: str
    dest: str
    subs: tuple[Sub, ...]


def _serve() -> Command:
    from . import serve

    return serve


def _up() -> Command:
    from . import up

    return up


def _validate() -> Command:
    from . import validate

    return validate


def _generate() -> Command:
    from . import generate

    return generate


def _envoy_config() -> Command:
    from . import envoy_config

    return envoy_config


def _k8s() -> Command:
    from . import k8s

    return k8s


def _assign() -> Command:
    from . import assign

    return assign


def _diff() -> Command:
    from . import diff

    return diff


def _pause() -> Command:
    from . import pause

    return pause


def _report() -> Command:
    from . import report

    return report


def _explain() -> Command:
    from . import explain

    return explain


def _demo_engine() -> Command:
    from . import demo_engine

    return demo_engine


SERVE = Sub("serve", "run the sidecar (gRPC ext_proc + admin HTTP)", _serve)

COMMANDS: tuple[Sub | Group, ...] = (
    SERVE,
    Sub("up", "run the local stack: Envoy, the sidecar and demo engines", _up),
    Group("config", "validate or generate config files", "config_command", (
        Sub("validate", "check a config file; exit 0 when valid, 1 when not", _validate),
        Sub("generate", "print a commented, runnable config", _generate),
    )),
    Sub("envoy-config", "print the Envoy bootstrap for a config", _envoy_config),
    Sub("k8s", "print or write Kubernetes, Istio and Envoy Gateway manifests for a config", _k8s),
    Group("experiments", "inspect model experiments", "experiments_command", (
        Sub("assign", "which arm a caller gets, and why", _assign),
        Sub("diff", "which callers an edit moves to another arm, before it ships", _diff),
        Sub("pause", "take an arm out of the race (its weight is kept), in the config file", _pause),
        Sub("resume", "put a paused arm back, in the config file", _pause),
        Sub("report", "each arm against the control arm, with intervals safe to peek at", _report),
    )),
    Sub("explain", "why a request would be routed as it is, offline (nothing is sent)", _explain),
    Sub("demo-engine", "run the built-in demo upstream engine", _demo_engine),
)


def _add(sub: argparse._SubParsersAction[argparse.ArgumentParser], entries: tuple[Sub | Group, ...]) -> None:
    for entry in entries:
        p = sub.add_parser(entry.name, help=entry.help)
        if isinstance(entry, Group):
            _add(p.add_subparsers(dest=entry.dest, required=True), entry.subs)
        else:
            module = entry.module()
            module.add_arguments(p)
            p.set_defaults(func=module.run)


def build_parser(commands: tuple[Sub | Group, ...] = COMMANDS) -> argparse.ArgumentParser:
    """The parser of ``commands`` (default: every subcommand), importing their modules."""
    p = argparse.ArgumentParser(prog="model-router", description="Envoy ext_proc sidecar for LLM model routing.")
    _add(p.add_subparsers(dest="command", required=True), commands)
    return p


def _quiet_grpc_for_json(argv: list[str]) -> None:
    """Under JSON logs gRPC's C core would write plain lines into the stream
    (the sidecar logs what it does about each failure): silence it before any
    module loads gRPC, subcommands' parsers included. An operator's
    GRPC_VERBOSITY still wins."""
    given = next((v for a, v in zip(argv, [*argv[1:], ""]) if a == "--log-format"), None)
    given = next((a.partition("=")[2] for a in argv if a.startswith("--log-format=")), given)
    if (given or os.environ.get("MODEL_ROUTER_LOG_FORMAT") or "").strip().lower() == "json":
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    _quiet_grpc_for_json(given)
    # serve, and so the worker supervisor, builds its own parser alone.
    parser = build_parser((SERVE,) if given[:1] == [SERVE.name] else COMMANDS)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.func
    return run(args)

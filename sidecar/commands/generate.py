"""``model-router config generate``: a commented, runnable config from a template the package ships."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

TEMPLATES = ("ab-testing",)


def template_text(name: str) -> str:
    return resources.files("sidecar").joinpath("templates", f"{name}.yaml").read_text(encoding="utf-8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--template", choices=TEMPLATES, default="ab-testing")
    p.add_argument("-o", "--output")


def run(args: argparse.Namespace) -> int:
    text = template_text(args.template)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

"""``model-router k8s``: the manifests of :mod:`sidecar.deploy.k8s`, printed or written."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..deploy import k8s
from .common import load_config, pairs


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = k8s.Options()
    p.add_argument("--config", required=True)
    p.add_argument("--out", metavar="DIR", help="write one file per part here (default: print every document)")
    p.add_argument("--namespace", default=d.namespace, help=f"the router's namespace (default {d.namespace})")
    p.add_argument("--name", default=d.name, help=f"name of the sidecar's objects (default {d.name})")
    p.add_argument("--image", default=d.image, help=f"the image built from the Dockerfile (default {d.image})")
    p.add_argument("--replicas", type=int, default=d.replicas, help=f"sidecar pods (default {d.replicas})")
    p.add_argument("--gateway", default=d.gateway, help=f"the Gateway the routes attach to (default {d.gateway})")
    p.add_argument("--gateway-namespace", help="the Gateway's namespace (default: the router's)")
    p.add_argument("--backend-url", action="append", metavar="NAME=URL", help="override a backend's URL")
    p.add_argument("--monitoring-namespace", default=d.monitoring_namespace,
                   help=f"the namespace the NetworkPolicy lets scrape the admin port (default {d.monitoring_namespace})")


def run(args: argparse.Namespace) -> int:
    try:
        text = Path(args.config).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: cannot read {args.config}: {exc}", file=sys.stderr)
        return 1
    # The pod takes ${ENV} values from a Secret, not from this shell: a
    # reference unset here is checked with a stand-in value.
    env = {name: "set-in-the-pod" for name in k8s.env_references(text)} | dict(os.environ)
    loaded = load_config(args.config, env)
    if loaded is None:
        return 1
    opts = k8s.Options(namespace=args.namespace, name=args.name, image=args.image, replicas=args.replicas,
                       gateway=args.gateway, gateway_namespace=args.gateway_namespace,
                       backend_urls=pairs(args.backend_url, "--backend-url"),
                       monitoring_namespace=args.monitoring_namespace)
    try:
        files = k8s.manifests(loaded.config, text, opts)
    except k8s.K8sError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.out is None:
        sys.stdout.write(k8s.render([d for docs in files.values() for d in docs]))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in files.items():
        (out / name).write_text(k8s.render(docs), encoding="utf-8")
        print(f"wrote {out / name}", file=sys.stderr)
    return 0

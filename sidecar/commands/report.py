"""``model-router experiments report``: each arm against the control arm, from usage records or Prometheus.

    model-router experiments report --config FILE (--usage-records FILE [--since TIME] | --prometheus URL [--window 14d])
                                    [--experiment E] [--json]

Exit status: 0 with a report; 1 for an invalid config, an unknown experiment
or a source that cannot be read.
"""

from __future__ import annotations

import argparse
import sys

import orjson

from ..config.schema import ConfigError, load
from ..experiments import readout, records
from .assign import parse_time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the config the sidecars serve (arms, pricing, feedback metrics)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--usage-records", metavar="FILE", help="usage records (JSON lines): exact per-request figures")
    source.add_argument("--prometheus", metavar="URL", help="a Prometheus scraping the sidecars (http://host:9090)")
    p.add_argument("--experiment", help="experiment name (default: every experiment)")
    p.add_argument("--window", default="14d", help="with --prometheus: the range the counters are read over (default 14d)")
    p.add_argument("--since", metavar="TIME", help="with --usage-records: only records from this unix time or "
                                                   "ISO-8601 instant on (say, the last weight edit)")
    p.add_argument("--json", action="store_true", help="print JSON, as GET /admin/experiments/{E}/report answers")


def _since(text: str) -> float:
    try:
        return parse_time(text)
    except ValueError:
        raise ValueError(f"--since must be a unix time or an ISO-8601 instant, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        config = load(args.config).config
    except ConfigError as exc:
        for e in exc.errors:
            print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        chosen = records.experiments_of(config, args.experiment)
    except KeyError:
        print(f"error: no experiment named {args.experiment!r} in {args.config}", file=sys.stderr)
        return 1
    try:
        if args.usage_records:
            since = None if args.since is None else _since(args.since)
            rows = list(records.read(args.usage_records))
            reports = [records.report_from_records(config, e, rows, since) for e in chosen]
        else:
            if args.since is not None:
                raise ValueError("--since reads usage records; with --prometheus, --window sets the period")
            from ..experiments import samples

            reports = [samples.report_from_prometheus(config, e, args.prometheus, args.window) for e in chosen]
    except (records.RecordsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(orjson.dumps(reports if args.experiment is None else reports[0],
                                      option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        sys.stdout.write("\n".join(readout.render(r) for r in reports))
    return 0

"""`zeroshard doctor RUN_DIR`: name the first point where the ranks' collectives diverged.

Reads every rank's ledger under RUN_DIR/ledger (the JSON dumps written when a run finishes, fails or
hangs, and the crash-safe ring files of ranks that were killed before they could dump) and prints
the first mismatching collective, or the collective some ranks never entered (with its unit and
phase), or the rank that died and its last entries. Exit status: 0 when the ranks agree, 1 when it
found a divergence or a dead rank, 2 when there is nothing to read. It also shows what the run healed:
steps skipped for a non-finite loss or grad norm (and, when they stopped the run, the first rank and
unit that went non-finite), spike rollbacks and replica changes; a run stopped by non-finite steps
exits 1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zeroshard.cli.train import fail


def run(args: argparse.Namespace) -> int:
    from zeroshard.observing.doctor import analyse, load, render

    from zeroshard.observing.heal_view import findings, has_findings, lines, stopped

    healed = findings(args.run_dir)
    try:
        report = analyse(load(args.run_dir))
    except (FileNotFoundError, ValueError) as e:
        if not has_findings(healed):
            fail("doctor", str(e))
            return 2
        report = None  # a run that stopped for non-finite steps may leave no ledger: its own report says where
    if args.json:
        print(json.dumps({"run_dir": args.run_dir, **(report or {}), "healing": healed}, indent=2))
    else:
        # What the run healed first: a run the guard stopped ended on every rank alike, by design.
        print("\n".join(lines(healed) + (render(report, args.run_dir) if report is not None else [])))
    return 0 if (report is None or report["verdict"] == "ok") and not stopped(healed) else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="explain a hang or failure from every rank's collective ledger",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds ledger/rank-R.jsonl)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run)

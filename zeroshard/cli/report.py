"""`zeroshard report RUN_DIR`: charts of a training run as PNG files.

Writes RUN_DIR/report/loss.png (loss per step, with skipped steps, rollbacks and replica changes
marked; they are printed too), step_time.png (each step's time stacked by phase),
memory.png (memory over the last step, with the phases shaded) and mesh.png (the mesh drawn on the
hosts the run ran on), from metrics.jsonl, summary.json and profile/memory-rank-0.json. Needs
matplotlib (the `plot` extra).
"""

from __future__ import annotations

import argparse
from typing import Any

from zeroshard.cli.train import fail


def run(args: argparse.Namespace) -> int:
    from zeroshard.observing.profile.report import write_report

    try:
        paths = write_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        return fail("report", str(e))
    for path in paths:
        print(path)
    from zeroshard.observing.heal_view import findings, lines

    healed = lines(findings(args.run_dir))  # marked on loss.png too
    if healed:
        print("\n".join(["what the run healed (marked on loss.png):", *healed]))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="write PNG charts (loss, step-time breakdown, memory, the mesh on the hosts) of a run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of `zeroshard train`")
    p.add_argument("--out", metavar="DIR", default=None, help="where to write the PNGs (default: RUN_DIR/report)")
    p.set_defaults(run=run)

"""`zeroshard config`: write a run config for `zeroshard train --config` from another framework's.

  zeroshard config from-deepspeed ds_config.json --world 8 --out run.toml

Every DeepSpeed key is mapped, accepted with a note (written into the TOML as a comment), or
refused by name: a key zeroshard cannot honour is an error, never silently dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zeroshard.cli.train import fail, one_line


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="convert another framework's config into a zeroshard TOML",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inner = p.add_subparsers(dest="config_command", required=True, metavar="SOURCE")
    ds = inner.add_parser("from-deepspeed", help="a DeepSpeed JSON config -> zeroshard TOML")
    ds.add_argument("path", metavar="DS_CONFIG.json", help="the DeepSpeed config file")
    ds.add_argument("--world", type=int, default=None,
                    help="ranks in the run; needed to turn train_micro_batch_size_per_gpu into the global batch")
    ds.add_argument("--out", default=None, metavar="RUN.toml", help="write here instead of printing")
    ds.add_argument("--strict", action="store_true",
                    help="refuse keys that would only be noted (e.g. a loss-scaler window we do not use)")
    ds.set_defaults(run=run_from_deepspeed)


def run_from_deepspeed(args: argparse.Namespace) -> int:
    from zeroshard.migrate.deepspeed import from_deepspeed

    path = Path(args.path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return fail("config", f"{args.path!r} does not exist; pass the path of a DeepSpeed JSON config")
    except json.JSONDecodeError as e:
        return fail("config", f"{args.path!r} is not valid JSON: {e}")
    try:
        conversion = from_deepspeed(raw, world=args.world)
    except ValueError as e:
        return fail("config", one_line(e))
    if args.strict and conversion.notes:
        return fail("config", f"--strict: {conversion.notes[0]}")
    text = conversion.toml(path.name)
    if args.out is None:
        sys.stdout.write(text)  # the notes are in it, as comments
        return 0
    Path(args.out).write_text(text)
    for note in conversion.notes:
        print(f"zeroshard config: note: {note}", file=sys.stderr)
    print(f"wrote {args.out} ({len(conversion.values)} keys, {len(conversion.notes)} notes); "
          f"run it with: zeroshard train --config {args.out}", file=sys.stderr)
    return 0

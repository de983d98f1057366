"""`zeroshard config`: write a run config for `zeroshard train --config` from another framework's.

  zeroshard config from-deepspeed ds_config.json --world 8 --out run.toml
  zeroshard config from-deepspeed ds_config.json --world 2 --batch 32 --lr 3e-4 --out run.toml
  zeroshard config from-deepspeed ds_config.json --world 2 --drop zero_optimization.zenflow

Every DeepSpeed key is mapped, accepted with a note, or refused by name: a key zeroshard cannot
honour is an error, never silently dropped, unless `--drop KEY` says so. "auto" (the Hugging Face
Trainer's placeholder) takes the matching zeroshard flag (--batch, --lr, --clip, --mp, ...) or
zeroshard's default; flags no key covers (--model, --steps, --seq-len) are written as given.
The decision table (each key, what it became, where the value came from) goes to stderr and, as
comments, into the TOML.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zeroshard.cli.train import add_config_flags, fail, one_line
from zeroshard.trainer.config import field_names


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="convert another framework's config into a zeroshard TOML",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inner = p.add_subparsers(dest="config_command", required=True, metavar="SOURCE")
    ds = inner.add_parser("from-deepspeed", help="a DeepSpeed JSON config -> zeroshard TOML",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ds.add_argument("path", metavar="DS_CONFIG.json", help="the DeepSpeed config file")
    ds.add_argument("--world", type=int, dest="nproc", default=None,
                    help="ranks in the run (the same as --nproc); turns train_micro_batch_size_per_gpu into the "
                         "global batch")
    ds.add_argument("--out", default=None, metavar="RUN.toml", help="write here instead of printing")
    ds.add_argument("--strict", action="store_true",
                    help="refuse keys that would only be noted (e.g. a loss-scaler window we do not use)")
    ds.add_argument("--drop", action="append", default=[], metavar="KEY",
                    help="convert without this DeepSpeed key (dotted, e.g. zero_optimization.zenflow): for a "
                         "refused key you accept to lose; repeatable")
    # The zeroshard flags fill "auto" keys; --config (a TOML to start from) has no meaning here.
    add_config_flags(ds, with_config_file=False)
    ds.set_defaults(run=run_from_deepspeed)


def run_from_deepspeed(args: argparse.Namespace) -> int:
    from zeroshard.tools.migrate.deepspeed import from_deepspeed

    path = Path(args.path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return fail("config", f"{args.path!r} does not exist; pass the path of a DeepSpeed JSON config")
    except json.JSONDecodeError as e:
        return fail("config", f"{args.path!r} is not valid JSON: {e}")
    flags = {name: getattr(args, name) for name in field_names() if getattr(args, name, None) is not None}
    try:
        conversion = from_deepspeed(raw, flags=flags, drop=tuple(args.drop))
    except ValueError as e:
        return fail("config", one_line(e))
    if args.strict and conversion.notes:
        return fail("config", f"--strict: {conversion.notes[0]}")
    print(conversion.table(), file=sys.stderr)
    text = conversion.toml(path.name)
    if args.out is None:
        sys.stdout.write(text)  # the table is in it too, as comments
        return 0
    Path(args.out).write_text(text)
    print(f"wrote {args.out} ({len(conversion.values)} keys from {len(conversion.decisions)} decisions); "
          f"run it with: zeroshard train --config {args.out}", file=sys.stderr)
    return 0

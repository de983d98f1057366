"""`zeroshard <command>`: dispatch to one module per subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from zeroshard.cli import bench as bench_cmd
from zeroshard.cli import ckpt as ckpt_cmd
from zeroshard.cli import config as config_cmd
from zeroshard.cli import data as data_cmd
from zeroshard.cli import doctor as doctor_cmd
from zeroshard.cli import generate as generate_cmd
from zeroshard.cli import plan as plan_cmd
from zeroshard.cli import report as report_cmd
from zeroshard.cli import train as train_cmd
from zeroshard.cli import tune as tune_cmd
from zeroshard.cli import verify as verify_cmd
from zeroshard.launch import prepare_exit


def version_line() -> str:
    """What a bug report needs: this package's version and the torch and Python it runs on."""
    import platform

    import torch

    from zeroshard import __version__

    return f"zeroshard {__version__} (torch {torch.__version__}, python {platform.python_version()})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="Sharded data-parallel training for PyTorch (DDP and ZeRO-1/2/3).",
    )
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print zeroshard's version (and torch's and Python's) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cmd.add_parser(sub)
    verify_cmd.add_parser(sub)
    ckpt_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub)
    report_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    tune_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    data_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code = int(args.run(args))
    if argv is None:  # the command line, not a caller in the same process that goes on afterwards
        prepare_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())

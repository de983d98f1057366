"""`zeroshard <command>`: dispatch to one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from zeroshard.cli.plan_flags import subcommand_argv, unread_hint
from zeroshard.trainer.launch import prepare_exit, start_rank_server

COMMANDS = ("train", "verify", "ckpt", "plan", "doctor", "report", "bench", "tune", "config", "generate", "data")
"""Each subcommand is the module zeroshard.cli.<name>, with its own ``add_parser``."""


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
    for name in COMMANDS:
        importlib.import_module(f"zeroshard.cli.{name}").add_parser(sub)
    return parser


def starts_ranks(argv: Sequence[str]) -> bool:
    """Whether this command line (its `plan` spelled as a subcommand) will start local ranks:
    training, verifying, tuning, benchmarking and `plan measure` do, unless torchrun already made
    the world (``start_rank_server`` checks)."""
    command = argv[0] if argv else ""
    return command in ("train", "verify", "tune", "bench") or list(argv[:2]) == ["plan", "measure"]


def model_library(argv: Sequence[str]) -> tuple[str, ...]:
    """transformers' model core when ``--model`` names a Hugging Face model (``hf:NAME`` or a
    folder): after torch, the heaviest import a rank makes (seconds of CPU)."""
    words = list(argv)
    values = [w.split("=", 1)[1] for w in words if w.startswith("--model=")]
    values += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--model"]
    if any(v.startswith("hf:") or os.path.isdir(v) for v in values):
        return ("transformers.modeling_utils",)
    return ()


def main(argv: Sequence[str] | None = None) -> int:
    words = subcommand_argv(sys.argv[1:] if argv is None else argv)
    if argv is None and starts_ranks(words):
        # The ranks' server imports torch and the runtime on the other core while this process
        # imports its own and parses the flags, instead of after: seconds off every local launch.
        start_rank_server(f"zeroshard.cli.{words[0]}", *model_library(words))
    parser = build_parser()
    args, extra = parser.parse_known_args(words)
    if extra and getattr(args, "plan_mode", None):  # a flag this subcommand's parser does not hold
        print(f"zeroshard plan {args.plan_mode}: error: {unread_hint(parser, args.plan_mode, extra)}", file=sys.stderr)
        return 2
    if extra:
        parser.parse_args(words)  # argparse's own refusal, with the command's usage
    code = int(args.run(args))
    if argv is None:  # the command line, not a caller in the same process that goes on afterwards
        prepare_exit()
    return code


if __name__ == "__main__":
    sys.exit(main())

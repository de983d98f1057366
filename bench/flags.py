"""The command line every bench script starts from: its docstring as the description, and the workload
flags it takes (model, stage, batch, sequence length, steps, rounds, ranks) each with that script's
default, so the flags keep one spelling and type across the benches."""

from __future__ import annotations

import argparse
from typing import Any


def bench_parser(doc: str | None, **flags: Any) -> argparse.ArgumentParser:
    """``flags``: ``seq_len=64`` adds ``--seq-len`` (int, default 64); a ``(default, help)`` pair adds
    its help too. The type is the default's (int or float; else str); the order is the order given."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in flags.items():
        default, help_text = value if isinstance(value, tuple) else (value, None)
        kind = {int: int, float: float}.get(type(default))  # a str or None default: a string flag
        extra = {"type": kind} if kind is not None else {}
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=help_text, **extra)
    return parser

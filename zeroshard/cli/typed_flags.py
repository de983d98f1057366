"""A flag from a typed key: the one rule every command uses to turn a config key or an engine knob
into an argparse option, so `train`, `verify`, `plan` and `tune` spell and parse a key alike."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from zeroshard.runtime.options import KNOBS


def add_typed_flag(parser: Any, name: str, annotation: Any, help_text: str) -> None:
    """``--name-with-dashes``, parsed as ``annotation`` (``int``, ``str | None``, ``bool``, ...).

    The argparse default is None, so a caller can tell "not given" from "given" (a flag overrides
    a TOML file only when given); the real default belongs in ``help_text``."""
    py_type = next((t for t in typing.get_args(annotation) if t is not type(None)), annotation)
    flag, text = "--" + name.replace("_", "-"), help_text.replace("%", "%%")
    if py_type is bool:  # --trace / --no-trace
        parser.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=text)
    else:
        parser.add_argument(flag, dest=name, type=py_type, default=None, metavar=name.upper(), help=text)


def add_knob_flags(parser: Any, names: tuple[str, ...]) -> None:
    """A flag for each of the engine's knobs in ``names``, in the knob table's order."""
    for knob in KNOBS:
        if knob.name in names:
            add_typed_flag(parser, knob.name, knob.type, f"{knob.help} (default: {knob.default})")


def given_knobs(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    """The knobs among ``names`` that were given on the command line."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}

"""The docstring written under each field of a dataclass, read from its source.

A field's docstring is its one description: `--help` shows it, and the config and the engine's
knob table take it from here instead of repeating it in a second place.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its docstring, whitespace collapsed}``; empty if the source is unavailable
    (a zipped install), which costs only help text."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs

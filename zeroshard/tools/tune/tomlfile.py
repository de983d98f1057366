"""Write a TOML file of TrainConfig keys, the kind `zeroshard train --config` reads: the top-level
keys, then one table per section ([optim], [parallel], ...), each key spelled as its table spells it.

tomllib only reads; rather than add a dependency for writing, this serialises the only shape a
TrainConfig has: str / int / float / bool values in at most one level of tables (None has no TOML
spelling, and every optional field defaults to None, so a None is simply left out), and the `optimizer` key's
options as an inline table (with lists, e.g. betas).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

from zeroshard.trainer.config import field_names, field_section, table_spelling

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _string(name)


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")  # TOML basic strings forbid raw control characters
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # "25.0", "0.001", "1e-05", "1e+16": each a TOML float, and exact
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as a flat TOML value")


def dumps(values: Mapping[str, Any], *, header: str = "") -> str:
    """Flat TrainConfig keys as ``key = value`` lines under their tables, preceded by ``header`` as
    ``#`` comments. A key TrainConfig does not know is written at the top, as given."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    tables: dict[str | None, list[str]] = {}
    for k, v in values.items():
        if v is None:
            continue
        table = field_section(k) if k in field_names() else None
        key = k if table is None else table_spelling(k).split("] ", 1)[1]
        tables.setdefault(table, []).append(f"{_key(key)} = {_value(v)}")
    lines += tables.pop(None, [])
    order = {name: i for i, name in enumerate(f"{field_section(n)}" for n in field_names())}
    for table in sorted(tables, key=lambda t: order.get(f"{t}", len(order))):  # the config's own order
        lines += ["", f"[{table}]", *tables[table]]
    return "\n".join(lines) + "\n"


def write(path: str | Path, values: Mapping[str, Any], *, header: str = "") -> Path:
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps(values, header=header))
    return p

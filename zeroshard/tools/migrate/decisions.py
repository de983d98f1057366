"""The decision table of a config conversion: one row per key, saying what it became and why.

A conversion never drops a setting silently: every key of the source config is a `Decision`
(mapped to a TrainConfig key, noted as changing nothing numeric, or dropped on the user's word),
and a key that cannot be honoured is an `UnsupportedKey` naming it. `Conversion` holds the
TrainConfig values and the rows, and writes both: the values as TOML, the rows as its comments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroshard.tools.tune import tomlfile

AUTO = "auto"
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "-"})()
"""A key absent from the JSON (shown as '-' in the table)."""

# Where a value came from: the fourth column of the decision table.
FROM_JSON = "the JSON"
FROM_DERIVED = "derived from the batch keys"
FROM_DS_DEFAULT = "DeepSpeed's default"
FROM_ZS_DEFAULT = "zeroshard's default"
FROM_NOTE = "noted: changes nothing numeric"
FROM_DROP = "--drop"



class UnsupportedKey(ValueError):
    """A DeepSpeed key that zeroshard cannot honour; the message names it and says what to do."""


@dataclass(frozen=True)
class Decision:
    """One row of the decision table: a DeepSpeed key (or a zeroshard flag no key covers)."""

    key: str
    """The DeepSpeed key, dotted (zero_optimization.stage); empty for a flag alone."""
    given: Any
    """Its value in the JSON (MISSING when the key is absent)."""
    became: str
    """What it is in zeroshard: 'stage = 3', or '-' for a key with no TrainConfig key of its own."""
    source: str
    """Where the value came from: the JSON, an "auto" filled by a flag or a default, a derivation."""
    why: str = ""
    """What zeroshard does with it, where the other columns do not say."""
    noted: bool = False
    """Accepted without carrying over exactly (a knob zeroshard does its own way, a dropped key):
    what `--strict` refuses."""

    def note(self) -> str:
        return f"{self.key}={self.given!r}: {self.why}" if self.key else self.why


@dataclass
class Conversion:
    values: dict[str, Any]
    """TrainConfig keys, in TrainConfig's field order."""
    decisions: list[Decision] = field(default_factory=list)
    """Every DeepSpeed key and every flag, in the order they were decided."""

    @property
    def notes(self) -> list[str]:
        """One line per key accepted without a TrainConfig key of its own (or dropped), saying why."""
        return [d.note() for d in self.decisions if d.noted]

    def table(self) -> str:
        """The decision table as fixed-width text: key, JSON value, what it became, from where."""
        head = ("DeepSpeed key", "value", "became", "from")
        rows = [(d.key or ("(flag)" if d.source.startswith("--") else "(derived)"), repr(d.given), d.became,
                 d.source + (f": {d.why}" if d.why else "")) for d in self.decisions]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
        return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}".rstrip()
                         for a, b, c, d in [head, *rows])

    def toml(self, source: str) -> str:
        header = f"Converted from the DeepSpeed config {source} by `zeroshard config from-deepspeed`.\n{self.table()}"
        return tomlfile.dumps(self.values, header=header)

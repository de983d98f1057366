"""Reading a JSON config key by key, so that every key ends up decided or refused.

`Section` is one JSON object whose keys are taken one at a time: whatever is left untaken at the
end is unknown and refused by name. `Builder` collects the TrainConfig values and the decision
rows, and resolves "auto" (the Hugging Face Trainer's placeholder, filled from its arguments) from
the zeroshard flags the user gave, or zeroshard's defaults.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Mapping

from zeroshard.trainer.config import TrainConfig
from zeroshard.tools.migrate.decisions import (AUTO, FROM_DROP, FROM_DS_DEFAULT, FROM_JSON, FROM_NOTE, FROM_ZS_DEFAULT,
                                         MISSING, Decision, UnsupportedKey)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def _defaults() -> dict[str, Any]:
    return TrainConfig().to_dict()


def default_of(name: str) -> Any:
    """A TrainConfig key's default (an engine knob's too), as `zeroshard train` would run it."""
    return _defaults()[name]


class Section:
    """One JSON object whose keys are taken one at a time; what is left at the end is unknown."""

    def __init__(self, data: Any, path: str, aliases: Mapping[str, str] | None = None) -> None:
        """``aliases`` (alias -> field name, as DeepSpeed's pydantic models declare them): a key
        written under its alias is read under its field name and named as written."""
        if not isinstance(data, Mapping):
            raise UnsupportedKey(f"DeepSpeed key {path!r} must be a JSON object, got {data!r}")
        self.path = path
        self.spelled: dict[str, str] = {}
        self.data: dict[str, Any] = {}
        for key, value in data.items():
            field = (aliases or {}).get(key, key)
            if field in self.data:
                first, second = (f"{path}.{k}" if path else k for k in (self.spelled[field], key))
                raise UnsupportedKey(f"DeepSpeed keys {first} and {second} are the same setting (a field and its "
                                     "alias), given twice; keep one")
            self.data[field], self.spelled[field] = value, key
        self.taken: set[str] = set()

    def name(self, key: str) -> str:
        key = getattr(self, "spelled", {}).get(key, key)
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, default: Any = None) -> Any:
        self.taken.add(key)
        return self.data.get(key, default)

    def take_all(self) -> None:
        """The keys of a disabled feature change nothing: accept them unread."""
        self.taken.update(self.data)

    def has(self, key: str) -> bool:
        return key in self.data

    def concrete(self, key: str, default: Any = None) -> Any:
        """A value with no zeroshard flag to fill it: "auto" is refused, naming the key."""
        value = self.take(key, default)
        if value == AUTO:
            raise UnsupportedKey(f"DeepSpeed key {self.name(key)!r} is \"auto\", but no zeroshard flag fills it; "
                                 "write the value in the JSON")
        return value

    def section(self, key: str, aliases: Mapping[str, str] | None = None) -> Section | None:
        value = self.take(key)
        return None if value is None else Section(value, self.name(key), aliases)

    def finish(self) -> None:
        for key in self.data:
            if key not in self.taken:
                raise UnsupportedKey(f"unknown DeepSpeed key {self.name(key)!r}: zeroshard does not know what it "
                                     f"would change, so it refuses to drop it; remove it from the JSON, or pass "
                                     f"--drop {self.name(key)} if it is unused")


def stage_policy(stage: int) -> Any:
    """The runtime's table of what a stage shards (imported when a stage rule is asked: it needs torch)."""
    from zeroshard.runtime.flat import StagePolicy

    return StagePolicy(stage)


class Builder:
    """The TrainConfig values being built, the flags that fill "auto", and the decision rows."""

    def __init__(self, world: int | None, flags: Mapping[str, Any]) -> None:
        self.world = world
        self.flags = {k: v for k, v in flags.items() if v is not None}
        self.values: dict[str, Any] = {}
        self.decisions: list[Decision] = []
        self.read_flags: set[str] = set()

    def row(self, key: str, given: Any, became: str, source: str, why: str = "", noted: bool = False) -> None:
        self.decisions.append(Decision(key, given, became, source, why, noted))

    def set(self, key: str, given: Any, name: str, value: Any, source: str, why: str = "",
            noted: bool = False) -> None:
        """TrainConfig key ``name`` = ``value``, decided by DeepSpeed key ``key``. A flag given for
        ``name`` must agree: the flags fill "auto", they never silently override the JSON."""
        flag = self.flags.get(name)
        if flag is not None and flag != value:
            raise UnsupportedKey(f"DeepSpeed key {key or '(derived)'}={given!r} gives {name} = {value!r} but "
                                 f"{flag_name(name)} {flag!r}; make them agree, or write \"auto\" in the JSON")
        self.read_flags.add(name)
        self.values[name] = value
        self.row(key, given, f"{name} = {value!r}", source, why, noted)

    def note(self, section: Section, key: str, why: str) -> None:
        if section.has(key):
            self.row(section.name(key), section.take(key), "-", FROM_NOTE, why, noted=True)

    def flag(self, name: str) -> Any:
        """The zeroshard flag ``name`` if given (None if not), marked as read."""
        self.read_flags.add(name)
        return self.flags.get(name)

    def refuse(self, section: Section, key: str, why: str, *, off: tuple = (None, False, 0)) -> None:
        """A feature zeroshard lacks: a row saying it is off while switched off, refused by name when on."""
        if not section.has(key):
            section.take(key)
            return
        value = section.take(key)
        # `True == 1` in Python: compare bools only with bools, or "feature: true" would pass as 1.
        if not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off):
            raise UnsupportedKey(f"DeepSpeed key {section.name(key)}={value!r} is unsupported: {why} "
                                 f"(--drop {section.name(key)} converts without it)")
        self.row(section.name(key), value, "-", FROM_JSON, "switched off, as zeroshard runs")

    def resolve(self, section: Section, key: str, name: str, *, absent: Any = MISSING) -> tuple[Any, Any, str]:
        """(JSON value, value, source) of a DeepSpeed key that is TrainConfig's ``name``.

        "auto" takes the flag, else zeroshard's default, as the HF Trainer fills it from its
        arguments. An absent key takes the flag, else ``absent`` (DeepSpeed's own default; MISSING
        leaves it to the caller). A written value must agree with the flag, if one is given.
        """
        given = section.take(key, MISSING)
        flag = self.flag(name)
        if given is MISSING:
            if flag is not None:
                return given, flag, flag_name(name)
            return given, absent, FROM_DS_DEFAULT if absent is not MISSING else ""
        if given == AUTO:
            return (given, flag, f"auto: {flag_name(name)}") if flag is not None else (given, default_of(name),
                                                                                 f"auto: {FROM_ZS_DEFAULT}")
        if flag is not None and flag != given:
            raise UnsupportedKey(f"DeepSpeed key {section.name(key)}={given!r} but {flag_name(name)} {flag!r}; make "
                                 f"them agree, or write \"auto\" in the JSON to take the flag")
        return given, given, FROM_JSON

    def map(self, section: Section, key: str, name: str, *, absent: Any = MISSING, cast: Any = None,
            why: str = "", noted: bool = False) -> Any:
        """``resolve`` and set: the value written, or MISSING when the key and flag are both absent."""
        given, value, source = self.resolve(section, key, name, absent=absent)
        if value is MISSING:
            return MISSING
        value = cast(value) if cast is not None else value
        self.set(section.name(key), given, name, value, source, why, noted)
        return value


def without_keys(ds: Mapping[str, Any], keys: tuple[str, ...], out: Builder) -> dict[str, Any]:
    """A copy of ``ds`` without the dotted ``keys`` (each a row of the table); a key that is not
    there is refused, so a typo in --drop cannot pass for a dropped setting."""
    data = copy.deepcopy(dict(ds))
    for key in keys:
        *path, last = key.split(".")
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, dict) or last not in node:
            raise UnsupportedKey(f"--drop {key}: the DeepSpeed config has no key {key!r}; name a key it has, "
                                 "dotted (e.g. zero_optimization.zenflow)")
        out.row(key, node.pop(last), "-", FROM_DROP, "dropped on the user's word; zeroshard runs without it",
               noted=True)
    return data

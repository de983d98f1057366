"""The topology a plan is made for: given as hosts x ranks, or read from where a run recorded it.

``zeroshard plan --topology`` takes

- ``2x4``: 2 hosts of 4 ranks each (consecutive ranks on a host, as torchrun numbers them);
- a run directory, its ``summary.json`` or its ``metrics.jsonl``: the topology the run gathered at
  ``zs.init`` (zeroshard/comm/topology.py);
- a hardware TOML from ``plan calibrate``: the ``[topology]`` table it recorded.

What the planner and the simulator take from it is the ranks per host (which collectives cross
hosts) and the world; the host names and facts are shown so the plan says what it was made for.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Mapping

TOML_TABLE = "topology"
"""The hardware TOML's table ``plan calibrate`` writes and ``load_hardware`` leaves to this module."""


@dataclasses.dataclass(frozen=True)
class RunTopology:
    hosts: int
    ranks_per_host: int
    host_names: tuple[str, ...] = ()
    source: str = ""
    """Where it came from, for the printed line: "2x4", a file's path."""
    facts: str = ""
    """One line of the first host's device and link facts, when recorded."""

    @property
    def world(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def text(self) -> str:
        hosts = f"{self.hosts} host{'s' if self.hosts != 1 else ''} x {self.ranks_per_host} rank" \
                f"{'s' if self.ranks_per_host != 1 else ''}"
        named = f" ({', '.join(self.host_names)})" if self.host_names else ""
        facts = f"; {self.facts}" if self.facts else ""
        return f"{hosts}{named}{facts}, from {self.source}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "world": self.world}


def _facts_line(facts: Mapping[str, Any]) -> str:
    parts = [str(facts.get("device_name") or facts.get("device") or "")]
    if facts.get("links"):
        parts.append(f"links {facts['links']}")
    if facts.get("interface") or facts.get("address"):
        parts.append("net " + " ".join(str(facts[k]) for k in ("interface", "address") if facts.get(k)))
    return ", ".join(p for p in parts if p)


def from_summary(summary: Mapping[str, Any], source: str) -> RunTopology:
    """From ``Topology.describe``'s dict (summary.json's or metrics.jsonl's header's "topology")."""
    if summary.get("ranks_per_host") is None:
        raise ValueError(f"{source}: the run's hosts held different numbers of ranks; plan for an even layout, "
                         "e.g. --topology 2x4")
    facts: Mapping[str, Any] = next(iter(summary.get("facts", {}).values()), {})
    return RunTopology(hosts=int(summary["hosts"]), ranks_per_host=int(summary["ranks_per_host"]),
                       host_names=tuple(summary.get("host_names", ())), source=source, facts=_facts_line(facts))


def to_toml_table(summary: Mapping[str, Any], measured_by: str) -> str:
    """The ``[topology]`` table of a hardware TOML for ``Topology.describe``'s dict."""
    facts: Mapping[str, Any] = next(iter(summary.get("facts", {}).values()), {})
    rows = {"hosts": summary["hosts"], "ranks_per_host": summary["ranks_per_host"],
            "host_names": list(summary["host_names"]), "measured_by": measured_by,
            **{k: facts[k] for k in ("device", "device_name", "links", "interface", "address") if facts.get(k)}}
    return f"\n[{TOML_TABLE}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in rows.items())


def from_toml(path: Path) -> RunTopology | None:
    """The ``[topology]`` table of a hardware TOML, or None when it has none (a preset-based file)."""
    with path.open("rb") as f:
        table = tomllib.load(f).get(TOML_TABLE)
    if table is None:
        return None
    try:
        return RunTopology(hosts=int(table["hosts"]), ranks_per_host=int(table["ranks_per_host"]),
                           host_names=tuple(table.get("host_names", ())), source=str(path),
                           facts=_facts_line(table))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: [topology] needs hosts and ranks_per_host as integers") from None


def _from_metrics(path: Path) -> RunTopology:
    first = path.read_text().split("\n", 1)[0]
    header = json.loads(first) if first.strip() else {}
    if header.get("kind") != "header" or "topology" not in header:
        raise ValueError(f"{path} has no header record with the topology (a run from before it was recorded)")
    return from_summary(header["topology"], str(path))


def parse(spec: str) -> RunTopology:
    """``--topology``'s value as a RunTopology, or a one-line ValueError naming what to pass."""
    grid = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if grid:
        hosts, per_host = int(grid.group(1)), int(grid.group(2))
        if hosts < 1 or per_host < 1:
            raise ValueError(f"--topology {spec}: hosts and ranks per host must be >= 1")
        return RunTopology(hosts=hosts, ranks_per_host=per_host, source=f"--topology {spec}")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "summary.json" if (path / "summary.json").exists() else path / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--topology {spec}: not HOSTSxRANKS (e.g. 2x4) and no such run directory or file; pass "
                         "2x4, a run directory, its summary.json or metrics.jsonl, or a plan calibrate TOML")
    if path.suffix == ".toml":
        found = from_toml(path)
        if found is None:
            raise ValueError(f"{path} has no [topology] table; it was not written by plan calibrate")
        return found
    if path.name.endswith(".jsonl"):
        return _from_metrics(path)
    data = json.loads(path.read_text())
    if "topology" not in data:
        raise ValueError(f"{path} records no topology (a run from before it was recorded); pass HOSTSxRANKS")
    return from_summary(data["topology"], str(path))

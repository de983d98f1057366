"""The planner and the simulator take the run's topology: HOSTSxRANKS, a run's records, a calibration's TOML."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zeroshard.cli.main import main
from zeroshard.comm.names import Dim
from zeroshard.comm.topology import RankFacts, Topology
from zeroshard.tools.planner import topology_source
from zeroshard.tools.sim.hardware import PRESETS, load_hardware
from zeroshard.tools.sim.measured import to_toml

PLAN = ["plan", "--model", "tiny", "--stage", "3", "--batch", "8", "--seq", "32", "--device", "cpu", "--json"]


def run_json(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def crossing(layout: dict) -> dict[str, bool]:
    return {c["group"]: c["spans_nodes"] for c in layout["collectives"]}


def test_hosts_x_ranks_sets_the_world_and_what_crosses_hosts(capsys):
    out = run_json([*PLAN, "--topology", "2x2", "--shard-size", "2"], capsys)
    assert out["topology"]["world"] == 4 and out["spec"]["world"] == 4
    # Full sharding over 4 ranks crosses the 2-rank hosts; the hybrid's shard group stays inside one.
    assert crossing(out["layouts"]["zero3"]) == {"shard": True}
    assert crossing(out["layouts"]["zero3_hybrid"]) == {"shard": False, "replicate": True}
    same = run_json([*PLAN, "--world", "4", "--gpus-per-node", "2", "--shard-size", "2"], capsys)
    assert same["layouts"] == out["layouts"]  # --topology 2x2 is --world 4 --gpus-per-node 2


def test_a_run_directory_gives_the_topology_it_recorded(tmp_path, capsys):
    facts = tuple(RankFacts(rank=r, host=f"node{r // 4}", device_name="H100", links="NVLink (NV18)") for r in range(8))
    summary = Topology(facts).describe({Dim.SHARD: 8})
    (tmp_path / "summary.json").write_text(json.dumps({"topology": summary}))
    found = topology_source.parse(str(tmp_path))
    assert (found.hosts, found.ranks_per_host, found.host_names) == (2, 4, ("node0", "node1"))
    assert "NVLink (NV18)" in found.text
    (tmp_path / "summary.json").unlink()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "header", "topology": summary}) + "\n{\"step\": 1}\n")
    assert topology_source.parse(str(tmp_path)) == dataclasses.replace(found, source=str(tmp_path / "metrics.jsonl"))
    capsys.readouterr()
    assert main([*PLAN, "--topology", str(tmp_path), "--world", "4"]) == 1
    assert "--world 4 is not the 8 ranks of --topology" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not HOSTSxRANKS"):
        topology_source.parse(str(tmp_path / "nowhere"))


def test_plan_time_reads_back_the_topology_a_calibration_recorded(tmp_path, capsys):
    from zeroshard.cli.plan_time import calibrated_topology

    path = tmp_path / "host.toml"
    path.write_text(to_toml(PRESETS["h100"]) + calibrated_topology(4))
    assert load_hardware(str(path)).gpus_per_node == PRESETS["h100"].gpus_per_node  # the table is not a field
    recorded = topology_source.from_toml(path)
    assert recorded is not None and (recorded.hosts, recorded.ranks_per_host) == (1, 4)
    out = run_json(["plan", "--time", "--hw", str(path), "--model", "small", "--stage", "3", "--json"], capsys)
    assert out["topology"]["world"] == 4 and {r["world"] for r in out["rows"]} == {4}
    # The same simulation with the hosts given: 2 x 2 puts the 4-rank shard group across hosts.
    across = run_json(["plan", "--time", "--hw", str(path), "--model", "small", "--stage", "3", "--topology", "2x2",
                       "--json"], capsys)
    assert across["topology"]["hosts"] == 2
    assert across["rows"][0]["step_s"] > out["rows"][0]["step_s"]

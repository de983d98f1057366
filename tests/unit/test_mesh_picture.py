"""`zeroshard report`'s mesh.png: drawn from the topology a run recorded, with the ranks where the mesh puts them."""

from __future__ import annotations

import json

import pytest

from zeroshard.comm.names import Dim
from zeroshard.comm.topology import Topology, rank_groups
from zeroshard.observing.profile.mesh_picture import coordinates

pytest.importorskip("matplotlib")

SIZES = {Dim.REPLICATE: 2, Dim.SHARD: 2, Dim.TP: 2}


def test_coordinates_agree_with_the_groups():
    dims = {str(k): v for k, v in SIZES.items()}
    for dim, other in ((Dim.SHARD, ("replicate", "tp")), (Dim.TP, ("replicate", "shard")),
                       (Dim.REPLICATE, ("shard", "tp"))):
        for group in rank_groups(SIZES, dim):
            coords = [coordinates(r, dims) for r in group]
            assert sorted(c[str(dim)] for c in coords) == list(range(len(group)))  # one of each index
            assert all(all(c[o] == coords[0][o] for o in other) for c in coords)  # the rest fixed


def test_report_draws_the_mesh_from_the_run_files(tmp_path):
    from zeroshard.observing.profile.report import write_report

    topology = Topology.grid(2, 4).describe(SIZES)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"kind": "header", "topology": topology}) + "\n"
                                            + json.dumps({"step": 1, "loss": 2.0, "profile": None}) + "\n")
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == ["loss.png", "mesh.png"]
    mesh = paths[1].read_bytes()
    assert mesh[:8] == b"\x89PNG\r\n\x1a\n" and len(mesh) > 10_000
    # A run from before topologies were recorded gets the other charts, and no mesh.
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, "profile": None}) + "\n")
    assert [p.name for p in write_report(tmp_path, tmp_path / "old")] == ["loss.png"]

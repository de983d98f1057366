"""The topology logic on synthetic host lists: which dims stay inside a host, and what is refused."""

from __future__ import annotations

import pytest

from zeroshard.comm.host_probe import summarize_topo_matrix
from zeroshard.comm.names import Dim
from zeroshard.comm.topology import (
    ALLOW_CROSS_HOST, CrossHostError, Topology, UnevenHostsError, placement_text, rank_groups,
)


def sizes(replicate: int = 1, shard: int = 1, tp: int = 1, ep: int = 1) -> dict[Dim, int]:
    return {Dim.REPLICATE: replicate, Dim.SHARD: shard, Dim.TP: tp, Dim.EP: ep}


def test_rank_groups_follow_the_mesh_layout():
    # replicate 2 x shard 2 x tp 2 over 8 ranks, tp innermost (zeroshard/comm/mesh.py's formula).
    s = sizes(replicate=2, shard=2, tp=2)
    assert rank_groups(s, Dim.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(s, Dim.SHARD) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(s, Dim.REPLICATE) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(s, Dim.PP) == [[r] for r in range(8)]
    # ep splits the data-parallel ranks (same tp index) into consecutive runs.
    assert rank_groups(sizes(shard=4, ep=2), Dim.EP) == [[0, 1], [2, 3]]


def test_one_host_of_four_keeps_every_dim_inside():
    topo = Topology.grid(1, 4)
    assert topo.shape_text == "1 host x 4 ranks"
    for layout in (sizes(shard=4), sizes(replicate=2, shard=2), sizes(shard=2, tp=2), sizes(tp=4)):
        assert all(topo.inside_host(layout).values()), layout
        topo.check_placement(layout)
        assert topo.host_sized_shard(layout) is None


def test_two_hosts_of_two_shard_inside_replicate_across():
    topo = Topology.grid(2, 2)
    assert topo.shape_text == "2 hosts x 2 ranks"
    hybrid = topo.inside_host(sizes(replicate=2, shard=2))
    assert hybrid[Dim.SHARD] and not hybrid[Dim.REPLICATE] and hybrid[Dim.TP]
    full = topo.inside_host(sizes(shard=4))
    assert not full[Dim.SHARD]
    # Full sharding spans the hosts; sharding inside each host (2) and replicating across would not.
    assert topo.host_sized_shard(sizes(shard=4)) == topo.ranks_per_host
    assert topo.host_sized_shard(sizes(replicate=2, shard=2)) is None
    # tp 2 is innermost, so it stays on a host; tp 4 spans both and is refused with the override named.
    topo.check_placement(sizes(shard=2, tp=2))
    with pytest.raises(CrossHostError, match=f"tp groups span hosts.*{ALLOW_CROSS_HOST}=True.*--allow-cross-host"):
        topo.check_placement(sizes(tp=4))
    topo.check_placement(sizes(tp=4), allow_cross_host=True)
    summary = topo.describe(sizes(replicate=2, shard=2))
    assert summary["rank_hosts"] == ["host0", "host0", "host1", "host1"]
    assert placement_text(summary) == "2 hosts x 2 ranks; inside a host: shard; across hosts: replicate"


def test_four_hosts_of_one_rank_every_group_of_two_crosses():
    topo = Topology.grid(4, 1)
    assert topo.shape_text == "4 hosts x 1 rank"
    inside = topo.inside_host(sizes(replicate=2, shard=2))
    assert not inside[Dim.SHARD] and not inside[Dim.REPLICATE]
    with pytest.raises(CrossHostError) as err:
        topo.check_placement(sizes(shard=2, tp=2))
    assert err.value.dim == Dim.TP and err.value.ranks_per_host == 1
    assert "keep tp <= 1 (the ranks one host holds" in str(err.value)
    with pytest.raises(CrossHostError, match="ep groups span hosts"):
        topo.check_placement(sizes(shard=4, ep=2))
    # A host of one rank has no shard group to offer: a one-rank shard group is plain replication.
    assert topo.host_sized_shard(sizes(shard=4)) is None


def test_uneven_hosts_are_one_clear_error():
    topo = Topology.from_hosts(["a", "a", "a", "b"])
    error = topo.uneven_error()
    assert error is not None and "a has 3 (ranks 0-2); b has 1 (ranks 3)" in error
    assert "--nproc-per-node" in error
    with pytest.raises(UnevenHostsError):
        topo.check_even()
    with pytest.raises(UnevenHostsError):
        _ = topo.ranks_per_host
    assert topo.describe(sizes(shard=4))["shape"] == "uneven"


def test_interleaved_hosts_are_read_from_the_facts_not_assumed_contiguous():
    topo = Topology.from_hosts(["a", "b", "a", "b"])
    inside = topo.inside_host(sizes(replicate=2, shard=2))
    # Shard groups [0, 1] and [2, 3] each mix a and b; replicate groups [0, 2] and [1, 3] stay on one.
    assert not inside[Dim.SHARD] and inside[Dim.REPLICATE]


def test_nvidia_smi_matrix_is_summarised():
    nvlink = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-31\nGPU1\tNV18\t X \t0-31\n"
    pcie = "\tGPU0\tGPU1\nGPU0\t X \tPHB\nGPU1\tPHB\t X \n"
    assert summarize_topo_matrix(nvlink) == "NVLink (NV18)"
    assert summarize_topo_matrix(pcie) == "PCIe (PHB)"

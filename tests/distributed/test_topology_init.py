"""zs.init gathers every rank's host through the collectives and checks the layout against it."""

from __future__ import annotations

import pytest

import topology_workloads as w
from zeroshard.trainer.launch import spawn


@pytest.fixture(scope="module")
def results():
    return spawn(w.two_hosts_suite, 4, timeout_s=180)


def test_every_rank_sees_the_same_two_hosts(results):
    summaries = [r["summary"] for r in results]
    assert all(s == summaries[0] for s in summaries)
    s = summaries[0]
    print(f"topology: {s['shape']}, rank hosts {s['rank_hosts']}, inside a host {s['inside_host']}")
    assert s["shape"] == "2 hosts x 2 ranks" and s["rank_hosts"] == ["h0", "h0", "h1", "h1"]
    assert results[0]["inside"]["shard"] and not results[0]["inside"]["replicate"]
    # Another mesh over the same process group shares the topology: its full shard group spans both.
    assert not results[0]["full"]["shard"]
    assert results[0]["node_shard"] == 2  # shard_size="node": one shard group per reported host


def test_the_gather_is_one_recorded_world_collective_at_init(results):
    for r in results:
        assert r["gather"] == [("world", "init", 4)]


def test_tp_across_hosts_is_refused_on_every_rank_unless_allowed(results):
    for r in results:
        assert r["tp4"].startswith("CrossHostError: tp groups span hosts: tp group of ranks 0-3 is on h0, h1")
        assert "--allow-cross-host" in r["tp4"]
        assert r["tp4_allowed"] == "ok" and r["tp2"] == "ok"  # tp 2 is innermost: inside each host


def test_uneven_hosts_are_refused_on_every_rank():
    for outcome in spawn(w.uneven_hosts, 3, timeout_s=120):
        assert outcome.startswith("UnevenHostsError: ranks per host differ: a has 2 (ranks 0,1); b has 1 (ranks 2)")

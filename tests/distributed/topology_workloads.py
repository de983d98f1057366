"""Workers for the topology-at-init tests: four spawned ranks told they live on two hosts.

``ZEROSHARD_HOST`` stands in for separate machines (tests/e2e/test_torchrun.py runs real network
namespaces with their own hostnames); everything after the host name is the same code path.
"""

from __future__ import annotations

import os

import zeroshard as zs
from zeroshard.comm.topology import CrossHostError, UnevenHostsError


def _outcome(fn) -> str:
    try:
        fn()
    except (CrossHostError, UnevenHostsError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def two_hosts_suite() -> dict:
    """One init over hosts h0 (ranks 0, 1) and h1 (ranks 2, 3); more layouts as further meshes."""
    os.environ["ZEROSHARD_HOST"] = f"h{int(os.environ['RANK']) // 2}"
    mesh = zs.init(shard_size=2)
    gathers = [r for r in zs.ledger().since(0) if r.op == "all_gather_object"]
    return {
        "summary": mesh.topology_summary(),
        "inside": {str(k): v for k, v in mesh.inside_host.items()},
        "gather": [(r.group, r.phase, r.numel) for r in gathers],
        "full": {str(k): v for k, v in zs.new_mesh(shard_size=4, name="full").inside_host.items()},
        # LOCAL_WORLD_SIZE is 4 here (one machine); "node" takes the 2 ranks each host reported.
        "node_shard": zs.new_mesh(shard_size="node", name="node").shard_size,
        "tp4": _outcome(lambda: zs.new_mesh(tp=4, name="tp4")),
        "tp4_allowed": _outcome(lambda: zs.new_mesh(tp=4, name="tp4_allowed", allow_cross_host=True)),
        "tp2": _outcome(lambda: zs.new_mesh(tp=2, name="tp2")),
    }


def uneven_hosts() -> str:
    """Two ranks on host a and one on host b: zs.init refuses it on every rank alike."""
    os.environ["ZEROSHARD_HOST"] = "a" if int(os.environ["RANK"]) < 2 else "b"
    return _outcome(zs.init)

"""The topology gather at ``zs.init``: every rank's facts, all-gathered once over the world.

It runs through the collectives module like every other collective (recorded in the ledger on
group "world", phase "init"), on a world-only mesh that exists before the real mesh's groups do:
the facts decide whether those groups may be built at all (ranks per host, tp across hosts).

``zs.init`` (zeroshard/comm/world.py, above the mesh and the collectives) calls it directly.
"""

from __future__ import annotations

from zeroshard.comm import collectives
from zeroshard.comm.host_probe import local_facts
from zeroshard.comm.mesh import Mesh
from zeroshard.comm.names import Group, Phase
from zeroshard.comm.topology import RankFacts, Topology


def gather_topology(world_mesh: Mesh) -> Topology:
    """Every rank's ``RankFacts``, in rank order (collective over the world)."""
    mine = local_facts(world_mesh.rank, world_mesh.device)
    facts = collectives.all_gather_object(mine, group=Group.WORLD, phase=Phase.INIT, mesh=world_mesh)
    if not all(isinstance(f, RankFacts) for f in facts):  # a peer running another zeroshard version
        raise RuntimeError("a rank sent no topology facts at zs.init: run the same zeroshard version on every host")
    return Topology(tuple(sorted(facts, key=lambda f: f.rank)))

"""Communication: the mesh, the collectives wrapper and the per-rank ledger."""

from zeroshard.comm import mesh as _mesh
from zeroshard.comm.collectives import get_ledger
from zeroshard.comm.expert_mesh import ExpertMesh, build_expert_mesh
from zeroshard.comm.ledger import CollectiveRecord, CollectiveState, Ledger
from zeroshard.comm.mesh import Mesh, get_mesh, init, shutdown
from zeroshard.comm.topology_gather import gather_topology

# The mesh module sits below the collectives (they take a Mesh), so the topology collective that
# zs.init runs is handed to it here, where both are loaded, rather than imported there.
_mesh.use_topology_gather(gather_topology)
# Likewise the expert mesh that zs.init(ep=N) builds: it is a Mesh, so mesh.py cannot import it.
_mesh.use_expert_mesh_builder(build_expert_mesh)

__all__ = ["CollectiveRecord", "CollectiveState", "ExpertMesh", "Ledger", "Mesh", "get_ledger", "get_mesh", "init", "shutdown"]

"""Communication: the layout (``ParallelDims``), the mesh, the collectives wrapper and the per-rank ledger."""

from zeroshard.comm.collectives import get_ledger
from zeroshard.comm.dims import ParallelDims
from zeroshard.comm.expert_mesh import ExpertMesh
from zeroshard.comm.ledger import CollectiveRecord, CollectiveState, Ledger
from zeroshard.comm.mesh import Mesh, get_mesh, shutdown
from zeroshard.comm.world import init, new_mesh

__all__ = ["CollectiveRecord", "CollectiveState", "ExpertMesh", "Ledger", "Mesh", "ParallelDims", "get_ledger",
           "get_mesh", "init", "new_mesh", "shutdown"]

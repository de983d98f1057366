"""Communication: the mesh, the collectives wrapper and the per-rank ledger."""

from zeroshard.comm.collectives import get_ledger
from zeroshard.comm.ledger import CollectiveRecord, CollectiveState, Ledger
from zeroshard.comm.mesh import Mesh, get_mesh, init, shutdown

__all__ = ["CollectiveRecord", "CollectiveState", "Ledger", "Mesh", "get_ledger", "get_mesh", "init", "shutdown"]

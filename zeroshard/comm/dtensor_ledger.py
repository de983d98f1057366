"""Record the collectives DTensor issues itself (tensor parallelism) in the ledger.

Tensor parallelism runs through torch's own ``parallelize_module``: the per-layer all-reduces
come from DTensor's redistributions, which call torch's functional collectives directly, not
``zeroshard.comm.collectives``. torch offers no hook on those calls, so a dispatch mode watches
for the functional-collective ops and stamps each into the ledger (``collectives.record_observed``)
with the mesh dim it ran on ("tp" for the tp group), in the forward or the backward phase. This is
how torch's own ``CommDebugMode`` counts them; the mode only observes, it never changes an op.

The mode must be on the dispatch stack when ``backward()`` is called (autograd captures the stack
then), so it is pushed once per process when a model is tensor-parallelised and stays until
``zs.shutdown()``. Its cost is one Python call per op.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh, all_meshes, get_mesh, on_shutdown
from zeroshard.comm.names import Group, Phase

_F = torch.ops._c10d_functional  # noqa: SLF001 (the functional collectives' op namespace; no public alias)
# op -> (ledger op name, does the ledger count the output (all-gather) rather than the input)
_WATCHED = {
    _F.all_reduce.default: ("all_reduce", False),
    _F.all_reduce_.default: ("all_reduce", False),
    _F.all_gather_into_tensor.default: ("all_gather", True),
    _F.reduce_scatter_tensor.default: ("reduce_scatter", False),
    _F.all_to_all_single.default: ("all_to_all", False),
    _F.broadcast.default: ("broadcast", False),
}


def _dim_of(group_name: str) -> tuple[str, Mesh]:
    """The mesh dim a functional collective's group is, and its mesh, by the group's registered name.
    Every mesh built in this process is searched: a model on ``zs.new_mesh`` has its own tp groups."""
    for mesh in all_meshes():
        for dim, group in ((Group.TP, mesh.tp_group), (Group.SHARD, mesh.shard_group),
                           (Group.REPLICATE, mesh.replicate_group), (Group.DP, mesh.dp_group)):
            if group is not None and getattr(group, "group_name", None) == group_name:
                return dim, mesh
    mesh = get_mesh()
    return (Group.WORLD if group_name == getattr(mesh.world_group, "group_name", None) else "dtensor"), mesh


def _phase() -> Phase:
    # A node is being executed exactly while autograd runs backward (or a recompute inside it).
    in_backward = torch._C._current_autograd_node() is not None  # noqa: SLF001 (no public equivalent)
    return Phase.BACKWARD if in_backward else Phase.FORWARD


class DTensorLedger(TorchDispatchMode):
    """Dispatch mode that stamps DTensor's functional collectives into the ledger."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor  # loaded by then: only a split model starts this mode

        self.dtensor = DTensor

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without it torch.compile skips every frame while this mode is on the stack (it is on for
        # the whole process once a model is split): compiled blocks would silently run eagerly.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, self.dtensor) for t in types):
            # Let DTensor run first and desugar into plain ops and collectives, which come back here.
            return NotImplemented
        watched = _WATCHED.get(func)
        out = func(*args, **kwargs)
        if watched is not None:
            op, counts_output = watched
            tensor = out if counts_output else args[0]
            dim, mesh = _dim_of(str(args[-1]))
            collectives.record_observed(op, numel=tensor.numel(), dtype=tensor.dtype, elem_size=tensor.element_size(),
                                        group=dim, phase=_phase(), mesh=mesh)
        return out


_MODE: DTensorLedger | None = None


def start() -> None:
    """Begin recording (idempotent); called when a model is tensor-parallelised."""
    global _MODE
    if _MODE is None:
        _MODE = DTensorLedger()
        _MODE.__enter__()
        on_shutdown(stop)


def stop() -> None:
    global _MODE
    if _MODE is not None:
        _MODE.__exit__(None, None, None)
        _MODE = None

"""A few numbers from every rank, as Python rows: the profiler's summary and the desync check.

The values travel as one tensor on the group's device: NCCL refuses host tensors, so gathering a
CPU tensor fails the first time a run meets it. The rows are read back to the host once, after the
collective (one device sync, at the end of a run or at a check, never in a step's hot path). On gloo
the device is the CPU and this is the plain all-gather it replaces.
"""

from __future__ import annotations

import torch

from zeroshard.comm import collectives, host_sync
from zeroshard.comm import mesh as meshes
from zeroshard.comm.names import Group, Phase


def gather_rows(values: list, *, dtype: torch.dtype, phase: str | Phase, group: str | Group = Group.WORLD,
                mesh: meshes.Mesh | None = None) -> tuple[list[list], int]:
    """Every rank's ``values`` in rank order, and the bytes the all-gather moved. A collective: every
    rank passes as many values, of the same ``dtype``."""
    m = meshes.get_mesh() if mesh is None else mesh
    size = m.group_size(group)
    mine = torch.tensor(values, dtype=dtype, device=m.device)
    out = torch.empty(size * len(values), dtype=dtype, device=m.device)
    collectives.all_gather(out, mine, group=group, phase=phase, mesh=m)
    # Fake tensors (the fake-GPU world) hold no values: every rank reads as this one.
    where = f"gather_rows.{phase.value if isinstance(phase, Phase) else phase}"
    rows = host_sync.tolist(out.view(size, len(values)), where, fake_value=[list(values)] * size)
    return rows, out.numel() * out.element_size()

"""What every part of the memory estimate reads: the spec and the model's inventory (or bare parameter
count), the optimizer's probed state cost, and the dtypes the mixed-precision policy gives each tensor;
with ``Transient``, the step's memory that comes and goes, which the parts fill in."""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.comm.quant import CommQuant
from zeroshard.tools.planner import comm
from zeroshard.tools.planner.activations import ActivationEstimate
from zeroshard.tools.planner.experts import ExpertSplit
from zeroshard.tools.planner.inventory import Inventory
from zeroshard.tools.planner.optim_probe import probe
from zeroshard.tools.planner.owner_state import PerTensorParams
from zeroshard.tools.planner.spec import PlanSpec
from zeroshard.runtime.schedule_events import ContextParallelSizes


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype, device="meta").element_size()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transient:
    """Memory that comes and goes within a step, and when it is there."""

    buckets: int = 0
    """Peak of full-size grad memory in flight besides the grads kept for the step."""
    early: int = 0
    """Grad buffers already live when backward starts (next to every saved activation)."""
    during: int = 0
    """Bytes above the model states at backward's worst moment after its start: a unit's grads being
    collected or reduced, with the activations, gathered params and grad shards of that moment, or
    backward's end."""
    window: int = 0
    start_window: int = 0
    """Stage 3: the full params gathered when backward starts (what forward left gathered, before
    backward's prefetch): the window next to every saved activation."""
    scratch: int = 0
    """Optimizer step temporaries (the largest one unit's step makes)."""
    step: int = 0
    """Bytes above the model states at the optimizer step's worst moment: a unit's scratch next to
    the grad buffers of the reductions still running when its step starts."""
    late_grads: int = 0
    """Part of the grads that the reductions create during backward (reduced copies and shards),
    so it is not there yet when backward starts."""
    host_late: int = 0
    """Offloaded: the host grads the reductions create during backward (absent at its start)."""
    during_combined: int = 0
    """Offloaded: ``during`` with the host grads counted as they are created, over device and host
    states together (what one memory holds on a CPU run)."""


class EstimatorBase:
    """The inputs of one spec's plan, shared by the estimator's parts."""

    def __init__(self, spec: PlanSpec, *, inventory: Inventory | None = None, psi: int = 0, frozen: int = 0,
                 activations: ActivationEstimate | None = None, foreach: bool = True,
                 gpus_per_node: int | None = None, reduce_in_place: bool = False, host_is_device: bool = False,
                 tp_collectives: tuple[comm.Collective, ...] = (), comm_quant: CommQuant | None = None,
                 experts: ExpertSplit | None = None, per_tensor: PerTensorParams | None = None,
                 cp_sizes: ContextParallelSizes | None = None) -> None:
        self.spec = spec
        self.cp_sizes = cp_sizes  # the blocks' cp exchanges, which the step schedule lists
        self.per_tensor = per_tensor  # params stepped whole on owner ranks (owner_state.py)
        self.experts = experts or ExpertSplit()
        # The engine finishes the oldest reduction while more than this many are pending; with 0,
        # each launch first finishes the one before it, so one is still in flight.
        self.max_inflight = max(1, spec.engine.max_inflight_reductions)
        # gloo reduces stage 2-3 grads where autograd left them (collectives.reduce_to_owners), with
        # no flat buffer, when they are already in the reduce dtype; NCCL collects them first.
        self.reduce_in_place = reduce_in_place
        # On a CPU run, "host" is the device's own memory: copies to the host are no-ops (the runtime's
        # .to(master device)), so a reduced grad may stay the device buffer, and the host step's
        # scratch lands in the same memory as everything else.
        self.host_is_device = host_is_device
        self.tp_collectives = tp_collectives  # per step, the same for every layout (zeroshard.tools.planner.tp)
        self.comm = comm_quant  # quantized communication, where the runtime applies it (model mode)
        self.gpus_per_node = gpus_per_node
        self.inventory = inventory
        self.psi, self.frozen = psi, frozen
        self.act = activations
        self.foreach = foreach
        self.master_dtypes = inventory.dtypes if inventory else {torch.float32}
        # With the Muon recipe the params off Muon step on AdamW, with the run's own options.
        cls, kwargs = (spec.optimizer, spec.optimizer_kwargs) if per_tensor is None or \
            per_tensor.elementwise is spec.optimizer else (per_tensor.elementwise, {})
        self.costs = {d: probe(cls, d, kwargs) for d in sorted(self.master_dtypes, key=str)}

    def compute(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.compute_dtype(dtype)

    def reduce(self, dtype: torch.dtype) -> torch.dtype:
        return self.spec.mp.reduction_dtype(dtype)

    def _compute_bytes(self) -> int:
        return element_bytes(self.compute(next(iter(self.master_dtypes))))

    @property
    def _bucket_bytes(self) -> int:
        return self.spec.engine.bucket_bytes

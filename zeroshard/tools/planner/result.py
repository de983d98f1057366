"""The planner's answer: per-rank bytes by component for every layout, as frozen dataclasses."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zeroshard.tools.planner.activations import ActivationEstimate
from zeroshard.tools.planner.comm import Collective
from zeroshard.tools.planner.inventory import ModelFacts
from zeroshard.tools.planner.optim_probe import OptimStateCost
from zeroshard.tools.planner.spec import PlanSpec

COMPONENTS = ("params", "grads", "master", "optimizer", "activations", "window", "buckets", "workspace", "headroom")
MODEL_STATES = ("params", "grads", "master", "optimizer")
COMPONENT_HELP = {
    "params": "compute-dtype params held between uses (full at stages 0-2, the shard at stage 3 when it is the param)",
    "grads": "gradients held at the optimizer step (full buffers at stages 0-1, the fp32 reduced shard from stage 1)",
    "master": "separate fp32 master copy (0 when the params are fp32 and serve as their own master)",
    "optimizer": "optimizer state, discovered by running the optimizer's step once",
    "activations": "tensors saved for backward (plus the recomputed block or segment when checkpointing)",
    "window": "stage 3: full params of the gathered units ((1 + prefetch) x largest block + root)",
    "buckets": "full-size gradients in flight: stages 2-3 per-param grads and flat buffers until reduced; "
               "stage 1 reduce-dtype casts",
    "workspace": "temporaries: activation and logits gradients, one fresh param grad, optimizer scratch",
    "headroom": "allocator headroom (fragmentation, cached blocks), a fraction of the allocated peak",
    "overlap": "subtracted: what the components over-count because they peak at different moments",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Components:
    """Bytes per rank on the device, by component. ``total`` is what must fit."""

    params: int = 0
    grads: int = 0
    master: int = 0
    optimizer: int = 0
    activations: int = 0
    window: int = 0
    buckets: int = 0
    workspace: int = 0
    headroom: int = 0
    overlap: int = 0
    """Bytes the components above over-count because they peak at different moments (activations
    at backward's start, grad buffers while a unit's grads are collected, optimizer scratch in
    step()); subtracted."""

    def __post_init__(self) -> None:
        for name in (*COMPONENTS, "overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Components.{name} must be a non-negative int of bytes, got {value!r}")

    @property
    def model_states(self) -> int:
        return sum(getattr(self, n) for n in MODEL_STATES)

    @property
    def allocated(self) -> int:
        """The peak of live tensors: what storage accounting or max_memory_allocated measures."""
        return self.total - self.headroom

    @property
    def total(self) -> int:
        return sum(getattr(self, n) for n in COMPONENTS) - self.overlap

    def as_dict(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in COMPONENTS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    name: str
    """ddp, zero1, zero2, zero3, or a variant such as zero3_hybrid or zero2_offload."""
    stage: int
    shard_size: int
    """Ranks each buffer is sharded over (1 for DDP, the world unless hybrid)."""
    replicas: int
    offload: str
    checkpointing: str
    device: Components
    host_bytes: int
    """Bytes offload keeps off the device (per rank): in host memory (cpu) or in files (disk)."""
    collectives: tuple[Collective, ...]
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    """``host_bytes`` by component (master, optimizer, grads); empty without offload."""
    combined_peak: int = 0
    """Device and host bytes together at the step's worst moment (the allocated peak without
    offload): what a CPU run measures, where host and device are one memory."""
    experts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Under expert parallelism: the expert params' share of each model state on this rank
    (``expert_params`` .. ``expert_optimizer``, bytes, in ``device`` already), the expert bytes it
    holds in full while a layer runs (``expert_held_in_forward``), one MoE layer call's all-to-all
    buffers (``all_to_all_buffers``, counted in ``device.workspace``), and the element counts of
    its dense and expert params (``dense_numel``, ``expert_numel``). Empty without ep."""

    @property
    def comm_bytes(self) -> int:
        return sum(c.wire_bytes for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f"{k}_bytes": v for k, v in self.device.as_dict().items()}
        out.update(overlap_bytes=self.device.overlap, model_states_bytes=self.device.model_states,
                   allocated_bytes=self.device.allocated, total_bytes=self.device.total, host_bytes=self.host_bytes,
                   combined_peak_bytes=self.combined_peak,
                   comm_bytes=self.comm_bytes,
                   stage=self.stage, shard_size=self.shard_size, replicas=self.replicas, offload=self.offload,
                   checkpointing=self.checkpointing, host={f"{k}_bytes": v for k, v in self.host.items()},
                   experts=dict(self.experts),
                   collectives=[dataclasses.asdict(c) | {"wire_bytes": c.wire_bytes} for c in self.collectives])
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    spec: PlanSpec
    mode: str
    """``model`` (a real layout of a model's params) or ``analytic`` (a bare parameter count)."""
    model: ModelFacts | None
    params: int
    trainable: int
    optimizer_cost: tuple[OptimStateCost, ...]
    activations: ActivationEstimate | None
    layouts: dict[str, LayoutPlan]
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("model", "analytic"):
            raise ValueError(f"Plan.mode must be 'model' or 'analytic', got {self.mode!r}")
        missing = [n for n in ("ddp", "zero1", "zero2", "zero3") if n not in self.layouts]
        if missing:
            raise ValueError(f"a plan must cover every stage; missing layouts {missing}")

    def __getitem__(self, name: str) -> LayoutPlan:
        try:
            return self.layouts[name]
        except KeyError:
            raise KeyError(f"no layout {name!r}; this plan has {', '.join(self.layouts)}") from None

    @property
    def checkpoint_host_bytes(self) -> int:
        """Host memory per rank of an asynchronous save's copy (``--save-async``): the masters of every
        param and the elementwise optimizer state of the trainable ones, over the world, since every
        element is written by exactly one rank at every stage. Masters are counted as fp32, the
        master dtype of every mixed-precision policy (zeroshard/checkpoint/async_save.py)."""
        per_element = max((c.per_element for c in self.optimizer_cost), default=0.0)
        return math.ceil((self.params * 4 + self.trainable * per_element) / self.spec.world)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "checkpoint_host_bytes": self.checkpoint_host_bytes,
            "spec": self.spec.describe(),
            "model": dataclasses.asdict(self.model) | {"gpt": _gpt_dict(self.model.gpt)} if self.model else None,
            "params": self.params,
            "trainable": self.trainable,
            "optimizer_state": [{"dtype": str(c.dtype).removeprefix("torch."), "per_element_bytes": c.per_element,
                                 "per_tensor_bytes": c.per_tensor, "state": dict(c.state)} for c in self.optimizer_cost],
            "activations": dataclasses.asdict(self.activations) if self.activations else None,
            "layouts": {name: layout.to_dict() for name, layout in self.layouts.items()},
            "notes": list(self.notes),
        }


def _gpt_dict(cfg) -> dict | None:
    return cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else None

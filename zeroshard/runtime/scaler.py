"""Dynamic loss scaling for fp16 compute over sharded gradients.

It follows torch's ``GradScaler`` contract (``scale``, ``unscale_``, ``step``, ``update``, same
growth/backoff rule and state keys) but works on the grad shards the sharded optimizer steps on.
A shard only sees its own slice, so an overflow in one rank's slice must stop every rank: the
found-inf flag is max-reduced over the world before anyone decides, as DeepSpeed does. A pipeline
rank passes all of its stages (a list of models): one flag covers them, and the world spans every
pp rank, so all stages skip the same steps.
"""

from __future__ import annotations

import torch

from zeroshard.comm import collectives, host_sync
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime.engine import get_engine


class ShardedGradScaler:
    def __init__(self, model, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1), as for torch.amp.GradScaler")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self._engines = [get_engine(m) for m in (model if isinstance(model, (list, tuple)) else [model])]
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf: bool | None = None
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return self.scale_value if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, optimizer=None) -> bool:
        """Divide the grad shards by the scale and agree across ranks on whether any overflowed.

        Returns True when some rank found inf/nan. Safe to call once per step before clipping.
        """
        if not self.enabled or self._unscaled:
            return bool(self._found_inf)
        inv = 1.0 / self.scale_value
        mesh = self._engines[0].mesh
        # One flag per device the shards live on (the compute device; the host with offload), each
        # an OR kept on its device: no group's check reads anything on the host, so the step makes
        # one host sync for the whole check (after the all-reduce), not one per flat group.
        flags: dict[torch.device, torch.Tensor] = {}
        for group in (g for engine in self._engines for g in engine.trainable_groups):
            grad = group.grad_shard
            if grad is None:
                continue
            grad.mul_(inv)
            bad = torch.logical_not(torch.isfinite(grad).all())
            flags[grad.device] = bad if grad.device not in flags else torch.logical_or(flags[grad.device], bad)
        local_bad = torch.zeros(1, device=mesh.device)
        for flag in flags.values():
            # A host flag (offloaded shards) goes up without blocking the host: nothing waits on it here.
            flag = flag.to(local_bad.device, non_blocking=True).to(torch.float32).reshape(1)
            local_bad = torch.maximum(local_bad, flag)
        collectives.all_reduce(local_bad, op="max", group=Group.WORLD, phase=Phase.GRAD_SCALER, mesh=mesh)
        self._found_inf = bool(host_sync.item(local_bad, "scaler.found_inf", fake_value=0.0))
        self._unscaled = True
        return self._found_inf

    def step(self, optimizer) -> bool:
        """Step the optimizer unless any rank overflowed; return whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        found_inf = self.unscale_(optimizer)
        if found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (torch's rule)."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() called before step()/unscale_() in this iteration")
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled = False
        self._found_inf = None

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self._growth_tracker,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])
        self.enabled = bool(state.get("enabled", True))

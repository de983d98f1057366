"""The textbook accounting, for a bare parameter count: the ZeRO paper's table (2Ψ + 2Ψ + 12Ψ split per
stage), with the optimizer's bytes still discovered by running it."""

from __future__ import annotations

import torch

from zeroshard.tools.planner.estimate_base import EstimatorBase, Transient, element_bytes
from zeroshard.tools.planner.optim_probe import OptimStateCost
from zeroshard.tools.planner.variants import Variant


def textbook_offload(states: dict[str, int], v: Variant) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) of the textbook table: offload moves the master and optimizer state, and from
    stage 2 the grad shard the host step reads."""
    if v.offload == "none":
        return states, {}
    host = {"master": states["master"], "optimizer": states["optimizer"],
            "grads": states["grads"] if v.policy.transient_grads else 0}
    return {k: value - host.get(k, 0) for k, value in states.items()}, host


class TextbookMemory(EstimatorBase):
    """The estimator's part without an inventory."""

    def _textbook(self, v: Variant) -> tuple[dict[str, int], Transient, int, int]:
        """The ZeRO paper's table: no padding, grads in the reduce dtype, optimizer cost from the probe."""
        m = torch.float32
        c, r = self.compute(m), self.reduce(m)
        psi, frozen, n = self.psi, self.frozen, v.shards
        cost: OptimStateCost = self.costs[m]
        states = {
            "params": int((psi + frozen) * element_bytes(c) / (n if v.policy.shard_params else 1)),
            "grads": int(psi * element_bytes(r) / (n if v.policy.transient_grads else 1)),
            "master": 0 if c == m else int(psi * element_bytes(m) / (n if v.policy.shard_optimizer else 1)),
            "optimizer": int(cost.per_element * psi / (n if v.policy.shard_optimizer else 1)),
        }
        # Without units only the bucket size is known: two buckets in flight at stage 2.
        buckets = 2 * min(self._bucket_bytes, psi * element_bytes(r)) if v.stage == 2 else 0
        foreach = cost.per_element and self.foreach and not self.spec.optimizer_kwargs.get("fused")
        scratch = int(states["optimizer"] / cost.per_element * element_bytes(m)) if foreach else 0
        return states, Transient(buckets=buckets, early=buckets, during=buckets, scratch=scratch, step=scratch), \
            psi + frozen, 0

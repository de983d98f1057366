"""Backward's memory above the model states: per comm unit, the grads its reduction creates and holds in
flight, the activations still alive and stage 3's gathered window when its last grad arrives; and the
peaks those reach as the reductions launch and are reaped."""

from __future__ import annotations

import dataclasses

from zeroshard.tools.planner.activations import alive_activations
from zeroshard.tools.planner.estimate_base import EstimatorBase, element_bytes
from zeroshard.tools.planner.inventory import CommUnit
from zeroshard.tools.planner.variants import Variant


@dataclasses.dataclass(frozen=True, kw_only=True)
class _UnitGrads:
    """One comm unit's share of what backward allocates and frees, in reduction order."""

    late: int = 0
    """Grads its reduction creates (the reduced copy or shard), kept for the step."""
    activations: int = 0
    """Saved (and rebuilt) activations still alive when its last grad arrives."""
    window: int = 0
    """Stage 3: full params gathered while its grads complete (itself, the units prefetched, the root)."""
    per_param: int = 0
    """Stages 2-3: its grads as autograd makes them (compute dtype), kept on the params until the unit
    is complete."""
    flat: int = 0
    """Stages 2-3: the flat reduce-dtype buffer they are collected into, until the reduction is reaped."""
    reduced: int = 0
    """Its reduction's output while that is a second shard (added into an existing one, or cast)."""
    cast: int = 0
    """Stage 1: a reduce-dtype copy of its persistent grads, fed to the reduce-scatter."""


class BackwardMemory(EstimatorBase):
    """The estimator's part that walks backward unit by unit (reduction order)."""

    def _unit_grads(self, units: tuple[CommUnit, ...], v: Variant, late: list[int]) -> list[_UnitGrads]:
        spec = self.spec
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        activations = self._alive_activations(units)
        root = sum(u.full_bytes(compute_map) for u in units if u.is_root)
        blocks = [u for u in units if not u.is_root]  # reduction order
        unsharded = spec.accum > 1 and spec.engine.accumulation == "unsharded"
        out = []
        for i, u in enumerate(units):
            window = 0
            if v.policy.shard_params:
                # Its grads complete before it is resharded. Its backward prefetched the next
                # ``prefetch`` units (issued once backward_prefetch_at of its grads are ready, so by
                # its last one); the root stays gathered until backward ends. Without
                # reshard_after_forward, every unit not yet through backward is still gathered.
                k = next((j for j, b in enumerate(blocks) if b is u), len(blocks))
                prefetched = spec.engine.prefetch if spec.engine.backward_prefetch_at <= 1 else 0
                ahead = blocks[k:] if not spec.engine.reshard_after_forward else blocks[k:k + 1 + prefetched]
                window = root + sum(b.full_bytes(compute_map) for b in ahead)
            per_param = flat = reduced = cast = 0
            for g in u.groups:
                if not g.trainable:
                    continue
                c, r, m = self.compute(g.dtype), self.reduce(g.dtype), g.dtype
                if v.policy.transient_grads and self.reduce_in_place and c == r and not unsharded:
                    # The per-param grads are what the reduction holds in flight: no collection.
                    flat += g.layout.param_numel * element_bytes(c)
                    second = spec.accum > 1 or r != m
                    reduced += g.shard_numel * element_bytes(r) if second else 0
                elif v.policy.transient_grads:
                    per_param += g.layout.param_numel * element_bytes(c)
                    flat += g.numel * element_bytes(r)
                    second = (spec.accum > 1 and not unsharded) or r != m
                    reduced += g.shard_numel * element_bytes(r) if second else 0
                elif v.policy.shard_optimizer:
                    cast += g.numel * element_bytes(r) if c != r else 0
                    reduced += g.shard_numel * element_bytes(r) if r != m else 0
            out.append(_UnitGrads(late=late[i], activations=activations[i], window=window, per_param=per_param,
                                  flat=flat, reduced=reduced, cast=cast))
        return out

    def _alive_activations(self, units: tuple[CommUnit, ...]) -> list[int]:
        if self.act is None:
            return [0] * len(units)
        return alive_activations(self.act, [([s.fqn for g in u.groups for s in g.layout.slots], u.is_root)
                                            for u in units], self.spec.checkpointing)

    def _backward(self, units: tuple[CommUnit, ...], v: Variant,
                  late: list[int]) -> tuple[int, int, int, list[tuple[int, int]]]:
        """(buckets, during, early, running): the peak of grad memory in flight, of everything above
        the model states after backward's start, the grad memory in flight when backward starts,
        and (unit index, bytes) of the reductions still running when it ends.

        Reductions launch in the units' order, each when its unit's grads are complete, and the
        engine frees their buffers when it reaps them: as soon as they finish, but at the latest, at
        stages 2-3, when one more launches while ``max_inflight`` are pending (the oldest is waited
        on). Backward's end does not wait for the last ones: the optimizer step finishes each when it
        reaches its unit. When each finishes is timing, on gloo's worker threads as on NCCL's
        stream, so this is the bound the engine guarantees, reached when every reduction is slower
        than the next unit's backward. At each unit's last grad:

        - stages 2-3: its per-param grads are copied into a freshly allocated flat buffer, so for a
          moment both exist, next to the flat buffers of the ``max_inflight`` units before it still
          reducing; then its reduction launches (its shard appears) and the oldest is reaped;
        - stage 0: the all-reduce runs in the grad buffer (or the reduced copy, in the grads);
        - stage 1: the reduce-scatter reads the persistent grads in place (nothing in flight), or a
          reduce-dtype cast of them, which the engine does not cap: every cast can be alive at
          backward's end, and into the step.

        Each moment also holds the activations of the units not yet through backward, stage 3's
        gathered params, and the grad shards created so far.

        Accumulating unsharded (stages 2-3, accum > 1), the flat buffers are allocated in the first
        micro-step and carried to the last, whose reductions free them: every one is in flight when
        a later micro-step's backward starts, and its units' grads are added into them.
        """
        grads = self._unit_grads(units, v, late)
        compute_map = {d: self.compute(d) for d in self.master_dtypes}
        carried = v.policy.transient_grads and self.spec.accum > 1 and self.spec.engine.accumulation == "unsharded"
        early = sum(g.flat for g in grads) if carried else 0
        moments: list[tuple[int, int]] = [(early, 0)]  # (grad memory in flight, everything above the states)
        pending = sum(late)  # grads the reductions have not created yet
        ahead = early  # carried flat buffers not yet reduced
        reducing: list[tuple[int, int]] = []  # stages 2-3: (unit, bytes) launched and unreaped, oldest first
        held: list[tuple[int, int]] = []  # stages 0-1: (unit, casts), all unreaped in the bound
        for i, g in enumerate(grads):
            activations = g.activations
            if v.policy.transient_grads:
                if carried:  # an earlier micro-step: no reduction, no shard yet
                    moments.append((early + g.per_param, early + g.per_param - sum(late) + activations + g.window))
                flat = ahead if carried else g.flat
                before = sum(b for _, b in reducing)
                collect = before + flat + g.per_param
                moments.append((collect, collect - pending + activations + g.window))
                pending -= g.late
                launch = before + flat + g.reduced
                moments.append((launch, launch - pending + activations + g.window))
                ahead -= g.flat if carried else 0
                # A unit without trainable params launches nothing but still takes a place in line.
                reducing = (reducing + [(i, g.flat + g.reduced)])[-self.max_inflight:]
            else:
                pending -= g.late
                held.append((i, g.cast + g.reduced))
                inflight = sum(b for _, b in held)
                moments.append((inflight, inflight - pending + activations))
        # Backward's end: the reductions still running stay; stage 3's root is still gathered
        # (every unit is resharded as backward ends).
        running = reducing if v.policy.transient_grads else held
        end = sum(b for _, b in running)
        root = sum(u.full_bytes(compute_map) for u in units if u.is_root) if v.policy.shard_params else 0
        moments.append((end, end + root))
        return max(m[0] for m in moments), max(m[1] for m in moments), early, running

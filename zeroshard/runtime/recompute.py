"""Activation checkpointing per unit and per segment of consecutive units: memory for compute.

A *segment* is a run of consecutive block units recomputed together from the segment's input,
with non-reentrant ``torch.utils.checkpoint``. Policies:

- ``none``: nothing is recomputed.
- ``all`` (= ``every:1``): each unit keeps only its input; its activations are rebuilt in backward.
- ``every:k``: segments of k units; only each segment's input is kept, and backward rebuilds one
  segment (k units of activations) at a time.
- ``sqrt``: segments of about √L units, so about √L segment inputs are kept and one segment is
  rebuilt at a time: activation memory O(√L) instead of O(L), for one extra forward.

A segment longer than one unit needs the units to form a chain, as transformer blocks in a
ModuleList do: the parent calls them in order and each unit's only input is the previous unit's
output. The first unit then runs the whole segment inside one checkpoint and hands the later units
their precomputed outputs when the parent calls them; any other calling pattern is refused.

Stage 3: the later units of a segment run inside the first unit's call, so the engine's unit
entry/exit (gather, order tracking, reshard) is driven from here. In backward the recompute needs
the params of units that were already resharded, so it gathers them again: those all-gathers appear
in the ledger with phase "recompute".
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import nn

from zeroshard.runtime.compiled import refuse_traced


def segment_length(policy: str, units: int) -> int | None:
    """Units per segment for a policy string, or None for no checkpointing."""
    if policy == "none" or units == 0:
        return None
    if policy == "all":
        return 1
    if policy == "sqrt":
        return math.ceil(units / max(1, round(math.sqrt(units))))
    if policy.startswith("every:"):
        try:
            k = int(policy.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return k
    raise ValueError(f"checkpointing policy {policy!r} is unknown; use none, all, every:K (K >= 1) or sqrt")


def segment_bounds(policy: str, units: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each checkpoint segment over ``units`` consecutive blocks, in forward order.

    The one place a policy's meaning lives: ``Recompute`` wraps exactly these segments, and the
    planner (zeroshard.tools.planner) and ``zeroshard tune`` (through the planner) count the same ones.
    """
    length = segment_length(policy, units)
    return [] if length is None else [(i, min(i + length, units)) for i in range(0, units, length)]


class _Segment:
    def __init__(self, recompute: "Recompute", modules: list[nn.Module]) -> None:
        self.recompute = recompute
        self.modules = modules
        self.forwards = [m.forward for m in modules]  # the originals, bound
        self.cache: dict[int, tuple[torch.Tensor, object]] = {}
        self.recomputing = False

    def install(self) -> None:
        self.modules[0].forward = self.run
        for module in self.modules[1:]:
            module.forward = self._member_forward(module)

    def run(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # Traced, the segment's state changes inside checkpoint's graph are refused and dynamo
            # would run the whole frame eagerly without a word; say so instead.
            refuse_traced(f"unit {self.recompute.name(self.modules[0])} is checkpointed and was reached from a "
                          "torch.compile'd frame; compile through zs.shard(..., compile=...) instead, which "
                          "checkpoints the compiled forward")
        # Without grad there is no backward and so nothing to recompute: run the units as they are.
        checkpointed = torch.is_grad_enabled()
        self.recomputing = False
        if len(self.modules) == 1:
            if not checkpointed:
                return self.forwards[0](*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(self._single, *args, use_reentrant=False, **kwargs)
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise ValueError(f"checkpoint segment starting at {self.recompute.name(self.modules[0])} needs its units "
                             "to take one tensor each (a chain); use checkpointing='all' for this model")
        if checkpointed:
            outputs = torch.utils.checkpoint.checkpoint(self._chain, args[0], use_reentrant=False)
        else:
            outputs = self._chain(args[0])
        previous = outputs[0]
        for module, output in zip(self.modules[1:], outputs[1:]):
            self.cache[id(module)] = (previous, output)
            previous = output
        return outputs[0]

    def _single(self, *args, **kwargs):
        # checkpoint calls this once in forward and once more, in backward, to recompute.
        engine, module = self.recompute.engine, self.modules[0]
        recompute, self.recomputing = self.recomputing, True
        gathered = recompute and engine is not None and engine.gather_for_recompute(module)
        try:
            return self.forwards[0](*args, **kwargs)
        finally:
            if gathered:
                engine.release_after_recompute(module)
            if recompute:
                self.recomputing = False

    def _chain(self, x: torch.Tensor):
        engine = self.recompute.engine
        recompute, self.recomputing = self.recomputing, True
        gathered = []
        outputs = []
        for index, (module, forward) in enumerate(zip(self.modules, self.forwards)):
            unit = engine.unit_of_module.get(id(module)) if engine is not None else None
            if recompute:
                if engine is not None and engine.gather_for_recompute(module):
                    gathered.append(module)
            elif unit is not None and index > 0:
                engine.enter_unit(unit)  # the parent's call of this unit comes later, from the cache
            x = forward(x)
            if unit is not None and index > 0 and not recompute:
                x = engine.exit_unit(unit, x)
            outputs.append(x)
        for module in gathered:
            engine.release_after_recompute(module)
        if recompute:
            self.recomputing = False
        return tuple(outputs)

    def _member_forward(self, module: nn.Module):
        def forward(x, *args, **kwargs):
            entry = self.cache.pop(id(module), None)
            if entry is None or entry[0] is not x or args or kwargs:
                raise ValueError(f"unit {self.recompute.name(module)} was called with something other than the "
                                 "previous unit's output, so its checkpoint segment is not a chain; use "
                                 "checkpointing='all' (one unit per segment) for this model")
            return entry[1]
        return forward


class Recompute:
    def __init__(self, model: nn.Module, blocks: list[nn.Module], policy: str, engine=None) -> None:
        self.policy = policy
        self.engine = engine
        self._names = {id(m): n for n, m in model.named_modules()}
        self.segments = [_Segment(self, blocks[a:b]) for a, b in segment_bounds(policy, len(blocks))]
        self._member_of: dict[int, _Segment] = {id(m): seg for seg in self.segments for m in seg.modules[1:]}
        self._serving: set[int] = set()
        for segment in self.segments:
            segment.install()

    def name(self, module: nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def begin_cached_call(self, module: nn.Module, args) -> bool:
        """True when the parent calls a unit whose output its segment already computed."""
        segment = self._member_of.get(id(module))
        if segment is None or id(module) not in segment.cache:
            return False
        self._serving.add(id(module))
        return True

    def end_cached_call(self, module: nn.Module) -> bool:
        if id(module) in self._serving:
            self._serving.discard(id(module))
            return True
        return False

    def describe(self) -> dict:
        return {"policy": self.policy, "segments": [[self.name(m) for m in s.modules] for s in self.segments]}

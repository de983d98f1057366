"""Activation memory of any model, read from the model itself: one forward traced on fake tensors.

zeroshard's GPT has a formula (activations.py); every other model (a Hugging Face folder, a user's
own module) is measured instead. The planner runs the model's own forward and the loss the runtime
applies (``zeroshard.trainer.adapter.loss_sum``) at the planned micro-batch and sequence, with
every param and buffer swapped for a fake tensor of the compute dtype (``torch.func.functional_call``
under torch's ``FakeTensorMode``: the model itself is untouched, and nothing is allocated), and
counts what autograd saves for backward
through ``saved_tensors_hooks``: each storage once, params excluded — the same rule ``plan measure``
reads a real step with. Saved storages are charged to the block (the runtime's units, ``find_blocks``)
whose forward was running, the rest to the root (embeddings, final norm, head and loss).

The fake tensors sit on the CPU device, so attention picks the kernel a real run picks there
(flash attention keeps its log-sum-exp, not the probabilities); a GPU's fused kernels keep the same.
transformers treats a fake tensor as a graph being traced, so it cannot read the fake position ids
to see that each row holds one sequence, and would build an explicit mask (and expand GQA's keys
and values for it) where a real run takes the causal kernel without one: the trace's rows are one
sequence each, as a run's unpacked batch, so its check is answered as a real run's is
(``_one_sequence_per_row``).
Backward's temporaries are not traced (fake tensors have no lifetimes to watch); they follow the
same two moments as the GPT formula: the loss head's gradients (the fp32 log-probabilities' and the
logits' gradients, plus a compute-dtype copy of the latter), and inside a block twice its largest
saved tensor (the gradients of the MLP's widest tensors: a tensor's own bytes, so a half of a fused
projection's output counts as the half its gradient is) and five block-input-sized gradients (the
residual stream's), after the head's backward has freed what the head and loss saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from zeroshard.tools.planner.activations import ActivationEstimate
from zeroshard.tools.planner.spec import Checkpointing
from zeroshard.tools.planner.tp_flow import SplitFlow, split_flow
from zeroshard.runtime.tp_plan import TPPlan


class _SavedBytes:
    """Storages autograd saved, each once, charged to the block running when it was saved; the rest
    to the root, split into what was saved before the first block ran (embeddings) and after (final
    norm, head, loss): a pipeline's first and last stage keep those."""

    def __init__(self, params: set[int], tp: int = 1):
        self.params = params  # storage keys of the (meta) params: a weight saved for backward is not an activation
        self.tp = tp
        self.flow: SplitFlow | None = None
        """Under tp, which storages a rank holds 1/tp of (tp_flow.py)."""
        self.seen: set[int] = set()
        self.block: int | None = None
        self.started = False
        self.per_block: dict[int, int] = {}
        self.largest: dict[int, int] = {}
        self.before = 0
        self.after = 0

    @property
    def root(self) -> int:
        return self.before + self.after

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata  # noqa: SLF001 - a storage's identity; fake storages have no data_ptr
        if key in self.params:
            return tensor
        split = self.tp if self.flow is not None and self.flow.is_split(tensor) else 1
        if self.block is not None:  # its gradient is the tensor's own size, a view's too (not its storage's)
            own = tensor.numel() * tensor.element_size() // split
            self.largest[self.block] = max(self.largest.get(self.block, 0), own)
        if key in self.seen:
            return tensor
        self.seen.add(key)
        size = storage.nbytes() // split
        if self.block is None and self.started:
            self.after += size
        elif self.block is None:
            self.before += size
        else:
            self.per_block[self.block] = self.per_block.get(self.block, 0) + size
        return tensor


@contextlib.contextmanager
def _charged_to_blocks(blocks: list[nn.Module], saved: _SavedBytes, inputs: dict[int, int]) -> Iterator[None]:
    """While block i's forward runs, what autograd saves is charged to i; its input's bytes are kept
    (what a checkpoint segment starting there holds)."""
    def enter(index: int):
        def hook(module, args, kwargs) -> None:
            saved.block, saved.started = index, True
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                inputs[index] = first.numel() * first.element_size()
        return hook

    def leave(module, args, output) -> None:
        saved.block = None

    handles = [b.register_forward_pre_hook(enter(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _fake_grouped_mm() -> Iterator[None]:
    """transformers' stacked experts call torch's grouped_mm, whose fake (meta) kernel accepts bf16
    only, while the CPU and GPU kernels take every float dtype. For the trace, transformers' own
    fallback op is taken instead: it has a fake kernel for every dtype and saves what grouped_mm
    saves for backward (its input and the expert weights, and the offsets)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # no transformers: no stacked experts of its to trace
        yield
        return
    if not hasattr(moe, "_can_use_grouped_mm"):
        yield
        return
    original = moe._can_use_grouped_mm  # noqa: SLF001 - the dispatch's one switch
    moe._can_use_grouped_mm = lambda *args, **kwargs: False  # noqa: SLF001
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original  # noqa: SLF001


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """transformers' packed-sequence check (``find_packed_sequence_indices``) reads the position
    ids' values, which a fake tensor has not, so it answers "packed" for any traced input; the
    traced rows are one sequence each, as the check finds on a real run's unpacked batch (None)."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: no masks of its to build
        yield
        return
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _fake_state(model: nn.Module, compute: torch.dtype) -> dict[str, torch.Tensor]:
    """Every param and buffer as a fake CPU tensor; floating ones in the compute dtype, as the runtime runs them.
    Tied params appear once: ``functional_call`` ties the others to it."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        dtype = compute if t.is_floating_point() else t.dtype
        out[name] = torch.empty(t.shape, dtype=dtype, device="cpu", requires_grad=isinstance(t, nn.Parameter)
                                and t.requires_grad)
    return out


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one traced forward of the whole model saved for backward, per block and around them."""

    per_block: tuple[int, ...]
    """Bytes each block's forward saved (a storage seen by an earlier block is not counted again)."""
    largest: tuple[int, ...]
    """Each block's largest saved tensor (its own bytes: a view of a wider storage, such as one half
    of a fused gate and up projection, has a gradient of the view's size)."""
    inputs: tuple[int, ...]
    """Each block's input (the residual stream): what a checkpoint segment or a pipeline stage's
    received buffer holds."""
    before: int
    """Saved before the first block ran (embeddings): the first pipeline stage's."""
    after: int
    """Saved after the last block (final norm, head, loss): the last stage's."""
    logits: int
    """Elements of the model's output logits."""
    logits_saved: bool
    """Whether autograd saved the logits themselves (else a pipeline's last stage keeps them apart)."""


def trace(model: nn.Module, blocks: list[tuple[str, nn.Module]], *, micro_batch: int, seq: int,
          compute: torch.dtype, tp: int = 1, tp_plan: TPPlan | None = None) -> Trace:
    """One forward and loss of ``model`` on fake tensors, its saved storages charged to ``blocks``
    (see the module docstring); with ``tp`` > 1 and the model's ``tp_plan``, what one tp rank saves
    (a tensor the plan splits counted 1/tp: tp_flow.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        state = _fake_state(model, compute)
    params = {t.untyped_storage()._cdata for t in state.values()}  # noqa: SLF001 - storage identity, as above
    saved, inputs = _SavedBytes(params, tp), dict[int, int]()
    with fake:
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
    outputs: list[torch.Tensor] = []

    def head(module, args, output) -> None:  # the logits: the root module's output
        logits = getattr(output, "logits", output)
        if isinstance(logits, torch.Tensor):
            outputs.append(logits)

    modules = [m for _, m in blocks]
    wrapper = _LossOf(model)
    handle = model.register_forward_hook(head)
    mode = model.training
    model.train()  # as the runtime trains it: dropout keeps its masks for backward
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a module that cannot take token ids is the caller's note, not torch's log
    try:
        with fake, _charged_to_blocks(modules, saved, inputs), _fake_grouped_mm(), _one_sequence_per_row(), \
                split_flow(model, tp_plan if tp > 1 else None) as saved.flow, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            torch.func.functional_call(wrapper, {f"model.{k}": v for k, v in state.items()}, (ids,), strict=False)
    finally:
        handle.remove()
        model.train(mode)
        quiet.setLevel(level)
    n = len(blocks)
    logits = outputs[0] if outputs else None
    return Trace(per_block=tuple(saved.per_block.get(i, 0) for i in range(n)),
                 largest=tuple(saved.largest.get(i, 0) for i in range(n)),
                 inputs=tuple(inputs.get(i, 0) for i in range(n)), before=saved.before, after=saved.after,
                 logits=logits.numel() if logits is not None else 0,
                 logits_saved=logits is not None and logits.untyped_storage()._cdata in saved.seen)  # noqa: SLF001


def traced_activations(model: nn.Module, blocks: list[tuple[str, nn.Module]], *, micro_batch: int, seq: int,
                       compute: torch.dtype, policy: Checkpointing, tp: int = 1,
                       tp_plan: TPPlan | None = None) -> ActivationEstimate:
    """Per rank, for one micro-batch of ``micro_batch`` × ``seq`` tokens (see the module docstring)."""
    t = trace(model, blocks, micro_batch=micro_batch, seq=seq, compute=compute, tp=tp, tp_plan=tp_plan)
    estimate = estimate_of(t, range(len(blocks)), compute, policy, root=t.before + t.after, head_saved=t.after)
    return dataclasses.replace(estimate, block_names=tuple(name for name, _ in blocks))


class _LossOf(nn.Module):
    """``loss_sum(model, ids, ids)`` as a module, so ``functional_call`` swaps the model's state for one call."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from zeroshard.trainer.adapter import loss_sum

        total, _ = loss_sum(self.model, ids, ids)
        return total


def estimate_of(t: Trace, blocks: Iterable[int], compute: torch.dtype, policy: Checkpointing, *,
                root: int, head_saved: int = 0) -> ActivationEstimate:
    """The estimate over ``blocks`` of the trace (all of them, or one pipeline stage's), with
    ``root`` bytes saved outside them, ``head_saved`` of them by the head and loss (freed by the
    head's backward, before the blocks' backward)."""
    chosen = list(blocks)
    c = torch.empty(0, dtype=compute).element_size()
    block_bytes = sum(t.per_block[i] for i in chosen)
    layers = len(chosen)
    per_layer = block_bytes // layers if layers else 0
    boundary = max((t.inputs[i] for i in chosen), default=0)
    segments = tuple(policy.segments(layers))
    if not segments:
        kept, recompute = block_bytes, 0
    else:
        kept = len(segments) * boundary
        recompute = max(b - a for a, b in segments) * per_layer
    head = t.logits * 4 * 2 + (t.logits * c if c != 4 else 0)
    block = 2 * max((t.largest[i] for i in chosen), default=0) + 5 * boundary
    return ActivationEstimate(saved=kept + root, recompute=recompute, workspace=max(head, block),
                              per_layer=per_layer, root=root, boundary=boundary, head=head, block=block,
                              segments=segments, head_saved=head_saved)

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
One known difference: transformers treats a fake tensor as a graph being traced, so a model whose
real run would take the causal kernel without a mask (after checking its position ids hold one
sequence) builds an explicit mask here, and GQA's keys and values are expanded for it: the plan
then over-counts those (about 9% of a small Mistral's saved activations), never under-counts.
Backward's temporaries are not traced (fake tensors have no lifetimes to watch); they follow the
same two moments as the GPT formula: the loss head's gradients (the fp32 log-probabilities' and the
logits' gradients, plus a compute-dtype copy of the latter), and inside a block twice its largest
saved tensor (the gradients of the MLP's widest tensors) and five block-input-sized gradients (the
residual stream's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

import torch
from torch import nn

from zeroshard.tools.planner.activations import ActivationEstimate
from zeroshard.tools.planner.spec import Checkpointing


class _SavedBytes:
    """Storages autograd saved, each once, charged to the block running when it was saved."""

    def __init__(self, params: set[int]):
        self.params = params  # storage keys of the (meta) params: a weight saved for backward is not an activation
        self.seen: set[int] = set()
        self.block: int | None = None
        self.per_block: dict[int, int] = {}
        self.largest: dict[int, int] = {}
        self.root = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata  # noqa: SLF001 - a storage's identity; fake storages have no data_ptr
        if key in self.params or key in self.seen:
            return tensor
        self.seen.add(key)
        size = storage.nbytes()
        if self.block is None:
            self.root += size
        else:
            self.per_block[self.block] = self.per_block.get(self.block, 0) + size
            self.largest[self.block] = max(self.largest.get(self.block, 0), size)
        return tensor


@contextlib.contextmanager
def _charged_to_blocks(blocks: list[nn.Module], saved: _SavedBytes, inputs: dict[int, int]) -> Iterator[None]:
    """While block i's forward runs, what autograd saves is charged to i; its input's bytes are kept
    (what a checkpoint segment starting there holds)."""
    def enter(index: int):
        def hook(module, args, kwargs) -> None:
            saved.block = index
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


def _fake_state(model: nn.Module, compute: torch.dtype) -> dict[str, torch.Tensor]:
    """Every param and buffer as a fake CPU tensor; floating ones in the compute dtype, as the runtime runs them.
    Tied params appear once: ``functional_call`` ties the others to it."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        dtype = compute if t.is_floating_point() else t.dtype
        out[name] = torch.empty(t.shape, dtype=dtype, device="cpu", requires_grad=isinstance(t, nn.Parameter)
                                and t.requires_grad)
    return out


def traced_activations(model: nn.Module, blocks: list[tuple[str, nn.Module]], *, micro_batch: int, seq: int,
                       compute: torch.dtype, policy: Checkpointing) -> ActivationEstimate:
    """Per rank, for one micro-batch of ``micro_batch`` × ``seq`` tokens (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        state = _fake_state(model, compute)
    params = {t.untyped_storage()._cdata for t in state.values()}  # noqa: SLF001 - storage identity, as above
    saved, inputs = _SavedBytes(params), dict[int, int]()
    with fake:
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
    logits_bytes: list[int] = []

    def head(module, args, output) -> None:  # the logits: the root module's output
        logits = getattr(output, "logits", output)
        if isinstance(logits, torch.Tensor):
            logits_bytes.append(logits.numel())

    modules = [m for _, m in blocks]
    wrapper = _LossOf(model)
    handle = model.register_forward_hook(head)
    mode = model.training
    model.train()  # as the runtime trains it: dropout keeps its masks for backward
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a module that cannot take token ids is the caller's note, not torch's log
    try:
        with fake, _charged_to_blocks(modules, saved, inputs), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            torch.func.functional_call(wrapper, {f"model.{k}": v for k, v in state.items()}, (ids,), strict=False)
    finally:
        handle.remove()
        model.train(mode)
        quiet.setLevel(level)
    estimate = _estimate(saved, inputs, len(blocks), logits_bytes[0] if logits_bytes else 0, compute, policy)
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


def _estimate(saved: _SavedBytes, inputs: dict[int, int], layers: int, logits: int, compute: torch.dtype,
              policy: Checkpointing) -> ActivationEstimate:
    c = torch.empty(0, dtype=compute).element_size()
    block_bytes = sum(saved.per_block.values())
    per_layer = block_bytes // layers if layers else 0
    boundary = max(inputs.values(), default=0)
    segments = tuple(policy.segments(layers))
    if not segments:
        kept, recompute = block_bytes, 0
    else:
        kept = len(segments) * boundary
        recompute = max(b - a for a, b in segments) * per_layer
    head = logits * 4 * 2 + (logits * c if c != 4 else 0)
    block = 2 * max(saved.largest.values(), default=0) + 5 * boundary
    return ActivationEstimate(saved=kept + saved.root, recompute=recompute, workspace=max(head, block),
                              per_layer=per_layer, root=saved.root, boundary=boundary, head=head, block=block,
                              segments=segments)

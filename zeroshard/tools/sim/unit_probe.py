"""What ``plan calibrate`` times: a model built for real, one of its blocks, and the inputs that
block gets in the model's own forward.

zeroshard's GPT presets and any Hugging Face causal LM the simulator reads a shape from (a
save_pretrained folder, hf:NAME) are timed the same way: a block is called with the arguments it
received in one forward of the whole model (captured by a pre-hook; a Hugging Face decoder layer
takes masks and position embeddings beside its hidden states), its hidden-state input detached and
made to require grad, so its backward stops at the block as it does in the model; the whole model
is timed through the training step's own loss (``adapter.loss_sum``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    found = getattr(value, "last_hidden_state", None)
    if isinstance(found, torch.Tensor):
        return found
    raise TypeError(f"a block returned {type(value).__name__}, with no tensor to time its backward from")


def _real_model(spec: str, vocab: int, seq: int) -> nn.Module:
    """The model ``spec`` names with every tensor real (timing needs storage and finite values)."""
    from zeroshard.checkpoint.hf.folder import is_pretrained_folder
    from zeroshard.trainer.targets import is_preset

    torch.manual_seed(0)
    if is_preset(spec):
        from zeroshard.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig.named(spec, vocab_size=vocab, seq_len=seq))
    if is_pretrained_folder(spec):
        from zeroshard.checkpoint.hf.pretrained import plain_pretrained

        return plain_pretrained(spec)
    if spec.startswith("hf:"):
        from zeroshard.models.hf import build_hf_model

        return build_hf_model(spec, vocab_size=vocab, seq_len=seq, seed=0, device=torch.device("cpu"))
    raise ValueError(f"--calibrate times a transformer's blocks: --model must be a zeroshard preset, a "
                     f"save_pretrained folder or hf:NAME, got {spec!r}")


class UnitProbe:
    """One model's units to time: ``block_call()`` runs its first block as the model runs it,
    ``model_loss()`` the whole model's summed token loss."""

    def __init__(self, spec: str, vocab: int, micro_batch: int, seq: int) -> None:
        from zeroshard.trainer import adapter
        from zeroshard.runtime.wrap import find_blocks

        self.model = _real_model(spec, vocab, seq)
        self.model.train()  # as zeroshard train runs it: dropout on (from_pretrained returns eval mode)
        self.blocks = [m for _, m in find_blocks(self.model)]
        if not self.blocks:
            raise ValueError(f"--calibrate found no blocks in {spec} (a ModuleList of identical layers) to time")
        self.block = self.blocks[0]
        self.idx = torch.randint(0, adapter.token_vocab(self.model) or vocab, (micro_batch, seq))
        self.args, self.kwargs = self._captured_inputs()
        self.width = int(_first_tensor(self.args or tuple(self.kwargs.values())).shape[-1])

    def _captured_inputs(self) -> tuple[tuple, dict]:
        """The arguments the first block gets in one forward of the model, detached."""
        held: dict[str, Any] = {}

        def capture(module, args, kwargs) -> None:
            held.setdefault("args", (args, kwargs))

        handle = self.block.register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with torch.no_grad():
                self.model_loss()
        finally:
            handle.remove()
        args, kwargs = held["args"]
        detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
        return tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}

    def block_call(self) -> torch.Tensor:
        """The first block's output on its captured inputs, the hidden states (the first floating
        tensor) fresh leaves that require grad, so backward ends at the block."""
        args, kwargs, fresh = list(self.args), dict(self.kwargs), False
        for where in (args, kwargs):
            keys = range(len(where)) if isinstance(where, list) else list(where)
            for k in keys:
                v = where[k]  # type: ignore[index]
                if not fresh and isinstance(v, torch.Tensor) and v.is_floating_point():
                    where[k] = v.detach().requires_grad_(True)  # type: ignore[index]
                    fresh = True
        return _first_tensor(self.block(*args, **kwargs))

    def model_loss(self) -> torch.Tensor:
        from zeroshard.trainer import adapter
        return adapter.loss_sum(self.model, self.idx, self.idx)[0]

    @property
    def n_layer(self) -> int:
        return len(self.blocks)

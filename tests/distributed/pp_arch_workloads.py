"""Workers for the pipeline tests of models zeroshard has no code for: an HF Gemma2 (embedding scale,
final-logit soft-capping, sliding-window layers) and a nanoGPT-shaped model of the tests' own, each
cut by the library's ``Pipeline`` at pp 2 x shard 2 and trained with AdamW as one process does.

Module level so spawned ranks can import it; one process group runs every case.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched; the configs are built in code

from typing import Any

import torch
import torch.nn.functional as F

import nano_gpt
from pp_arch_configs import pp_arch_configs
import zeroshard as zs
from zeroshard.parallel.pipeline import Pipeline

VOCAB = 96
SEQ = 16
BATCH = 8
STEPS = 3
CASES = {"gemma2": (3, None, 1e-3), "nano": (3, "transformer.h", 1e-4)}
"""name -> (ZeRO stage inside each pipeline stage, the blocks path the user gives, AdamW's lr). Some of
nano's LayerNorm gains get grads within rounding of zero, which AdamW's normalisation turns into
steps of up to lr either way (the grads agree to 1.5e-8 with SGD): its lr keeps that under 1e-5."""


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "nano":
        return nano_gpt.NanoGPT(nano_gpt.NanoConfig(vocab_size=VOCAB, block_size=SEQ))
    import transformers as tf

    config = pp_arch_configs()["gemma2"]
    return tf.AutoModelForCausalLM.from_config(config).train()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x) if isinstance(model, nano_gpt.NanoGPT) else model(input_ids=x)
    return out[0] if isinstance(out, tuple) else out.logits


def reference(name: str) -> dict[str, Any]:
    """One process: the mean token loss of each step, then the params after STEPS AdamW steps."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=CASES[name][2])
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        logits = _logits(model, x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(name: str, mesh) -> dict[str, Any]:
    stage, blocks, lr = CASES[name]
    pipe = Pipeline(build(name), mesh=mesh, stage=stage, blocks=blocks)
    opts = pipe.optimizers(torch.optim.AdamW, lr=lr)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
        # Each microbatch backpropagates its loss sum x dp / global tokens: the global mean's grad.
        total = pipe.run(x, y, loss_scale=torch.tensor(mesh.dp_size / (BATCH * SEQ)))
        pipe.reduce()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(float(pipe.pp_sum(total)))  # this data-parallel slice's loss sum
    return {"losses": losses, "params": pipe.full_state_dict(), "dp_rank": mesh.dp_rank}


def suite() -> dict[str, Any]:
    mesh = zs.init(pp=2)
    out = {name: _pipelined(name, mesh) for name in CASES}
    zs.shutdown()
    return out

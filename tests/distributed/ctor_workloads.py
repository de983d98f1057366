"""Workers for constructor replay: a model in the Hugging Face init pattern, built by ``zs.shard(build)``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard as zs
from zeroshard.observing.profile.alloc import peak_allocated
from zeroshard.runtime import get_engine

SEED = 2024
LR = 2e-3
STEPS = 4
BATCH, SEQ, VOCAB = 8, 16, 96


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias gets only rounding noise as grad
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(h)).chunk(3, dim=-1)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.out(F.gelu(self.fc(h)))


class HFStyleLM(nn.Module):
    """Written as Hugging Face models are: every layer draws its default init while being built,
    ``self.apply(self._init_weights)`` then overwrites Linear/Embedding with normal(0, 0.02) and zero
    bias (and the padding row), the output projections get a scaled ``trunc_normal_``, constants are
    set in ``__init__`` (a buffer, a rotary-style table, a scale param), and the head is tied last."""

    def __init__(self, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d, padding_idx=0)
        self.wpe = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("pos_scale", torch.full((SEQ, 1), 0.5))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.logit_scale = nn.Parameter(torch.ones(1) * 0.7)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.trunc_normal_(p, std=0.02 / math.sqrt(2 * layers))
        self.lm_head.weight = self.wte.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1])
        rotary = torch.sin(pos[:, None].float() * self.inv_freq).repeat(1, 2)
        h = self.wte(x) + self.wpe(pos) * self.pos_scale[: x.shape[1]] + rotary
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h)) * self.logit_scale


def _batches(world: int, rank: int):
    """The same global batch every step (memorising it must lower the loss), this rank's rows."""
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=gen)
    share = BATCH // world
    mine = tokens[rank * share:(rank + 1) * share]
    for _ in range(STEPS):
        yield mine[:, :-1], mine[:, 1:]


def reference_run() -> dict:
    """Plain single-process PyTorch: seed, build, train."""
    torch.manual_seed(SEED)
    model = HFStyleLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches(1, 0):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _train(model: nn.Module) -> list[float]:
    mesh = zs.get_mesh()
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR, param_groups=[{"params": [n for n, _ in model.named_parameters()]}])
    losses = []
    for x, y in _batches(mesh.world, mesh.rank):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().reshape(1) / mesh.world
        zs.comm.collectives.all_reduce(mean, op="sum", phase="metrics")
        losses.append(mean.item())
    return losses


def suite() -> dict:
    """Bitwise init at every stage, the RNG left where a plain build leaves it, tying, the meta
    path for comparison, then training parity and the init memory at stage 3."""
    mesh = zs.init()
    torch.manual_seed(SEED)
    plain = HFStyleLM()
    expected, rng_after = plain.state_dict(), torch.get_rng_state()
    out: dict = {"expected": expected}
    for stage in (0, 2, 3):
        torch.manual_seed(SEED)
        model = zs.shard(HFStyleLM, stage=stage)
        rng_equal = torch.equal(torch.get_rng_state(), rng_after)
        got = zs.full_state_dict(model)
        out[stage] = {"got": got, "rng_equal": rng_equal, "tied": model.lm_head.weight is model.wte.weight,
                      "init_stats": dict(get_engine(model).init_stats)}
    out["meta_default"] = _meta_default(expected)
    torch.manual_seed(SEED)
    peak, model = peak_allocated(lambda: zs.shard(HFStyleLM, stage=3))
    engine = get_engine(model)
    out["memory"] = {"peak": peak, "shard_bytes": sum(g.shard.untyped_storage().nbytes() for g in engine.groups),
                     "largest_param_bytes": max(s.numel for g in engine.groups for s in g.layout.slots) * 4,
                     "model_bytes": sum(p.numel() for p in plain.parameters()) * 4,
                     "buffer_bytes": sum(b.numel() * b.element_size() for b in plain.buffers()),
                     "held_whole_bytes": engine.init_stats["held_whole_bytes"],
                     "recipe_bytes": engine.init_stats["recipe_bytes"]}
    out["losses"] = _train(model)
    out["trained"] = zs.full_state_dict(model)
    out["world"] = mesh.world
    return out


def _meta_default(expected: dict) -> str:
    """What the meta path gives this model with no init_fn: an error, or how far it is off."""
    torch.manual_seed(SEED)
    with zs.meta_init():
        model = HFStyleLM()
    try:
        zs.shard(model, stage=3)
    except ValueError as e:
        return f"error: {e}"
    got = zs.full_state_dict(model)
    return f"max diff {max((got[k] - expected[k]).abs().max().item() for k in expected):.3g}"


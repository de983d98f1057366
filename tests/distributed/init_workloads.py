"""Workers for meta-device init: bitwise equality with a plain build, and peak init memory."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard as zs
from zeroshard.runtime.materialize import reset_then_init_weights
from zeroshard.models import GPT, GPTConfig
from zeroshard.observing.profile.alloc import peak_allocated
from zeroshard.runtime import get_engine

SEED = 4321


class ResetInit(nn.Module):
    """Initialised only by torch's own ``reset_parameters()`` in each layer's constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 48), nn.LayerNorm(48), nn.Linear(48, 32))
                                     for _ in range(3)])
        self.head = nn.Linear(32, 7)


class TruncInit(nn.Module):
    """Hugging Face pattern: layers draw their default init while being built, then a model-level
    ``init_weights()`` overwrites it with multi-op in-place inits."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(40, 40) for _ in range(3)])
        self.emb = nn.Embedding(50, 40)
        self.init_weights()

    def init_weights(self) -> None:
        for block in self.blocks:
            nn.init.trunc_normal_(block.weight, std=0.02, a=-0.04, b=0.04)
            block.bias.data.uniform_(-0.1, 0.1)
        nn.init.orthogonal_(self.emb.weight)


def _models():
    """(name, builder, init_fn replaying what the builder's construction drew)."""
    yield "tiny", lambda: GPT(GPTConfig.named("tiny")), None
    yield "small", lambda: GPT(GPTConfig.named("small")), None
    yield "reset_parameters", ResetInit, None
    yield "init_weights", TruncInit, reset_then_init_weights


def equality_suite() -> dict:
    """For every model and stage 2/3: is the sharded meta init bitwise the plain init?"""
    zs.init()
    out = {}
    for name, build, init_fn in _models():
        torch.manual_seed(SEED)
        expected = build().state_dict()
        for stage in (2, 3):
            torch.manual_seed(SEED)
            with zs.meta_init():
                model = build()
            zs.shard(model, stage=stage, init_fn=init_fn)
            got = zs.full_state_dict(model)
            out[(name, stage)] = {
                "equal": got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected),
                "path": get_engine(model).init_stats["path"],
            }
    return out


def init_memory(model_name: str, stage: int = 3) -> dict:
    """Peak init bytes for one rank, with and without meta init, next to the shard-size bound."""
    zs.init()
    cfg = GPTConfig.named(model_name)

    def meta():
        torch.manual_seed(SEED)
        with zs.meta_init():
            model = GPT(cfg)
        return zs.shard(model, stage=stage)

    def plain():
        torch.manual_seed(SEED)
        return zs.shard(GPT(cfg), stage=stage)

    meta_peak, model = peak_allocated(meta)
    engine = get_engine(model)
    shard_bytes = sum(g.shard.untyped_storage().nbytes() for g in engine.groups)
    largest_param = max(s.numel for g in engine.groups for s in g.layout.slots) * 4
    model_bytes = sum(g.layout.param_numel for g in engine.groups) * 4
    del model, engine
    plain_peak, _ = peak_allocated(plain)
    return {"meta_peak": meta_peak, "plain_peak": plain_peak, "shard_bytes": shard_bytes,
            "largest_param_bytes": largest_param, "model_bytes": model_bytes}


def world2_suite() -> dict:
    """`init_memory("small")` then `equality_suite()` in one process group, so the module pays for one
    world-2 spawn. The memory case runs first, in a process that has built nothing yet, as it would alone."""
    init = init_memory("small")
    return {"init_memory": init, "equality": equality_suite()}

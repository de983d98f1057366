"""Expert parallelism for a `TrainConfig` run (`ep` > 1): check the model can be split, then split it.

`zeroshard.trainer.step.build` calls `apply_expert_parallel` between building the model and `zs.shard`,
the order zeroshard/parallel/experts/apply.py needs (at ep 1 under data parallelism it only makes the
routers' load-balancing counts global, so the loss is the global batch's at every ep). The CLI
calls `check_expert_parallel` before any rank starts (a meta build of the model: nothing
allocated), so an ep the model cannot take (no MoE layer, an expert count ep does not divide) is
one line rather than every rank's failure.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.trainer.config import TrainConfig


def check_expert_parallel(cfg: TrainConfig) -> None:
    """The model ``cfg`` names, built on meta, has MoE layers whose expert counts ``cfg.ep`` divides."""
    if cfg.ep == 1:
        return
    from zeroshard.runtime.materialize import meta_init
    from zeroshard.parallel.experts import check_ep
    from zeroshard.trainer import adapter
    from zeroshard.models.gpt import GPT, GPTConfig

    model: torch.nn.Module
    if adapter.is_hf_name(cfg.model):
        model = adapter.build_hf(cfg, cfg.vocab_size, torch.device("cpu"), allow_meta=True, threshold=0)
    else:
        with meta_init():
            model = GPT(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len))
    check_ep(model, cfg.ep)


def apply_expert_parallel(cfg: TrainConfig, model: torch.nn.Module, mesh: Any) -> None:
    """With an ep dim on ``mesh``, keep only this rank's experts of ``model`` (before ``zs.shard``)."""
    if cfg.ep > 1 and mesh.ep_size != cfg.ep:
        raise ValueError(f"ep={cfg.ep} but the mesh's ep dim is {mesh.ep_size}; build the mesh with "
                         f"zs.init(ep={cfg.ep}) (zeroshard train does)")
    if mesh.ep_size == 1:
        if mesh.dp_size > 1:  # still one load-balancing loss over the global batch
            from zeroshard.parallel.experts.apply import moe_layers, share_router_aux_counts, share_routing_counts

            share_routing_counts(moe_layers(model), mesh)
            share_router_aux_counts(model, mesh)
        return
    from zeroshard.parallel.experts import expert_parallel
    from zeroshard.trainer import adapter
    # A pretrained folder's model is on meta until zs.shard; load_pretrained then reads each rank's
    # block of experts (zeroshard/checkpoint/hf/pretrained.py).
    expert_parallel(model, mesh=mesh, values_from_folder=adapter.is_pretrained_model(model))

"""Tensor parallelism for a `TrainConfig` run (`tp` > 1): check the model can be split, then split it.

`zeroshard.trainer.step.build` calls `apply_tensor_parallel` between building the model and `zs.shard`,
which is the order the library needs (docs/tensor_parallel.md): the plan turns each split linear's
params into DTensors, and ZeRO then flattens and shards their tp-local parts. The CLI calls
`check_tensor_parallel` before any rank starts, so a tp that the model cannot take is one line
rather than every rank's failure.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.trainer.config import TrainConfig


def tensor_parallel_plan(cfg: TrainConfig, model: torch.nn.Module) -> None:
    """Check that ``model`` can be split over ``cfg.tp`` ranks (its spec has a tensor-parallel plan,
    zeroshard/models/spec.py, and tp divides what the plan splits) without splitting it; a
    ValueError names the problem and the fix."""
    from zeroshard.models.specs import spec_of
    from zeroshard.parallel.tp import check_tensor_parallel as check

    spec = spec_of(model)
    if spec.tp_refusal:
        raise ValueError(f"model={cfg.model!r} has no tensor-parallel plan: {spec.tp_refusal}")
    check(model, cfg.tp)


def check_tensor_parallel(cfg: TrainConfig) -> None:
    """``tensor_parallel_plan`` on ``cfg``'s model built on the meta device (nothing allocated)."""
    if cfg.tp == 1:
        return
    from zeroshard.runtime.materialize import meta_init
    from zeroshard.trainer import adapter
    from zeroshard.models.gpt import GPT, GPTConfig

    vocab = cfg.vocab_size  # the plans never split the embeddings by a size the data sets
    model: torch.nn.Module
    if adapter.is_hf_name(cfg.model):
        from zeroshard.models.hf import build_hf_model, is_hf_name

        if is_hf_name(cfg.model):
            model = build_hf_model(cfg.model, vocab_size=vocab, seq_len=cfg.seq_len, seed=cfg.seed,
                                   device=torch.device("cpu"), meta=True)
        else:  # a save_pretrained folder
            from zeroshard.checkpoint.hf.pretrained import build_pretrained

            model = build_pretrained(cfg.model)
    else:
        with meta_init():
            model = GPT(GPTConfig.named(cfg.model, vocab_size=vocab, seq_len=cfg.seq_len))
    tensor_parallel_plan(cfg, model)


def apply_tensor_parallel(cfg: TrainConfig, model: torch.nn.Module, mesh: Any) -> None:
    """With ``cfg.tp`` > 1, split ``model``'s blocks over ``mesh``'s tp dim, in place (a meta model on meta)."""
    if cfg.tp == 1:
        return  # a caller may pass a model it parallelised itself, on a mesh with a tp dim (the TP tests do)
    if mesh.tp_size != cfg.tp:
        raise ValueError(f"tp={cfg.tp} but the mesh's tp dim is {mesh.tp_size}; build the mesh with "
                         f"zs.init(tp={cfg.tp}) (zeroshard train does)")
    from zeroshard.parallel.tp import tensor_parallel

    tensor_parallel_plan(cfg, model)
    tensor_parallel(model, mesh=mesh)  # the mesh zs.shard will shard it over (step.build passes the same)

"""What a `TrainConfig` asks of the model and the pipeline schedules, checked against them.

TrainConfig checks its keys with no model, schedule or checkpoint code loaded (zeroshard/trainer/
config.py imports none). What needs them is here: the blocks pp cuts (a preset's, or a pretrained
folder's config.json), the schedule's rules (stages per rank, microbatches, checkpointing and
compile under it) and the pipeline's grad reduction. `check_runnable` runs before any rank starts:
`zeroshard train`, `verify` and `tune` call it on the config they built, and so does `train_worker`.
"""

from __future__ import annotations

import json
from pathlib import Path

from zeroshard.models.names import HF_PREFIX, HF_TINY_LAYERS
from zeroshard.trainer.config import PP_MODEL_NAMES, TrainConfig

# The schedules, the model and the folder reader are imported where a pipeline is checked: torch's
# pipelining loads DTensor, which the command line's own process must not pay for (it only parses).


def pp_microbatches(cfg: TrainConfig) -> int:
    """`microbatches`, or its default (pp x stages per rank) when 0; 1 without a pipeline."""
    from zeroshard.parallel.pipeline.schedules import microbatches_of

    return microbatches_of(cfg.parallel.pp, schedule=cfg.pipeline.schedule, microbatches=cfg.pipeline.microbatches,
                           stages_per_rank_asked=cfg.pipeline.stages_per_rank)


def check_runnable(cfg: TrainConfig) -> TrainConfig:
    """One line naming the problem and the fix for an optimizer zeroshard cannot build, or a pipeline
    the model or the schedule cannot run."""
    from zeroshard.trainer.optimizers import parse_optimizer  # torch's classes: not at config time

    parse_optimizer(cfg.optimizer)
    dims = cfg.dims
    if dims.cp > 1:  # the attention scheme's chunks must divide the sequence
        from zeroshard.parallel.cp.layout import check_seq

        check_seq(cfg.data.seq_len, cp=dims.cp, scheme=cfg.parallel.cp_attention)
    if dims.pp == 1:
        return cfg
    from zeroshard.parallel.pipeline.grad_reduce import check_grad_reduce
    from zeroshard.parallel.pipeline.schedules import (check_checkpointing, check_compile, check_microbatches,
                                                       schedule_spec, stages_per_rank)

    spec = schedule_spec(cfg.pipeline.schedule)
    per_rank = stages_per_rank(spec, cfg.pipeline.stages_per_rank)
    check_checkpointing(spec, cfg.engine.checkpointing)
    check_compile(spec, cfg.compile.enabled)
    layers = pp_block_count(cfg.model, cfg.pipeline.blocks)
    if layers is not None and layers % (dims.pp * per_rank):
        raise ValueError(f"pp={dims.pp} x {per_rank} stages per rank does not divide the {layers} blocks of "
                         f"{cfg.model}; pick pp x pp_stages_per_rank dividing {layers}")
    if cfg.init == "meta" and cfg.model.startswith(HF_PREFIX):
        raise ValueError("init=meta under pp > 1 is not yet composed with a Hugging Face preset; use init=full "
                         "(or auto), a GPT preset, or a save_pretrained folder (read on meta stage by stage)")
    if cfg.engine.check_schedule:
        raise ValueError("check_schedule is not yet composed with pp > 1 (docs/pipeline.md, limits); drop it or "
                         "use pp=1")
    check_grad_reduce(cfg.engine.pp_grad_reduce, stage=cfg.stage)
    batch, accum = cfg.data.batch, cfg.optim.accum
    if batch % (dims.dp * accum) == 0:
        check_microbatches(spec, microbatches=pp_microbatches(cfg), pp=dims.pp, local_batch=batch // (dims.dp * accum))
    return cfg


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
"""Where a config.json counts its blocks (transformers' configs map their own spellings onto the first)."""


def pp_block_count(model: str, blocks: str = "") -> int | None:
    """The blocks pp cuts into stages: a preset's, or a pretrained folder's layers; None when a folder
    does not count them (the pipeline checks its split when it is built)."""
    from zeroshard.checkpoint.hf.folder import CONFIG, is_pretrained_folder
    from zeroshard.models.gpt import GPTConfig

    if is_pretrained_folder(model):
        try:
            hf = json.loads((Path(model) / CONFIG).read_text())
        except ValueError as e:
            raise ValueError(f"{Path(model) / CONFIG} is not JSON ({e}); fix or rewrite the folder") from e
        if hf.get("output_router_logits") and hf.get("router_aux_loss_coef"):
            # (zeroshard/parallel/pipeline/layout.py refuses the built model the same way)
            raise ValueError(f"the {hf.get('model_type')} model in {model} asks for its routers' load-balancing loss "
                             "(output_router_logits), one term over every layer's tokens that no pipeline stage "
                             "holds; set output_router_logits to false in its config.json or use pp=1")
        layers = next((hf[k] for k in LAYER_KEYS if isinstance(hf.get(k), int)), None)
        if layers is None and not blocks:
            raise ValueError(f"the config.json of {model} counts no layers ({', '.join(LAYER_KEYS)}); give the "
                             "model's blocks path (--pp-blocks, [pipeline] blocks) or use pp=1")
        return layers
    if model not in PP_MODEL_NAMES:
        raise ValueError(f"model={model!r} cannot be cut into pipeline stages; use pp=1, one of "
                         f"{', '.join(PP_MODEL_NAMES)}, or a save_pretrained folder")
    if model.startswith(HF_PREFIX):
        return HF_TINY_LAYERS
    return GPTConfig.named(model).n_layer

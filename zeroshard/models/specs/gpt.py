"""zeroshard's own GPT (zeroshard/models/gpt.py): the one spec written by hand.

Megatron's split of each block: the fused ``attn.qkv`` (q, k and v stacked by rows, each split on
its own: 3 row blocks) and ``mlp.fc`` column-wise, ``attn.proj`` and ``mlp.proj`` row-wise; the
embeddings, norms and tied head stay whole. A block whose MLP is routed experts (``n_expert > 0``)
splits its attention alone: the MoE layer stays whole on every tp rank (its router computes on every
token), its experts split over ep instead (zeroshard/parallel/experts/).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.models.spec import ModelSpec
from zeroshard.runtime.tp_plan import COLWISE, ROWWISE, TPPlan

GPT_TP_STYLES: dict[str, str] = {"attn.qkv": COLWISE, "attn.proj": ROWWISE, "mlp.fc": COLWISE, "mlp.proj": ROWWISE}
"""Submodule of each GPT block -> its split; the planner (zeroshard/tools/planner/tp.py) reads the same table."""

GPT_MOE_TP_STYLES: dict[str, str] = {name: style for name, style in GPT_TP_STYLES.items() if name.startswith("attn.")}
"""A GPT block whose MLP is routed experts: the attention alone is split."""

GPT_FUSED = {"attn.qkv": 3}
"""The GPT's fused projections: q, k and v stacked by rows in one linear, each split on its own."""

BLOCKS = "blocks"


def gpt_spec(model: nn.Module) -> ModelSpec:
    cfg: Any = getattr(model, "cfg")
    moe = bool(getattr(cfg, "n_expert", 0))
    styles = GPT_MOE_TP_STYLES if moe else GPT_TP_STYLES
    divides = {"n_head": cfg.n_head} if moe else {"n_head": cfg.n_head, "mlp hidden size": cfg.mlp_ratio * cfg.n_embd}
    return ModelSpec(
        name="GPT", blocks=BLOCKS, before=("tok_emb", "pos_emb"), after=("norm_f", "lm_head"),
        tp_plan={f"{BLOCKS}.*.{name}": style for name, style in styles.items()},
        tp_chunks={f"{BLOCKS}.*.{name}": n for name, n in GPT_FUSED.items()}, tp_divides=divides,
        # The residual stream stays split by sequence between the norms: each column-wise linear
        # all-gathers its input, each row-wise linear reduce-scatters its output (Megatron-SP).
        sequence_norms=("ln1", "ln2"), stream_inputs=False,
        sequence_refusal="sequence parallelism with an MoE GPT (n_expert > 0) is not supported: its MoE layer needs "
                         "the whole sequence on every tp rank; call zs.tensor_parallel without sequence_parallel"
        if moe else "",
        experts=(f"{BLOCKS}.*.mlp.experts",) if moe else (), ep_plan=dict(getattr(model, "ep_plan")),  # the GPT's own
        no_split=("Block",))


def gpt_plan_by_name() -> TPPlan:
    """The dense GPT's plan without a model (offline tools): the sizes it divides are the checkpoint's."""
    return TPPlan(blocks=BLOCKS, styles=dict(GPT_TP_STYLES), chunks=dict(GPT_FUSED), name="GPT")

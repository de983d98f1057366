"""The planner under ep with tp (docs/expert_parallel.md, "With tensor parallelism"): the experts
are not tp split, so each is sharded over the world / ep ranks that hold it; each tp rank routes
its run of the replicated tokens (the runtime's ``run_of``), so its all-to-alls and routed rows are
1/tp of a tp-less rank's; the MoE layer's outputs and input grads are all-gathered over tp; and
an MoE block has one tp all-reduce per direction (its attention's), not two."""

from __future__ import annotations

from zeroshard.experts.tp_tokens import run_of
from zeroshard.models import GPTConfig
from zeroshard.planner import plan

CFG = GPTConfig.named("tiny-moe", n_layer=2, vocab_size=64, seq_len=32)
SEQ, ACCUM = 32, 2


def _rows(layout, group: str, op: str) -> dict[str, int]:
    """Bytes per step of ``op`` on ``group``, by phase."""
    out: dict[str, int] = {}
    for c in layout.collectives:
        if c.group == group and c.op == op:
            out[c.phase] = out.get(c.phase, 0) + c.buffer_bytes * c.count
    return out


def test_each_tp_rank_routes_its_run_of_the_tokens():
    """At (dp 2 x tp 2, ep 2) a rank's ep all-to-alls carry its tp run's rows: half of what a rank of
    (dp 2, ep 2) sends for the same micro-batch, the counts exchange unchanged."""
    with_tp = plan(CFG, world=4, tp=2, ep=2, batch=8, seq=SEQ, accum=ACCUM)["zero3"]
    without = plan(CFG, world=2, ep=2, batch=8, seq=SEQ, accum=ACCUM)["zero3"]
    counts = CFG.n_layer * ACCUM * CFG.n_expert * 8
    for phase in ("forward", "backward"):
        routed = _rows(with_tp, "ep", "all_to_all")[phase] - (counts if phase == "forward" else 0)
        whole = _rows(without, "ep", "all_to_all")[phase] - (counts if phase == "forward" else 0)
        assert routed * 2 == whole, (phase, routed, whole)
    assert with_tp.experts["all_to_all_buffers"] * 2 == without.experts["all_to_all_buffers"]


def test_the_moe_layers_tp_all_gathers_are_the_padded_runs():
    """Per MoE layer call: forward the outputs, backward the input rows' and the routing weights'
    grads, each tp x c rows (c the padded run), as the ledger counts an all-gather (its output)."""
    seq = 15  # 2 sequences x 15 tokens per micro-batch: runs of 15 and 15 at tp 2; 8, 8, 8, 6 at tp 4
    for tp in (2, 4):
        p = plan(CFG, world=8, tp=tp, ep=2, batch=8 // tp * 2 * ACCUM, seq=seq, accum=ACCUM)["zero3"]
        tokens = 2 * seq
        _, _, c = run_of(tokens, tp, 0)
        calls = CFG.n_layer * ACCUM
        hidden, weights = tp * c * CFG.n_embd * 4, tp * c * CFG.expert_top_k * 4
        assert _rows(p, "tp", "all_gather") == {"forward": calls * hidden, "backward": calls * (hidden + weights)}
        assert all(r.size == tp for r in p.collectives if r.group == "tp")
        assert (tp * c > tokens) == (tp == 4)  # the short last run is padded


def test_an_moe_block_all_reduces_once_per_direction_under_tp():
    """The MoE MLP is not split: each block all-reduces its attention's output forward and its
    input's grad backward, tokens x n_embd each; a dense GPT block does it twice."""
    moe = plan(CFG, world=4, tp=2, ep=2, batch=8, seq=SEQ, accum=ACCUM)["zero3"]
    dense = plan(GPTConfig.named("tiny", n_layer=2, vocab_size=64, seq_len=32), world=4, tp=2, batch=8, seq=SEQ,
                 accum=ACCUM)["zero3"]
    tokens = 8 // (2 * ACCUM) * SEQ
    per_buffer = tokens * CFG.n_embd * 4
    (row,) = [c for c in moe.collectives if c.group == "tp" and c.op == "all_reduce"]
    assert (row.buffer_bytes, row.count) == (per_buffer, 2 * CFG.n_layer * ACCUM)
    (dense_row,) = [c for c in dense.collectives if c.group == "tp" and c.op == "all_reduce"]
    assert dense_row.count == 2 * row.count


def test_experts_are_sharded_over_world_over_ep_and_the_dense_params_split_by_tp():
    """(dp 2 x tp 2, ep 2): each expert over its edp 2 ranks (world / ep), none of it tp split; the
    attention's split params are halved by tp before ZeRO shards them over dp 2."""
    p = plan(CFG, world=4, tp=2, ep=2, batch=8, seq=SEQ)
    assert p.spec.edp == 2
    experts = p["zero3"].experts
    meta = _meta()
    stacked = sum(t.numel() for n, t in meta.named_parameters() if ".experts." in n)
    assert experts["expert_numel"] * 2 == stacked
    assert 0 <= experts["expert_params"] - stacked * 4 / 4 <= 4 * 64 * 4  # fp32, per-slot padding
    assert p["zero1"].experts["expert_params"] == experts["expert_numel"] * 4  # stage 1 keeps them whole
    attention = sum(t.numel() for n, t in meta.named_parameters() if ".attn.qkv." in n or n.endswith("attn.proj.weight"))
    dense = sum(t.numel() for n, t in meta.named_parameters() if ".experts." not in n)
    assert experts["dense_numel"] == dense - attention // 2
    # ep 4 at (dp 2 x tp 2): one ep group of the world, each expert on one rank (edp 1)
    assert plan(CFG, world=4, tp=2, ep=4, batch=8, seq=SEQ).spec.edp == 1


def test_tp_with_an_moe_model_and_no_ep_keeps_the_moe_layer_whole():
    """Without ep every tp rank runs the whole MoE layer on every token: no all-to-all, no tp gather,
    the experts' bytes as at tp 1, the attention halved."""
    p = plan(CFG, world=4, tp=2, batch=8, seq=SEQ)["zero1"]
    at_tp1 = plan(CFG, world=2, batch=8, seq=SEQ)["zero1"]
    assert not [c for c in p.collectives if c.group == "ep" or c.op == "all_gather" and c.group == "tp"]
    assert p.device.params < at_tp1.device.params
    assert p.device.activations < at_tp1.device.activations  # the attention's split tensors


def _meta():
    import torch

    from zeroshard.models import GPT

    with torch.device("meta"):
        return GPT(CFG)

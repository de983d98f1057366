"""The planner under ep with tp (docs/expert_parallel.md, "With tensor parallelism"): the experts
are not tp split, so each is sharded over the world / ep ranks that hold it; each tp rank routes
its run of the replicated tokens (the runtime's ``run_of``), so its all-to-alls and routed rows are
1/tp of a tp-less rank's; the MoE layer's outputs and input grads are all-gathered over tp; and
an MoE block has one tp all-reduce per direction (its attention's), not two."""

from __future__ import annotations

import pytest

from zeroshard.parallel.experts.tp_tokens import run_of
from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan

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


# -- the simulator's rows under ep with tp ---------------------------------------------------------
def _sim(world: int, tp: int, ep: int, stage: int, seq: int = SEQ, batch: int = 8):
    from zeroshard.tools.sim.hardware import load_hardware
    from zeroshard.tools.sim.step import Layout, simulate
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    w = Workload(shape=gpt_shape(CFG, "tiny-moe"), micro_batch=batch // (world // tp * ACCUM), seq=seq, accum=ACCUM,
                 compute_bytes=4)
    return simulate(w, load_hardware("h100"), Layout.of(world=world, stage=stage, ep=ep, tp=tp, param_bytes=4))


def test_the_simulator_moves_the_planners_ep_and_tp_bytes():
    """The replay's all-to-alls carry each tp rank's run (the planner's ep rows, byte for byte), and
    its tp bytes are the planner's tp rows: one all-reduce per MoE block and direction plus the MoE
    layers' padded all-gathers, at tp 2 and 4 (runs of 15 + 15 and 8 + 8 + 8 + 6 tokens)."""
    for world, tp, ep, seq in ((4, 2, 2, SEQ), (8, 2, 4, SEQ), (8, 4, 2, 15)):
        batch = world // tp * ACCUM * 2
        for stage in (1, 3):
            got = _sim(world, tp, ep, stage, seq=seq, batch=batch)
            planned = plan(CFG, world=world, tp=tp, ep=ep, batch=batch, seq=seq, accum=ACCUM)[f"zero{stage}"]
            ep_rows = sum(c.buffer_bytes * c.count for c in planned.collectives if c.group == "ep")
            tp_rows = sum(c.buffer_bytes * c.count for c in planned.collectives if c.group == "tp")
            assert got.ep_bytes == ep_rows, (world, tp, ep, stage)
            assert got.tp_bytes == tp_rows, (world, tp, ep, stage, got.tp_bytes, tp_rows)
            assert got.breakdown["all-to-all (ep)"] > 0


def test_the_simulators_expert_groups_span_world_over_ep():
    """Each expert is sharded and reduced over the world / ep ranks holding it (ep borrows from dp x tp),
    and a rank's shard of the model is its tp part of the attention, the MoE layer whole, its ep block
    of the experts over those ranks."""
    from zeroshard.tools.sim.step import Layout

    assert Layout.of(world=4, stage=3, tp=2, ep=2).expert_group == 2
    assert Layout.of(world=4, stage=3, tp=2, ep=4).expert_group == 1
    assert Layout.of(world=8, stage=3, tp=4, ep=2).expert_group == 4
    assert Layout.of(world=8, stage=3, ep=2).expert_group == 4  # without tp: dp / ep


def test_the_tp_gathers_are_priced_on_the_tp_link():
    """Under ep with tp each MoE block's all-gathers block compute, priced on the tp group (within a
    node): forward the outputs', backward the input rows' and the routing weights' grads."""
    from zeroshard.tools.sim.hardware import load_hardware
    from zeroshard.tools.sim.network import collective_seconds
    from zeroshard.tools.sim.replay import Walked, _AllToAlls
    from zeroshard.tools.sim.step import CommLink, Layout
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    hw = load_hardware("h100")
    layout = Layout.of(world=4, stage=3, tp=2, ep=2, param_bytes=4)
    w = Workload(shape=gpt_shape(CFG, "tiny-moe"), micro_batch=2, seq=SEQ, compute_bytes=4)
    a2a = _AllToAlls(w, layout, CommLink(hw, layout))
    rows = 2 * run_of(w.tokens, 2, 0)[2] * 4  # tp x c rows, fp32
    out = Walked(t=0.0, optimizer_share=0.0, param_sync_bytes=0.0, tp_bytes=0.0)
    forward = a2a.price(0.0, 1.0, "forward", out)
    gather = collective_seconds("all_gather", rows * CFG.n_embd, 2, hw, spans=False)
    assert gather > 0 and forward == pytest.approx(2 * a2a.exchange + a2a.count_exchange + gather)
    backward = a2a.price(0.0, 1.0, "backward", out)
    weights = collective_seconds("all_gather", rows * CFG.expert_top_k, 2, hw, spans=False)
    assert backward == pytest.approx(2 * a2a.exchange + gather + weights)
    assert out.tp_bytes == rows * (2 * CFG.n_embd + CFG.expert_top_k)
    without_tp = _AllToAlls(w, Layout.of(world=4, stage=3, ep=2, param_bytes=4), CommLink(hw, layout))
    assert without_tp.gather_fwd_s == 0 and without_tp.rows == 2 * a2a.rows


def test_a_tp_rank_computes_its_experts_on_its_run_only_under_ep():
    """The attention's matmuls split over tp; the router runs on every token; the experts run on the
    rank's run of the tokens under ep, and on every token without it (the MoE layer stays whole)."""
    from zeroshard.tools.sim.workload import Workload, gpt_shape

    w = Workload(shape=gpt_shape(CFG, "tiny-moe"), micro_batch=2, seq=SEQ)
    dense = Workload(shape=gpt_shape(GPTConfig.named("tiny", n_layer=2, vocab_size=64, seq_len=32)), micro_batch=2,
                     seq=SEQ)
    assert dense.block_gemm_flops_on(2, experts_split=False) == dense.block_gemm_flops / 2
    assert w.block_gemm_flops_on(1, experts_split=True) == w.block_gemm_flops
    whole, split = w.block_gemm_flops_on(2, experts_split=False), w.block_gemm_flops_on(2, experts_split=True)
    assert w.block_gemm_flops / 2 < split < whole < w.block_gemm_flops
    assert _sim(4, 2, 2, 3).compute_s < _sim(4, 2, 1, 3).compute_s

"""The planner under tensor parallelism, against figures worked out by hand for one small GPT.

C = 128, 2 blocks, 4 heads, vocab 256, 64 positions, fp32, AdamW. Per block, Megatron's split
divides qkv (3C² + 3C), attn.proj's weight (C²), fc (4C² + 4C) and mlp.proj's weight (4C²): 12C² + 7C
elements; the two norms (4C) and the two row-wise biases (2C) stay whole on every tp rank. The root
(token and position embeddings, the final norm) is not split. Up to tp=2 every tp-local param is a
multiple of 64 elements, so the runtime's slot alignment adds nothing; a stage-3 buffer is padded
to shards × 64.
"""

from __future__ import annotations

import pytest

from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan
from zeroshard.tools.planner.recommend import layer_floor, recommend
from zeroshard.tools.planner.tp import TensorParallel

C, L, HEADS, V, POS = 128, 2, 4, 256, 64
CFG = GPTConfig(vocab_size=V, seq_len=POS, n_layer=L, n_head=HEADS, n_embd=C)
SPLIT = 12 * C * C + 7 * C
WHOLE = 6 * C
ROOT = V * C + POS * C + 2 * C
FP32 = 4


def pad(n: int, shards: int) -> int:
    return -(-n // (64 * shards)) * 64 * shards


def block(tp: int) -> int:
    # At tp=4 qkv's bias is 3C/4 = 96 elements, which the runtime aligns to 128.
    return SPLIT // tp + WHOLE + (32 if tp == 4 else 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_params_divide_by_tp_times_shard_and_replicated_ones_by_shard(tp):
    dp = 2
    p = plan(CFG, world=dp * tp, tp=tp, device="cpu")
    assert p.spec.dp == dp and p.spec.micro_batch == 1
    # DDP: every rank holds its tp part of every block, and the whole root.
    assert p["ddp"].device.params == FP32 * (L * block(tp) + ROOT)
    # ZeRO-3: each unit's tp-local buffer, padded, then split over the dp ranks.
    shard = L * pad(block(tp), dp) // dp + pad(ROOT, dp) // dp
    z3 = p["zero3"].device
    assert z3.params == z3.grads == FP32 * shard
    assert z3.master == 0 and z3.optimizer == pytest.approx(2 * FP32 * shard, abs=256)  # exp_avg, exp_avg_sq


def test_the_split_follows_the_runtimes_column_and_row_layers():
    split = TensorParallel(tp=2)
    assert split.split_dim("blocks.0.attn.qkv.weight", 2) == 0 and split.split_dim("blocks.0.attn.qkv.bias", 1) == 0
    assert split.split_dim("blocks.0.mlp.fc.bias", 1) == 0
    assert split.split_dim("blocks.0.attn.proj.weight", 2) == 1 and split.split_dim("blocks.0.mlp.proj.weight", 2) == 1
    assert split.split_dim("blocks.0.attn.proj.bias", 1) is None  # added once, after the all-reduce
    for whole in ("blocks.0.ln1.weight", "tok_emb.weight", "pos_emb.weight", "norm_f.bias"):
        assert split.split_dim(whole, 2) is None


@pytest.mark.parametrize("sp", [False, True])
def test_activations_per_rank_under_tp_and_sequence_parallel(sp):
    tp, tokens, c = 2, 64, FP32  # one sequence of 64 tokens per data-parallel rank
    p = plan(CFG, world=2 * tp, tp=tp, seq=64, sequence_parallel=sp, device="cpu")
    acts = p.activations
    assert acts is not None
    # Whole on every tp rank: block input and residual (2C) and the norms' stats, split along the
    # sequence by SP; ln1's and ln2's outputs (2C), whole either way (the column-wise linears keep
    # them, all-gathered under SP); split: qkv (3C), attention output (C), fc and GELU outputs
    # (4C each), SDPA's log-sum-exp.
    stream = 2 * C * c + 4 * c
    split = 12 * C * c // tp + 4 * HEADS // tp
    assert acts.per_layer == tokens * ((stream // tp if sp else stream) + 2 * C * c + split)
    single = plan(CFG, world=2, seq=64, device="cpu").activations
    assert single is not None and single.per_layer == tokens * (16 * C * c + 4 * c + 4 * HEADS)
    assert acts.root == single.root  # embeddings and head are not split


@pytest.mark.parametrize("sp", [False, True])
def test_tp_communication_per_layer(sp):
    tp, tokens = 2, 64
    p = plan(CFG, world=2 * tp, tp=tp, seq=64, sequence_parallel=sp, device="cpu")
    tp_ops = [c for c in p["zero2"].collectives if c.group == "tp"]
    buffer = tokens * C * FP32
    # Two per layer in forward (after each row-wise linear), two in backward, per micro-step.
    count = {c.op: c.count for c in tp_ops if c.buffer_bytes == buffer}
    assert count == ({"all_gather": 2 * 2 * L + 2, "reduce_scatter": 2 * 2 * L} if sp else {"all_reduce": 2 * 2 * L})
    assert all(c.size == tp for c in tp_ops)
    if not sp:
        # A ring all-reduce sends 2(n-1)/n of the buffer; an all-gather plus a reduce-scatter the same.
        assert sum(c.wire_bytes for c in tp_ops) == 2 * (tp - 1) * buffer // tp * 2 * 2 * L
    else:
        # The stream is gathered after the last block (and its grad before the first); the norms'
        # weights and biases (4 vectors of C per layer) all-reduce their partial grads.
        norms = next(c for c in tp_ops if c.buffer_bytes != buffer)
        assert (norms.op, norms.buffer_bytes, norms.count) == ("all_reduce", C * FP32, 4 * L)
    ckpt = plan(CFG, world=2 * tp, tp=tp, seq=64, checkpointing="sqrt", device="cpu")
    rebuilt = [c for c in ckpt["zero2"].collectives if c.group == "tp"]
    # Each rebuilt block runs its forward's two again, but for the segment's last one: torch's checkpoint
    # stops once what backward needs is back, and the last row-wise output is saved by nothing.
    assert ckpt.activations is not None and len(ckpt.activations.segments) == 1  # sqrt of 2 blocks: one segment
    assert rebuilt[0].count == 2 * (2 * L + L) - 1
    every = plan(CFG, world=2 * tp, tp=tp, seq=64, checkpointing="all", device="cpu")
    assert [c for c in every["zero2"].collectives if c.group == "tp"][0].count == 2 * (2 * L + L) - L


def test_zero_collectives_run_over_the_data_parallel_ranks():
    p = plan(CFG, world=8, tp=2, device="cpu")
    rs = next(c for c in p["zero3"].collectives if c.op == "reduce_scatter")
    assert rs.size == 4 and rs.buffer_bytes == FP32 * (L * pad(block(2), 4) + pad(ROOT, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=6, tp=3), "tp=3 does not divide n_head"),
    (dict(world=6, tp=4), "tp=4 does not divide world size 6"),
    (dict(world=2, tp=1, sequence_parallel=True), "needs tp > 1"),
])
def test_bad_tp_names_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan(CFG, **kwargs)


def test_recommender_proposes_tp_when_a_layer_does_not_fit_even_at_zero3():
    big = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=32, n_embd=8192)
    base = plan(big, world=8, batch=8, seq=128)
    assert layer_floor(base) > 20e9  # a block's gathered params and grad buffers, whatever the ranks
    rec = recommend(big, world=8, batch=8, seq=128, device_mem="20GB")
    assert rec.fits and rec.tp == 2 and "tensor parallelism" in rec.reason
    assert rec.plan.spec.tp == 2 and rec.plan[rec.layout].device.total <= 20e9
    assert recommend(big, world=8, batch=8, seq=128, device_mem="80GB").tp == 1  # fits without

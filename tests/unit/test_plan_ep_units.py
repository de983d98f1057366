"""The planner and the step simulator under expert parallelism: the ep all-to-alls they count,
how a routing skew moves them, and the expert groups' collectives on their own ranks."""

from __future__ import annotations

import pytest

from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan
from zeroshard.tools.sim.hardware import load_hardware
from zeroshard.tools.sim.step import Layout, simulate
from zeroshard.tools.sim.workload import Workload, gpt_shape

CFG = GPTConfig.named("tiny-moe", n_layer=2, vocab_size=64, seq_len=32)
WORLD, BATCH, SEQ, ACCUM = 8, 32, 32, 2


def _ep_bytes(layout) -> int:
    return sum(c.buffer_bytes * c.count for c in layout.collectives if c.group == "ep")


def test_all_to_all_bytes_are_tokens_times_top_k_times_hidden():
    """Per MoE layer call: the counts (E int64), then forward and backward the rows sent and the
    rows received, tokens x top_k of them each, as the ledger counts them (what a rank sends)."""
    p = plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, accum=ACCUM, ep=2)
    tokens = BATCH // (WORLD * ACCUM) * SEQ
    per_call = CFG.n_expert * 8 + 4 * tokens * CFG.expert_top_k * CFG.n_embd * 4
    for name in ("ddp", "zero1", "zero2", "zero3"):
        assert _ep_bytes(p[name]) == CFG.n_layer * ACCUM * per_call
    assert all(c.size == 2 for c in p["zero3"].collectives if c.group == "ep")
    assert _ep_bytes(plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, accum=ACCUM)["zero3"]) == 0


def test_a_routing_skew_grows_what_the_busiest_rank_receives():
    base = plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, ep=4)["zero3"]
    skewed = plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, ep=4, routing_skew=1.0)["zero3"]
    rows = BATCH // WORLD * SEQ * CFG.expert_top_k * CFG.n_embd * 4  # one exchange of a rank's own rows
    # received rows double: +1 exchange's worth forward (combine) and backward (dispatch's grads)
    assert _ep_bytes(skewed) - _ep_bytes(base) == 2 * CFG.n_layer * rows
    assert skewed.experts["all_to_all_buffers"] - base.experts["all_to_all_buffers"] == 2 * rows
    assert skewed.device.activations > base.device.activations


def test_the_expert_groups_reduce_over_the_ranks_holding_them():
    p = plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, ep=2)
    edp = [c for c in p["zero3"].collectives if c.group == "edp"]
    assert edp and {c.size for c in edp} == {WORLD // 2}
    assert {c.op for c in edp} == {"all_gather", "reduce_scatter"}
    shard = [c for c in p["zero3"].collectives if c.group == "shard"]
    assert {c.size for c in shard} == {WORLD}
    # stage 0 all-reduces the expert grads over the ranks holding the same experts
    assert {(c.op, c.size) for c in p["ddp"].collectives if c.group == "edp"} == {("all_reduce", WORLD // 2)}


@pytest.mark.parametrize("skew", [0.0, 0.5])
def test_the_simulator_moves_the_planners_all_to_all_bytes(skew):
    w = Workload(shape=gpt_shape(CFG, "tiny-moe"), micro_batch=BATCH // (WORLD * ACCUM), seq=SEQ, accum=ACCUM,
                 compute_bytes=4, routing_skew=skew)
    hw = load_hardware("h100")
    for stage in (1, 3):
        got = simulate(w, hw, Layout.of(world=WORLD, stage=stage, ep=2, param_bytes=4))
        planned = plan(CFG, world=WORLD, batch=BATCH, seq=SEQ, accum=ACCUM, ep=2, routing_skew=skew)[f"zero{stage}"]
        assert got.ep_bytes == _ep_bytes(planned)
        assert got.breakdown["all-to-all (ep)"] > 0


def test_ep_on_the_critical_path_costs_step_time_and_skew_more():
    w = Workload(shape=gpt_shape(CFG, "tiny-moe"), micro_batch=4, seq=SEQ)
    hw = load_hardware("h100")
    without = simulate(w, hw, Layout.of(world=WORLD, stage=3))
    with_ep = simulate(w, hw, Layout.of(world=WORLD, stage=3, ep=4))
    skewed = simulate(Workload(shape=w.shape, micro_batch=4, seq=SEQ, routing_skew=1.0), hw,
                      Layout.of(world=WORLD, stage=3, ep=4))
    assert with_ep.breakdown["all-to-all (ep)"] > 0 and "all-to-all (ep)" not in without.breakdown
    assert skewed.step_s > with_ep.step_s and skewed.compute_s > with_ep.compute_s


def test_the_simulator_refuses_an_ep_misaligned_with_tp_in_one_line():
    with pytest.raises(ValueError, match="ep=3 with tp=2: an ep group must hold whole tp groups") as err:
        Layout.of(world=6, stage=3, ep=3, tp=2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="tiny", ep=2), "needs a mixture-of-experts model"),
    (dict(model="tiny-moe", ep=8), "does not divide the 4 experts"),
    (dict(model="tiny-moe", ep=2, tp=2, sequence_parallel=True), "sequence parallelism with an MoE model"),
    (dict(model=7e9, ep=2), "not a bare parameter count"),
    (dict(model="tiny-moe", routing_skew=0.5), "it needs ep > 1"),
    (dict(model="tiny-moe", ep=2, routing_skew=-1.0), "routing_skew is the busiest"),
])
def test_bad_ep_is_one_line(kwargs, message):
    model = kwargs.pop("model")
    with pytest.raises(ValueError, match=message) as err:
        plan(model, world=8, **kwargs)
    assert "\n" not in str(err.value)


# -- the recommender: EP against ZeRO-3 ------------------------------------------------------------
WIDE = GPTConfig.named("tiny-moe", n_embd=256, n_head=4, n_layer=4, vocab_size=512, seq_len=64)


def _rec(mem: str, **kwargs):
    from zeroshard.tools.planner.recommend import recommend
    from zeroshard.tools.sim.hardware import PRESETS

    return recommend(WIDE, device_mem=mem, world=8, batch=16, seq=64, hw=PRESETS["h100"], **kwargs)


def test_the_recommender_weighs_ep_against_zero3_with_a_row_for_each():
    """ZeRO-3 without ep gathers every expert of a layer; with ep a rank gathers its block over
    fewer ranks, so the ep rows need less memory, and the recommender takes them at their price."""
    zero3 = plan(WIDE, world=8, batch=16, seq=64)["zero3"].device.total
    rec = _rec(f"{zero3 * 0.9:.0f}")  # ZeRO-3 without ep does not fit
    rows = {c.ep: c for c in rec.expert_rows}
    assert set(rows) == {1, 2, 4}  # every ep dividing the 4 experts (and the 8 ranks, in a node)
    assert all(c.layout == "zero3" for c in rows.values())
    assert rows[1].total_bytes == zero3 and not rows[1].fits
    for ep, row in rows.items():
        planned = plan(WIDE, world=8, batch=16, seq=64, ep=ep)["zero3"]
        assert row.total_bytes == planned.device.total and row.comm_seconds > 0
    assert rows[4].total_bytes < rows[2].total_bytes < rows[1].total_bytes
    assert rec.fits and rec.ep > 1 and rec.plan.spec.ep == rec.ep
    assert "EP against ZeRO-3" in rec.reason and "with ep" in rec.reason
    assert rec.to_dict()["expert_rows"][0]["ep"] == 1


def test_a_dense_model_gets_no_ep_rows():
    from zeroshard.tools.planner.recommend import recommend

    rec = recommend("tiny", device_mem="1GB", world=8, batch=16, seq=64)
    assert rec.expert_rows == () and rec.ep == 1


def test_an_asked_ep_is_weighed_against_none():
    rec = _rec("1GB", ep=2)
    assert {c.ep for c in rec.expert_rows} == {1, 2}

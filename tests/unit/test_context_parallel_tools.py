"""Context parallelism in the tools: the planner divides a rank's activations by cp and lists the cp
exchanges, the simulator times them, tune searches cp; all from the attention's own byte counts."""

from __future__ import annotations

import pytest

from zeroshard.models import GPTConfig
from zeroshard.parallel.cp.volume import layer_bytes
from zeroshard.tools.planner.api import plan
from zeroshard.tools.sim.hardware import load_hardware
from zeroshard.tools.sim.step import Layout, simulate
from zeroshard.tools.sim.workload import SHAPES, Workload
from zeroshard.tools.tune.grid import DEFAULT_AXES, candidates, parse_axes


@pytest.mark.parametrize("scheme", ["ring", "ulysses"])
def test_plan_divides_activations_by_cp_and_lists_the_exchanges(scheme):
    cfg = GPTConfig.named("tiny", seq_len=256)
    plans = {cp: plan(cfg, world=4, cp=cp, cp_attention=scheme, seq=256, batch=4 // cp, stage=3, mp="fp32",
                      device="cpu") for cp in (1, 2, 4)}
    saved = {cp: p.activations.saved for cp, p in plans.items()}  # type: ignore[union-attr]
    per_layer = {cp: p.activations.per_layer for cp, p in plans.items()}  # type: ignore[union-attr]
    # One sequence per dp group: a rank's block activations are its seq / cp tokens'.
    assert per_layer[2] * 2 == per_layer[1] and per_layer[4] * 4 == per_layer[1]
    assert saved[4] < saved[2] < saved[1]
    textbook = {cp: plan(cfg, world=4, cp=cp, cp_attention=scheme, seq=256, batch=4 // cp, stage=3, mp="fp32",
                         device="cpu", accounting="textbook") for cp in (1, 2, 4)}
    for cp, p in plans.items():
        layout = p["zero3"]
        assert layout.shard_size == 4  # ZeRO over dp x cp: every rank
        want = cfg.n_layer * layer_bytes(scheme, cp=cp, rows=1, seq=256, q_width=cfg.n_embd, kv_width=cfg.n_embd,
                                         elem=4)
        for counted in (layout, textbook[cp]["zero3"]):  # the step schedule's cp events, with or without units
            got = sum(c.buffer_bytes * c.count for c in counted.collectives if c.group == "cp")
            assert got == want and (got > 0) == (cp > 1)


def test_plan_refuses_a_sequence_the_chunks_do_not_divide():
    with pytest.raises(ValueError, match=r"^sequence length 100 does not divide into 2 x cp = 8"):
        plan("tiny", world=4, cp=4, seq=100, batch=1)


def test_simulator_times_a_cp_rank_s_share_and_its_exchange():
    hw = load_hardware("h100")
    w = Workload(shape=SHAPES["llama3-8b"], micro_batch=1, seq=131072)
    whole = simulate(w, hw, Layout.of(world=64, stage=3))
    for scheme in ("ring", "ulysses"):
        split = simulate(w, hw, Layout.of(world=64, stage=3, cp=8, cp_attention=scheme))
        exchange = split.breakdown["attention exchange (cp)"]
        assert 0 < exchange < split.compute_s
        # A rank computes 1/8 of its sequence's work; the blocks wait on the schedule's exchanges besides.
        assert split.compute_s == pytest.approx(whole.compute_s / 8, rel=1e-6)
        assert split.step_s >= split.compute_s + exchange


def test_tune_searches_cp_degrees():
    cands = candidates(parse_axes(**DEFAULT_AXES, cp_degrees="1,2"))
    assert {c.cp for c in cands} == {1, 2} and len(cands) == 2 * len(candidates(parse_axes(**DEFAULT_AXES)))
    assert cands[-1].train_keys()["cp"] == 2
    with pytest.raises(ValueError, match=r"^--cp-degrees: 'x' is not a context-parallel degree"):
        parse_axes(**DEFAULT_AXES, cp_degrees="x")

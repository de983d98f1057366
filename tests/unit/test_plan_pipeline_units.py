"""The pipeline planner without a run: torch's schedules decide what is in flight, the stages are
the runtime's split, the bubble is (p - 1) / (v·m + p - 1), and bad pipelines fail in one line."""

from __future__ import annotations

import json

import pytest

import zeroshard as zs

from zeroshard.cli.main import main
from zeroshard.trainer.config import field_help
from zeroshard.models import GPT, GPTConfig
from zeroshard.parallel.pipeline.order import bubble_fraction, schedule_order
from zeroshard.tools.planner import plan
from zeroshard.tools.planner.pipeline import plan_pipeline


def test_1f1b_holds_pp_minus_rank_microbatches_and_gpipe_all_of_them():
    ones = plan_pipeline("tiny", world=4, pp=4, microbatches=8, batch=32, seq=16, device="cpu")
    assert [r.in_flight[r.pp_rank] for r in ones.ranks] == [4, 3, 2, 1]
    gpipe = plan_pipeline("tiny", world=4, pp=4, pp_schedule="gpipe", microbatches=8, batch=32, seq=16, device="cpu")
    assert [r.in_flight[r.pp_rank] for r in gpipe.ranks] == [8, 8, 8, 8]
    # Same blocks' width on the middle stages: more in flight is more memory.
    assert gpipe.ranks[1].plan["ddp"].device.allocated > ones.ranks[1].plan["ddp"].device.allocated


def test_interleaved_order_is_torchs_and_holds_more_microbatches_of_smaller_stages():
    order = schedule_order("interleaved-1f1b", pp=2, stages_per_rank=2, microbatches=4)
    assert {a.stage for a in order[0]} == {0, 2} and {a.stage for a in order[1]} == {1, 3}
    assert sum(a.kind == "F" for a in order[0]) == sum(a.kind == "B" for a in order[0]) == 2 * 4
    p = plan_pipeline("tiny", world=2, pp=2, pp_schedule="interleaved-1f1b", microbatches=4, batch=4, seq=16,
                      device="cpu")
    assert p.ranks[0].stages == (0, 2) and p.ranks[0].blocks == ((0,), (2,))
    assert sum(p.ranks[0].in_flight.values()) > 2


def test_zero_bubble_keeps_a_microbatch_in_flight_until_its_weight_half():
    order = schedule_order("interleaved-zero-bubble", pp=2, stages_per_rank=2, microbatches=4)
    assert sum(a.kind == "F" for a in order[0]) == sum(a.kind == "W" for a in order[0]) == 2 * 4
    zb = plan_pipeline("tiny", world=2, pp=2, pp_schedule="interleaved-zero-bubble", microbatches=4, batch=4, seq=16,
                       device="cpu")
    inter = plan_pipeline("tiny", world=2, pp=2, pp_schedule="interleaved-1f1b", microbatches=4, batch=4, seq=16,
                          device="cpu")
    assert zb.ranks[0].stages == inter.ranks[0].stages == (0, 2)
    assert all(sum(r.in_flight.values()) >= 1 for r in zb.ranks)
    assert zb.bubble < inter.bubble == pytest.approx(bubble_fraction(pp=2, microbatches=4, stages_per_rank=2))
    assert "replayed from torch's order" in zb.notes[0]
    from zeroshard.tools.planner.measure_pipeline import measure

    with pytest.raises(ValueError, match="MemTracker, whose module hooks fail") as refused:
        measure(zb, (3,), name="tiny")  # refused before any rank starts
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("pp,m,v", [(2, 2, 1), (4, 8, 1), (4, 8, 2)])
def test_bubble_fraction(pp, m, v):
    assert bubble_fraction(pp=pp, microbatches=m, stages_per_rank=v) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_stage_model_states_add_up_to_the_model_with_the_tied_copy():
    """DDP inside each stage holds that stage's params in full: summed over the pp ranks, every
    param of the model once plus the last stage's copy of the tied embedding."""
    cfg = GPTConfig.named("tiny", seq_len=16)
    p = plan_pipeline(cfg, world=4, pp=2, batch=4, seq=16, device="cpu")
    whole = sum(t.numel() for t in GPT(cfg).parameters())  # the tied weight once
    tied = cfg.vocab_size * cfg.n_embd
    assert sum(r.plan.params for r in p.ranks) == whole + tied
    flat = plan(cfg, world=2, batch=4, seq=16, device="cpu")
    # Stage 0 shards nothing: a stage's param bytes are its own params', and together more than half
    # the unpipelined model's each (the tied copy), less than all of it.
    per_rank = [r.plan["ddp"].device.params for r in p.ranks]
    assert all(flat["ddp"].device.params / 2 < b < flat["ddp"].device.params for b in per_rank)


@pytest.mark.parametrize("kwargs,message", [
    (dict(pp=3), "3 pipeline stages do not divide the model's 4 blocks"),
    (dict(pp=2, microbatches=1), "needs at least pp=2 microbatches"),
    (dict(pp=2, microbatches=4, batch=6), "does not split each data-parallel rank's batch"),
    (dict(pp=2, pp_schedule="zb"), "pp_schedule='zb' is not a schedule"),
])
def test_bad_pipelines_fail_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_pipeline("tiny", world=kwargs.pop("world", 6 if kwargs.get("pp") == 3 else 4), seq=16,
                      device="cpu", **kwargs)


def test_plan_cli_takes_trainconfigs_pp_flags(capsys):
    assert main(["plan", "--model", "tiny", "--world", "4", "--pp", "2", "--microbatches", "4", "--batch", "8",
                 "--seq", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pipeline"] == {"pp": 2, "pp_schedule": "1f1b", "microbatches": 4, "pp_stages_per_rank": 1,
                               "bubble_fraction": pytest.approx(1 / 5)}
    assert [r["stages"] for r in out["ranks"]] == [[0], [1]]
    with pytest.raises(SystemExit):
        main(["plan", "memory", "--help"])
    help_text = capsys.readouterr().out
    assert " ".join(field_help("microbatches").split()[:4]) in " ".join(help_text.split())


def test_plan_cli_refuses_what_it_does_not_plan_with_pp(capsys):
    assert main(["plan", "--model", "tiny", "--world", "4", "--pp", "2", "--plot", "out.png"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zeroshard plan: error: ") and "--plot" in err and "\n" not in err


def test_checkpointing_plans_each_stage_over_its_own_blocks():
    """Each stage's engine checkpoints its own blocks: a microbatch in flight keeps its segments'
    inputs only, so every pp rank's planned activations fall; the zero-bubble schedule refuses it
    as the runtime does."""
    kw = dict(world=4, pp=2, microbatches=2, batch=8, seq=32, device="cpu")
    plain, checkpointed = plan_pipeline("tiny", **kw), plan_pipeline("tiny", checkpointing="all", **kw)
    for a, b in zip(plain.ranks, checkpointed.ranks):
        assert 0 < b.activation_bytes < a.activation_bytes
    with pytest.raises(ValueError, match="not composed with the interleaved-zero-bubble schedule"):
        plan_pipeline("tiny", checkpointing="all", pp_schedule="interleaved-zero-bubble", **kw)


def test_offload_plans_each_stage_as_zs_plan_does():
    """offload="cpu" under pp: each stage is zs.plan's model, so its offload rows are zs.plan's
    (masters and optimizer state in host memory, off the device total)."""
    kw = dict(world=4, pp=2, microbatches=2, batch=8, seq=32, device="cpu")
    offloaded = plan_pipeline("tiny", offload="cpu", **kw)
    with zs.meta_init():
        flat = plan(GPT(GPTConfig.named("tiny")), world=2, batch=8, seq=32, device="cpu", offload="cpu")
    for rank in offloaded.ranks:
        layouts = rank.plan.layouts
        assert list(layouts) == list(flat.layouts)
        for name in ("zero1", "zero2", "zero3"):
            assert layouts[f"{name}_offload"].device.total < layouts[name].device.total
            assert layouts[f"{name}_offload"].host_bytes > 0 == layouts[name].host_bytes

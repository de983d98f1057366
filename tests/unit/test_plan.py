"""The memory planner without a second rank: arithmetic, layouts, probes, recommender, CLI."""

from __future__ import annotations

import json

import pytest

from zeroshard.runtime.clip import SQUARE_CHUNK
import torch
from torch import nn

from zeroshard.cli.main import main as cli
from zeroshard.models import GPT, GPTConfig
from zeroshard.tools.planner import COMPONENTS, plan, probe
from zeroshard.tools.planner.activations import gpt_activations
from zeroshard.tools.planner.inventory import Inventory
from zeroshard.tools.planner.recommend import recommend
from zeroshard.tools.planner.spec import Checkpointing, parse_bytes, parse_count
from zeroshard.runtime.engine import MAX_INFLIGHT_REDUCTIONS
from zeroshard.runtime.layout import FlatLayout

LAYOUTS = ("ddp", "zero1", "zero2", "zero3")
GB = 10**9


# -- the ZeRO paper's table ----------------------------------------------------------------------
def test_7b_on_8_ranks_reproduces_the_zero_paper_table():
    p = plan(7e9, world=8)
    states = {name: p[name].device.model_states for name in LAYOUTS}
    assert states == {"ddp": 112 * GB, "zero1": 38.5 * GB, "zero2": 26.25 * GB, "zero3": 14 * GB}
    assert p.mode == "analytic" and p.spec.accounting == "textbook"


def test_cli_json_has_component_and_total_keys(capsys):
    assert cli(["plan", "--params", "7e9", "--world", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in LAYOUTS:
        layout = out["layouts"][name]
        for comp in COMPONENTS:
            assert isinstance(layout[f"{comp}_bytes"], int)
        # Components are each at their own peak; overlap is what they over-count together.
        assert layout["total_bytes"] == sum(layout[f"{c}_bytes"] for c in COMPONENTS) - layout["overlap_bytes"]
    assert out["layouts"]["zero3"]["model_states_bytes"] == 14 * GB


def test_cli_table_prints_every_stage(capsys):
    assert cli(["plan", "--params", "7e9", "--world", "8"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in LAYOUTS)
    assert "112.00" in text and "38.50" in text and "26.25" in text and "14.00" in text


# -- optimizer state is discovered, not assumed -----------------------------------------------------
def test_optimizer_probe_reads_real_state():
    assert probe(torch.optim.AdamW, torch.float32).per_element == 8
    assert probe(torch.optim.AdamW, torch.bfloat16).per_element == 4  # bf16 moments, no master
    assert probe(torch.optim.SGD, torch.float32).per_element == 0
    assert probe(torch.optim.SGD, torch.float32, {"momentum": 0.9}).per_element == 4
    assert probe(torch.optim.AdamW, torch.float32).per_tensor == 4  # the fp32 step counter


def test_sgd_plan_has_no_optimizer_state():
    p = plan(7e9, world=8, optimizer="sgd")
    assert all(p[n].device.optimizer == 0 for n in LAYOUTS)
    assert p["ddp"].device.model_states == 7e9 * (2 + 2 + 4)


# -- runtime accounting follows the layout the runtime builds ---------------------------------------
def _padded(stage: int, world: int) -> tuple[int, int]:
    inv = Inventory(GPT(GPTConfig.named("tiny")), name="tiny")
    units = inv.comm_units(stage=stage, shards=world if stage else 1, bucket_bytes=int(25 * 2**20))
    groups = [g for u in units for g in u.groups]
    return sum(g.numel for g in groups), sum(g.shard_numel for g in groups)


def test_runtime_model_states_match_the_memory_contract():
    # docs/runtime.md: fp32 params and AdamW. tiny's dims are multiples of 64: no slot padding.
    p = plan("tiny", world=2, seq=64)
    for stage, name in enumerate(LAYOUTS):
        P, S = _padded(stage, 2)
        expected = {0: 16 * P, 1: 8 * P + 12 * S, 2: 4 * P + 12 * S, 3: 16 * S}[stage]
        segments_step = p[name].device.optimizer - 8 * (S if stage else P)
        assert 0 <= segments_step <= 4 * 64, name  # one 4-byte step counter per optimizer segment
        assert p[name].device.model_states - segments_step == expected, name


def test_bf16_params_add_a_separate_fp32_master():
    p = plan("tiny", world=2, mp="bf16", seq=64)
    for stage, name in enumerate(LAYOUTS):
        P, S = _padded(stage, 2)
        d = p[name].device
        assert d.master == 4 * (S if stage else P), name
        assert d.params == (2 * P if stage < 3 else 0), name  # stage 3 keeps only the fp32 master shard


class Odd(nn.Module):
    """Params whose sizes are not multiples of 64, a frozen layer, and a weight tied in two places."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 7)      # 70 + 7
        self.b = nn.Linear(7, 3)       # 21 + 3
        self.frozen = nn.Linear(5, 5)  # 25 + 5, frozen
        self.frozen.requires_grad_(False)
        self.tied = nn.Linear(10, 7, bias=False)
        self.tied.weight = self.a.weight  # the same Parameter in two places


def test_padding_frozen_and_tied_params_are_counted_like_the_runtime():
    p = plan(Odd(), world=2, seq=8, device="cpu")
    assert p.model.tied == 1 and p.model.frozen == 30
    assert p.params == 77 + 24 + 30  # the tied weight once
    ddp = p["ddp"].device
    # At stage 0 everything is one bucket: each param starts on a 64-element boundary, so a.weight
    # (70 elements) takes 128 and each small one 64.
    trainable = FlatLayout([(str(i), torch.Size([n])) for i, n in enumerate((70, 7, 21, 3))], 1).numel
    frozen = FlatLayout([("w", torch.Size([25])), ("b", torch.Size([5]))], 1).numel
    assert (trainable, frozen) == (320, 128)
    assert ddp.params == 4 * (trainable + frozen)
    assert ddp.grads == 4 * trainable  # frozen params have no grads...
    # ...and no optimizer state; the buffer holds the decaying matrices first ([b.w, a.w], then
    # [b.b, a.b]), so it makes 2 decay/no-decay segments, each with AdamW's 4-byte step counter.
    assert ddp.optimizer == 8 * trainable + 2 * 4
    assert p.activations is None and any("activations not estimated" in n for n in p.notes)  # it has no forward


def test_model_mode_builds_on_meta_and_allocates_nothing():
    from zeroshard.tools.planner.api import _resolve_model

    model, name, cfg, seq = _resolve_model("medium", 512)
    assert all(t.is_meta for t in model.parameters())
    assert (name, seq) == ("medium", 512)
    p = plan("medium", world=4, batch=8, seq=512)
    assert p.model.name == "medium" and p.activations.saved > 0


def test_tied_embedding_counted_once():
    cfg = GPTConfig.named("small", seq_len=128)
    p = plan(cfg, world=1)
    with torch.device("meta"):
        assert p.params == GPT(cfg).num_params()
    assert p.model.tied == 1


# -- grads in flight during backward -----------------------------------------------------------------
def _units(cfg_name: str, stage: int, world: int):
    inv = Inventory(GPT(GPTConfig.named(cfg_name, seq_len=128)), name=cfg_name)
    return inv.comm_units(stage=stage, shards=world, bucket_bytes=int(25 * 2**20))


@pytest.mark.parametrize("mp, c, r", [("fp32", 4, 4), ("bf16", 2, 4)])
def test_stage23_buckets_are_a_units_collection_next_to_the_ones_still_reducing(mp, c, r):
    """At its last grad a unit's per-param grads (compute dtype) are copied into a fresh flat buffer
    (reduce dtype) while the flat buffers of the units before it may still be reducing: the engine
    waits on the oldest only when one more launches than max_inflight_reductions."""
    k = MAX_INFLIGHT_REDUCTIONS
    for stage, name in ((2, "zero2"), (3, "zero3")):
        units = _units("small", stage, 2)
        per_param = [sum(g.layout.param_numel for g in u.groups if g.trainable) * c for u in units]
        flat = [sum(g.numel for g in u.groups if g.trainable) * r for u in units]
        expected = max(sum(flat[max(0, i - k):i]) + per_param[i] + flat[i] for i in range(len(units)))
        p = plan("small", world=2, batch=2, seq=128, mp=mp, device="cuda")
        assert p[name].device.buckets == expected, name
        if c == r:
            # gloo reduces grads already in the reduce dtype where they lie: no flat buffer, so a
            # unit holds only its per-param grads while it reduces.
            expected = max(sum(per_param[max(0, i - k):i + 1]) for i in range(len(units)))
        p = plan("small", world=2, batch=2, seq=128, mp=mp, device="cpu")
        assert p[name].device.buckets == expected, name


def test_stage01_have_nothing_in_flight_unless_the_reduction_casts():
    p = plan("small", world=2, batch=2, seq=128, device="cpu")
    assert p["ddp"].device.buckets == p["zero1"].device.buckets == 0
    # bf16 grads reduce-scattered in fp32: a cast per bucket, which the engine does not cap at stage 1.
    p = plan("small", world=2, batch=2, seq=128, mp="bf16", device="cpu")
    assert p["zero1"].device.buckets == sum(g.numel * 4 for u in _units("small", 1, 2) for g in u.groups)


def test_stage3_peak_is_a_units_collection_with_the_activations_still_saved():
    """zero3's peak is mid-backward: the last-but-one block's collection, when the blocks behind it
    still hold activations and gathered params, not backward's start or end. (On NCCL, where a unit's
    grads are collected into a flat buffer; gloo reduces them in place, see the test above.)"""
    p = plan("small", world=2, batch=2, seq=128, device="cuda")
    d, act = p["zero3"].device, p.activations
    units = _units("small", 3, 2)
    block = sum(g.numel for g in units[0].groups) * 4
    root = sum(g.numel for g in units[-1].groups) * 4
    shards = d.grads
    # blocks.1 completes: the flat buffers of the blocks before it still reduce; blocks.0 and the root
    # still hold their activations, blocks.1, blocks.0 (prefetched) and the root are gathered, and
    # only the shards of blocks.1, blocks.0 and the root are still to come.
    to_come = 2 * (block // 2) + root // 2
    moment = d.params + d.master + d.optimizer + shards - to_come + act.per_layer + act.root \
        + (2 * block + root) + (MAX_INFLIGHT_REDUCTIONS + 2) * block
    assert d.allocated == moment


def test_cpu_optimizer_scratch_is_two_temporaries_and_the_previous_denominator():
    """torch's per-tensor Adam(W) loop: sqrt and the divided denominator of this segment, while the
    previous segment's denominator is still bound to the loop variable."""
    p = plan("small", world=2, batch=2, seq=128, device="cpu")
    mlp = 2048 * 512 * 4  # fc.weight and the MLP projection: consecutive decaying segments
    assert p["zero1"].device.workspace >= 3 * mlp
    states = p["zero1"].device.model_states
    # Before the loop, clipping's global grad norm (train's default clip) squares one float64 chunk of
    # SQUARE_CHUNK elements at a time: 32 MiB, more than the loop's three temporaries.
    assert p.spec.clip == 1.0 and p["zero1"].device.allocated == states + max(3 * mlp, 8 * SQUARE_CHUNK)
    # A run that does not clip makes no such chunk (the non-finite guard reads fp32 buffer norms).
    unclipped = plan("small", world=2, batch=2, seq=128, device="cpu", clip=0.0)
    assert unclipped["zero1"].device.allocated == states + 3 * mlp


# -- activations (not divided by ZeRO) ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_activation_formula_is_exact_against_saved_tensors(dtype):
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=256, seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved.setdefault(st.data_ptr(), st.nbytes())
        return t

    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    est = gpt_activations(cfg, micro_batch=2, seq=64, compute_bytes=torch.empty(0, dtype=dtype).element_size(),
                          policy=Checkpointing.parse("none"))
    assert est.saved == sum(saved.values())


def test_zero_does_not_divide_activations():
    p = plan("small", world=8, batch=64, seq=256)
    acts = {p[n].device.activations for n in LAYOUTS}
    assert len(acts) == 1 and acts.pop() > 0


def test_checkpointing_policies_shrink_activations_in_order():
    cfg = GPTConfig.named("medium")
    sizes = {}
    for policy in ("none", "every:3", "every:2", "all", "sqrt"):
        sizes[policy] = gpt_activations(cfg, micro_batch=4, seq=512, compute_bytes=2,
                                        policy=Checkpointing.parse(policy)).total
    assert sizes["none"] > sizes["every:3"] > sizes["every:2"] > sizes["all"]
    assert sizes["sqrt"] < sizes["none"] / 2
    same = gpt_activations(cfg, micro_batch=4, seq=512, compute_bytes=2, policy=Checkpointing.parse("every:1"))
    assert same.total == sizes["all"]
    with pytest.raises(ValueError, match="every:K"):
        Checkpointing.parse("half")


# -- variants, validation -------------------------------------------------------------------------
def test_hybrid_and_offload_variants_appear_when_asked():
    p = plan("small", world=8, shard_size=4, offload="cpu")
    assert {"zero1_hybrid", "zero2_hybrid", "zero3_hybrid", "ddp_offload", "zero3_offload"} <= set(p.layouts)
    assert p["zero3_hybrid"].device.optimizer > p["zero3"].device.optimizer  # sharded over 4, not 8
    off = p["zero3_offload"]
    assert off.offload == "cpu" and off.device.optimizer == 0 and off.device.master == 0
    # zs.shard(offload="cpu") at stage 3: the fp32 shard lives on the host, so no param stays on the device.
    assert off.device.params == 0 and off.host["master"] == p["zero3"].device.params
    assert off.host["optimizer"] == p["zero3"].device.optimizer and off.host["grads"] == p["zero3"].device.grads
    assert off.host_bytes == sum(off.host.values())
    with pytest.raises(ValueError, match="offload must be 'none', 'cpu' or 'disk'"):
        plan("small", world=8, offload="optimizer")  # the runtime's kinds, nothing else


def test_stage3_communicates_about_one_and_a_half_times_ddp():
    p = plan("small", world=8)
    ratio = p["zero3"].comm_bytes / p["ddp"].comm_bytes
    assert 1.4 < ratio <= 1.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=4, batch=6), "does not split"),
    (dict(world=4, shard_size=3), "does not divide"),
    (dict(world=4, optimizer="nonesuch"), "not a torch.optim optimizer"),
    (dict(world=4, prefetch=-1), "prefetch"),
    (dict(world=0), "world"),
])
def test_bad_inputs_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan("tiny", **kwargs)


def test_parsers():
    assert parse_bytes("80GB") == 80 * GB and parse_bytes("1GiB") == 2**30 and parse_bytes("80") == 80 * GB
    assert parse_count("7e9") == parse_count("7B") == 7 * GB and parse_count("350M") == 350 * 10**6
    with pytest.raises(ValueError, match="80GB"):
        parse_bytes("eighty")
    with pytest.raises(ValueError, match="runtime accounting needs"):
        plan(7e9, world=8, accounting="runtime")


# -- recommender: the cheapest layout that fits, not the highest stage ----------------------------
def test_recommender_picks_zero2_over_zero3_when_it_fits():
    rec = recommend(7e9, world=8, device_mem="34GB")
    assert rec.layout == "zero2" and rec.checkpointing == "none"
    assert rec.reason.startswith("ZeRO-2 fits with") and "ZeRO-3 would add 50% more communication" in rec.reason


def test_recommender_never_raises_the_stage_without_need():
    rec = recommend("small", world=8, batch=8, seq=256, device_mem="80GB")
    assert rec.layout == "ddp"


def test_recommender_prefers_checkpointing_when_activations_dominate():
    rec = recommend("medium", world=8, batch=64, seq=512, device_mem="4GB")
    assert rec.plan["zero3"].device.total <= 4 * GB  # ZeRO-3 alone would fit...
    assert rec.layout == "ddp" and rec.checkpointing == "sqrt"  # ...but recompute is the cheaper fix
    assert rec.reason.startswith("activations dominate") and "before raising the stage" in rec.reason


def test_recommender_says_when_nothing_fits_without_offload():
    rec = recommend(7e9, world=2, device_mem="40GB")
    assert rec.offload == "cpu" and rec.layout.endswith("_offload")
    assert rec.reason.startswith("nothing fits in 40.0 GB on the device")


def test_recommender_says_how_many_ranks_when_nothing_fits_at_all():
    rec = recommend(7e9, world=2, device_mem="5GB")
    assert rec.layout is None and not rec.fits
    assert rec.reason.endswith("ZeRO-3 would fit from 32 ranks")


def test_recommender_shards_inside_nodes_on_a_slow_network():
    from zeroshard.tools.sim.hardware import PRESETS, with_links

    hw = with_links(PRESETS["h100"], intra_gbps=2400, inter_gbps=100, gpus_per_node=8)
    rec = recommend(7e9, world=32, device_mem="20GB", hw=hw)
    assert rec.layout == "zero3_hybrid" and "intra-node" in rec.reason


# -- chart ----------------------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert cli(["plan", "--model", "small", "--world", "4", "--batch", "8", "--seq", "512",
                "--device-mem", "2GB", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "recommendation:" in capsys.readouterr().out


def test_recommender_does_not_promise_ranks_when_activations_overflow():
    rec = recommend("medium", world=2, batch=128, seq=512, device_mem="2GB")
    assert rec.layout is None and "activations dominate" in rec.reason and "more ranks will not help" in rec.reason


def test_per_tensor_optimizer_state_is_probed_on_a_matrix_and_noted():
    muon = probe(torch.optim.Muon, torch.float32)  # a vector would be refused by Muon itself
    assert muon.per_element == 4.0  # one fp32 momentum per element
    planned = plan("small", world=4, stage=3, optimizer="muon")
    assert any("owner rank" in n for n in planned.notes)

"""The analytical simulator: collective costs, the ZeRO-3 : DDP volume ratio, and a published run."""

from __future__ import annotations

import dataclasses

import pytest

from zeroshard.tools.sim.hardware import PRESETS, load_hardware
from zeroshard.tools.sim.memory import peak_bytes
from zeroshard.tools.sim.network import algorithm_seconds, bus_factor, collective_seconds, wire_bytes
from zeroshard.tools.sim.step import Layout, simulate
from zeroshard.tools.sim.workload import SHAPES, Workload

GIB = 2**30
H100 = PRESETS["h100"]


def test_bus_factor_matches_nccl_tests_definition():
    for p in (2, 8, 64):
        assert bus_factor("all_reduce", p) == pytest.approx(2 * (p - 1) / p)
        assert bus_factor("all_gather", p) == bus_factor("reduce_scatter", p) == pytest.approx((p - 1) / p)
    assert bus_factor("all_gather", 1) == 0


def test_ring_cost_is_alpha_beta():
    n, p = 1e9, 8
    alpha, bw = H100.intra_latency, H100.intra_bandwidth
    assert algorithm_seconds("all_gather", "ring", n, p, H100) == pytest.approx((p - 1) * alpha + (p - 1) / p * n / bw)
    assert algorithm_seconds("all_reduce", "ring", n, p, H100) == pytest.approx(
        2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw)
    # Across nodes the network link bounds it.
    slow = algorithm_seconds("all_gather", "ring", n, 16, H100)
    assert slow == pytest.approx(15 * H100.inter_latency + 15 / 16 * n / H100.inter_bandwidth)


def test_tree_wins_small_all_reduce_at_scale_and_ring_wins_large():
    p = 1024
    small, large = 1e4, 1e10
    assert algorithm_seconds("all_reduce", "tree", small, p, H100) < algorithm_seconds("all_reduce", "ring", small, p, H100)
    # On few ranks the ring's 2(p-1)/p bandwidth term beats the tree's 2.
    assert algorithm_seconds("all_reduce", "ring", large, 16, H100) < algorithm_seconds("all_reduce", "tree", large, 16, H100)
    best = collective_seconds("all_reduce", small, p, H100)
    assert best == algorithm_seconds("all_reduce", "tree", small, p, H100)


def _small_workload(**kw) -> Workload:
    shape = dataclasses.replace(SHAPES["llama3-8b"], n_layer=4)
    return Workload(shape=shape, micro_batch=1, seq=1024, **kw)


@pytest.mark.parametrize("world", [2, 4, 8, 16, 64, 512])
def test_zero3_moves_one_and_a_half_times_ddp(world):
    """ZeRO paper, section 7: stage 3 sends 3(n-1)/n of the params, DDP's all-reduce 2(n-1)/n."""
    # Params and grads in the same dtype; every unit resharded after forward would make it exactly
    # 1.5. The engine saves two backward gathers: the root stays gathered all step, and the last
    # block of forward stays gathered into backward (Engine.kept_for_backward); add them back.
    w = _small_workload()
    same = dict(param_bytes=2, reduce_bytes=2, bucket_mb=1e9)
    ddp = simulate(w, H100, Layout.of(world=world, stage=0, **same))
    z3 = simulate(w, H100, Layout.of(world=world, stage=3, **same))
    s = w.shape
    saved = wire_bytes("all_gather", (s.root_params + s.block_params) * 2, world)  # what the engine saves
    assert (z3.wire_bytes + saved) / ddp.wire_bytes == pytest.approx(1.5)


def test_prefetch_hides_gathers_and_cap_bounds_overlap():
    w = _small_workload()
    fast = simulate(w, H100, Layout.of(world=8, stage=3, prefetch=1))
    assert fast.exposed_comm_s < fast.comm_s  # most of the communication is under compute
    assert fast.step_s >= fast.compute_s + fast.optimizer_s
    slow_net = dataclasses.replace(H100, intra_bandwidth=H100.intra_bandwidth / 1000)
    slow = simulate(w, slow_net, Layout.of(world=8, stage=3))
    assert slow.exposed_comm_s > fast.exposed_comm_s
    assert slow.tokens_per_s_per_gpu < fast.tokens_per_s_per_gpu


def test_checkpointing_costs_recompute_and_saves_memory():
    plain, ckpt = _small_workload(), _small_workload(checkpointing="all")
    lay = Layout.of(world=8, stage=3)
    assert simulate(w=ckpt, hw=H100, layout=lay).compute_s > simulate(w=plain, hw=H100, layout=lay).compute_s
    assert peak_bytes(ckpt, lay) < peak_bytes(plain, lay)
    with pytest.raises(ValueError, match="checkpointing policy"):
        _small_workload(checkpointing="bogus")


# torchtitan docs/performance.md: Llama 3.1 8B, FSDP (1D), local batch 2, seq 8192, selective (op)
# activation checkpointing, bf16 params / fp32 reduction, no float8. "FSDP" rows; H100 96 GB HBM2e,
# 400 Gb/s per GPU, 8 GPUs per host. Memory is torch's reserved peak in GiB.
TORCHTITAN_8B = {8: (5762, 82.4), 128: (5605, 67.0)}


@pytest.mark.parametrize("world", sorted(TORCHTITAN_8B))
def test_predicts_torchtitan_llama3_8b(world):
    tps, gib = TORCHTITAN_8B[world]
    w = Workload(shape=SHAPES["llama3-8b"], micro_batch=2, seq=8192, checkpointing="op")
    layout = Layout.of(world=world, stage=3, param_bytes=2, reduce_bytes=4)
    r = simulate(w, PRESETS["h100-96"], layout)
    assert r.tokens_per_s_per_gpu == pytest.approx(tps, rel=0.25)
    assert peak_bytes(w, layout) / GIB == pytest.approx(gib, rel=0.15)
    assert r.dominant() == "matmul"


def test_hardware_toml(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('base = "h100"\ninter_bandwidth = 25e9\n')
    hw = load_hardware(str(f))
    assert hw.inter_bandwidth == 25e9 and hw.peak_flops == H100.peak_flops and hw.name == "mine"
    f.write_text("nonsense = 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_hardware(str(f))
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("tpu")


def test_layout_rejects_bad_shard_group():
    with pytest.raises(ValueError, match="shard_size=3 does not divide the 8 data-parallel ranks"):
        Layout.of(world=8, stage=3, shards=3)


def test_cli_time_json_and_sweep_plot(tmp_path, capsys):
    import json

    from zeroshard.cli.main import main as cli

    png = tmp_path / "sweep.png"
    assert cli(["plan", "--time", "--model", "llama3-70b", "--sweep", "64,256", "--stage", "3",
                "--shard-sizes", "64", "--checkpointing", "full", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    labels = {(r["layout"], r["world"]) for r in out["rows"]}
    assert labels == {("zero3", 64), ("zero3", 256), ("zero3 shard=64", 256)}
    assert png.stat().st_size > 0
    assert cli(["plan", "--time", "--model", "tiny", "--world", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3] and all(r["peak_bytes"] > 0 for r in rows)
    assert cli(["plan", "--time", "--model", "llama3-8b", "--world", "8", "--offload", "cpu", "--shard-size", "4",
                "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]  # offload over the whole world only: no hybrid rows
    assert [r["layout"] for r in rows] == [f"{n} offload=cpu" for n in ("ddp", "zero1", "zero2", "zero3")]
    assert all(r["breakdown"]["host copies (offload)"] > 0 for r in rows)
    assert cli(["plan", "--time", "--model", "llama3-8b", "--sweep", "8,x"]) == 1
    assert "--sweep takes" in capsys.readouterr().err
    assert cli(["plan", "--model", "llama3-8b", "--world", "8"]) == 0  # its memory, from the same shape
    assert "llama3-8b: 8,030.3M params" in capsys.readouterr().out


def test_hybrid_beats_full_sharding_for_70b_at_scale():
    """Full sharding's rings pay one network latency per rank, so at thousands of GPUs a 64-GPU shard
    group (the smallest that fits 70B in 80 GB here) is faster; at 64 GPUs there is nothing to replicate."""
    w = Workload(shape=SHAPES["llama3-70b"], micro_batch=1, seq=8192, checkpointing="full")
    full = simulate(w, H100, Layout.of(world=4096, stage=3))
    hybrid = simulate(w, H100, Layout.of(world=4096, stage=3, shards=64))
    assert hybrid.tokens_per_s_per_gpu > full.tokens_per_s_per_gpu
    assert full.exposed_comm_s > hybrid.exposed_comm_s
    assert peak_bytes(w, Layout.of(world=4096, stage=3, shards=64)) < H100.hbm_bytes
    assert peak_bytes(w, Layout.of(world=4096, stage=3, shards=8)) > H100.hbm_bytes


def test_calibration_fit_recovers_alpha_and_bandwidth():
    from zeroshard.tools.sim.calibrate import fit

    alpha, bw, p = 50e-6, 2e9, 4
    points = [(n, algorithm_seconds("all_gather", "ring", n, p, dataclasses.replace(
        H100, intra_latency=alpha, intra_bandwidth=bw))) for n in (1e3, 1e5, 1e7)]
    a, b = fit(points, "all_gather", p)
    assert a == pytest.approx(alpha) and b == pytest.approx(bw)
    with pytest.raises(ValueError, match="2 ranks"):
        fit(points, "all_gather", 1)


@pytest.mark.parametrize("bucket_mb", [1.0, 25.0, 1e9])
def test_ddp_volume_does_not_depend_on_buckets(bucket_mb):
    w = _small_workload()
    r = simulate(w, H100, Layout.of(world=8, stage=0, bucket_mb=bucket_mb, reduce_bytes=4))
    assert r.wire_bytes == pytest.approx(wire_bytes("all_reduce", w.shape.params * 4, 8))


def test_shard_group_inside_a_node_uses_nvlink():
    w = _small_workload()
    inside = simulate(w, H100, Layout.of(world=64, stage=3, shards=8))
    across = simulate(w, H100, Layout.of(world=64, stage=3, shards=16))
    # Same bytes per rank inside the shard group would be cheaper over NVLink: less busy time.
    assert inside.comm_s < across.comm_s


def test_stage_zero_exposes_the_last_all_reduce_on_a_slow_network():
    w = _small_workload()
    slow = dataclasses.replace(H100, inter_bandwidth=H100.inter_bandwidth / 100)
    r = simulate(w, slow, Layout.of(world=16, stage=0))
    assert r.exposed_comm_s > 0 and r.step_s > r.compute_s + r.optimizer_s


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_replays_what_no_sync_does(stage):
    """G micro-steps: every forward/backward runs G times; stage 3 gathers every unit (the root
    too) in each micro-step; stages 0-1 reduce once, in the last micro-step, and stages 2-3 in every
    one (into the grad shard); the update and stages 1-2's param all-gather happen once."""
    G, world = 4, 8
    one, acc = _small_workload(), _small_workload(accum=G)
    lay = Layout.of(world=world, stage=stage, param_bytes=2, reduce_bytes=2, bucket_mb=1e9)
    r1, rg = simulate(one, H100, lay), simulate(acc, H100, lay)
    assert rg.compute_s == pytest.approx(G * r1.compute_s) and rg.optimizer_s == pytest.approx(r1.optimizer_s)
    s = one.shape
    grads = wire_bytes("reduce_scatter" if stage else "all_reduce", s.params * 2, world)
    # What the G - 1 earlier micro-steps add: nothing at stages 0-1, the reduce-scatter at stage 2,
    # everything (gathers and reduce-scatter) at stage 3.
    repeated = {0: 0.0, 1: 0.0, 2: grads, 3: r1.wire_bytes}[stage]
    assert rg.wire_bytes == pytest.approx(r1.wire_bytes + (G - 1) * repeated)
    assert rg.tokens_per_s_per_gpu == pytest.approx(G * one.tokens / rg.step_s)
    with pytest.raises(ValueError, match="accum"):
        _small_workload(accum=0)


def test_tp_splits_compute_and_puts_its_all_reduces_on_the_critical_path():
    """tp=2 on 8 GPUs: the matmuls and attention of each block halve; each block adds 2 all-reduces
    of tokens x hidden activations in forward and 2 in backward, on the intra-node link, blocking;
    ZeRO runs over the 4 data-parallel ranks with half of each block's params."""
    from zeroshard.tools.sim.network import collective_seconds

    w = _small_workload()
    s, tp = w.shape, 2
    plain = simulate(w, H100, Layout.of(world=4, stage=3))
    split = simulate(w, H100, Layout.of(world=8, stage=3, tp=tp))
    L, d1 = s.n_layer, w.block_gemm_flops / (H100.peak_flops * H100.gemm_efficiency)
    assert plain.compute_s - split.compute_s == pytest.approx(
        3 * L * (d1 + w.block_attention_flops / (H100.peak_flops * H100.attention_efficiency)) / tp)
    one = collective_seconds("all_reduce", w.tokens * s.hidden * w.compute_bytes, tp, H100, spans=False)
    assert split.exposed_comm_s >= 4 * L * one  # the tp all-reduces cannot hide
    assert split.tokens_per_s_per_gpu == pytest.approx(w.tokens / tp / split.step_s)
    tp_wire = 4 * L * wire_bytes("all_reduce", w.tokens * s.hidden * w.compute_bytes, tp)
    zero = split.wire_bytes - tp_wire  # ZeRO's share: half of every block, the whole root, same dp group
    assert plain.wire_bytes / 2 < zero < plain.wire_bytes
    with pytest.raises(ValueError, match="tp=3 does not divide world size 8"):
        Layout.of(world=8, stage=3, tp=3)


@pytest.mark.parametrize("checkpointing", ["none", "op", "full"])
def test_tp_divides_the_split_activations_and_keeps_the_whole_ones(checkpointing):
    """A tp rank keeps 1/tp of what the split linears make (heads, the MLP's hidden width) and all
    of the block input, the norms' outputs and the residual; on zeroshard's GPT shape the per-block
    bytes are within 3% of the planner's measured-exact count at tp 1, 2 and 4; a 70B step that is
    out of memory at tp 1 fits at tp 8 with checkpointing."""
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.activations import gpt_activations
    from zeroshard.tools.planner.spec import Checkpointing
    from zeroshard.tools.sim.workload import gpt_shape

    w = Workload(shape=SHAPES["llama3-8b"], micro_batch=1, seq=4096, checkpointing=checkpointing)
    one, two, eight = (w.per_layer_activation_bytes(tp=tp) for tp in (1, 2, 8))
    if checkpointing == "full":
        assert one == two == eight == w.tokens * w.shape.hidden * w.compute_bytes
    else:
        assert one > two > eight > one / 8  # the whole tensors stay on every rank
        assert (one - two) / (two - eight) == pytest.approx(4 / 3)  # whole + split / tp
    cfg = GPTConfig.named("small")
    gpt = Workload(shape=gpt_shape(cfg, "small"), micro_batch=2, seq=cfg.seq_len, compute_bytes=4)
    for tp in (1, 2, 4):
        exact = gpt_activations(cfg, micro_batch=2, seq=cfg.seq_len, compute_bytes=4, policy=Checkpointing("none"),
                                tp=tp).per_layer
        assert gpt.per_layer_activation_bytes(tp=tp) == pytest.approx(exact, rel=0.03)
    big = Workload(shape=SHAPES["llama3-70b"], micro_batch=1, seq=8192, checkpointing="full")
    assert peak_bytes(big, Layout.of(world=256, stage=3)) > peak_bytes(big, Layout.of(world=256, stage=3, tp=8))
    assert peak_bytes(big, Layout.of(world=256, stage=3, tp=8)) < H100.hbm_bytes


# --------------------------------------------------------------------------- a calibrated host


def _calibrated(contention: float = 0.0):
    """A host as ``plan --calibrate`` stores it: fitted gloo links at world 2 and measured units of
    tiny (vocab 16, micro-batch 1 x seq 64)."""
    from zeroshard.tools.sim.hardware import Hardware
    from zeroshard.tools.sim.measured import MeasuredCompute, MeasuredLink

    links = tuple(MeasuredLink(op=op, group=2, world=2, alpha_s=1e-4, bandwidth=1e9)
                  for op in ("all_gather", "reduce_scatter", "all_reduce"))
    compute = (MeasuredCompute(model="tiny", vocab=16, micro_batch=1, seq=64, world=2, block_forward_s=1e-3,
                               block_backward_s=2e-3, root_forward_s=5e-4, root_backward_s=1e-3,
                               optimizer_s_per_param=1e-8, contention_all_gather=contention,
                               contention_reduce_scatter=contention, contention_all_reduce=contention),)
    return Hardware(name="host", peak_flops=1e10, hbm_bytes=8e9, hbm_bandwidth=1e10, gpus_per_node=4,
                    intra_bandwidth=1e9, inter_bandwidth=1e9, links=links, compute=compute)


def _tiny(micro_batch: int = 1) -> Workload:
    from zeroshard.models import GPTConfig
    from zeroshard.tools.sim.workload import gpt_shape

    return Workload(shape=gpt_shape(GPTConfig.named("tiny", vocab_size=16, seq_len=64), "tiny"),
                    micro_batch=micro_batch, seq=64)


def test_calibrated_hardware_round_trips_through_toml(tmp_path):
    from zeroshard.tools.sim.measured import to_toml

    hw = _calibrated(contention=0.25)
    f = tmp_path / "host.toml"
    f.write_text(to_toml(hw, "a comment\nover two lines"))
    assert load_hardware(str(f)) == hw
    f.write_text(to_toml(hw).replace("alpha_s", "alpha"))
    with pytest.raises(ValueError, match="malformed"):
        load_hardware(str(f))


def test_calibrated_ddp_step_is_the_documented_sum():
    """Stage 0 at world 2, tiny in one bucket: forward, root, backward from the measured units,
    then the bucket's all-reduce (exposed: nothing is left to compute), then AdamW on every param."""
    hw, w = _calibrated(), _tiny()
    r = simulate(w, hw, Layout.of(world=2, stage=0, param_bytes=4))
    L, params = w.shape.n_layer, w.shape.params
    compute = L * 3e-3 + 1.5e-3
    all_reduce = 2 * 1e-4 + params * 4 / 1e9  # 2(p-1) alpha + 2(p-1)/p * n / bw at p = 2
    assert r.compute_s == pytest.approx(compute)
    assert r.step_s == pytest.approx(compute + all_reduce + params * 1e-8)
    assert r.exposed_comm_s == pytest.approx(all_reduce)
    # Twice the tokens: the units scale with them (the optimizer does not).
    r2 = simulate(_tiny(2), hw, Layout.of(world=2, stage=0, param_bytes=4))
    assert r2.compute_s == pytest.approx(2 * compute)


def test_contention_charges_hidden_communication_to_the_step():
    layout = Layout.of(world=2, stage=3, param_bytes=4)
    free, shared = simulate(_tiny(), _calibrated(0.0), layout), simulate(_tiny(), _calibrated(1.5), layout)
    assert free.hidden_comm_s > 0
    assert shared.step_s == pytest.approx(free.step_s + 1.5 * free.hidden_comm_s)
    assert shared.breakdown["comm contention"] == pytest.approx(1.5 * free.hidden_comm_s)


def test_calibrated_hardware_refuses_another_model():
    w = Workload(shape=SHAPES["llama3-8b"], micro_batch=1, seq=128)
    with pytest.raises(ValueError, match="plan calibrate --model llama3-8b"):
        simulate(w, _calibrated(), Layout.of(world=2, stage=0))


def test_fit_of_a_measured_link_gives_it_back_and_plan_time_reads_the_toml(tmp_path, capsys):
    """What calibration fits is what the replay charges: timings generated from a stored link fit
    back to it, for each collective; and ``plan --time --hw`` takes the stored file."""
    import json

    from zeroshard.cli.main import main as cli
    from zeroshard.tools.sim.calibrate import fit
    from zeroshard.tools.sim.measured import to_toml

    hw = _calibrated()
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        points = [(n, collective_seconds(op, n, 2, hw)) for n in (4e3, 2e6, 3.2e7)]
        assert fit(points, op, 2) == pytest.approx((1e-4, 1e9))
    f = tmp_path / "host.toml"
    f.write_text(to_toml(hw))
    assert cli(["plan", "--time", "--hw", str(f), "--model", "tiny", "--vocab-size", "16", "--seq", "64",
                "--micro-batch", "1", "--world", "2", "--stage", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "host" and out["rows"][0]["compute_s"] == pytest.approx(4 * 3e-3 + 1.5e-3)
    assert cli(["plan", "--time", "--hw", str(f), "--model", "tiny", "--world", "2", "--json"]) == 1
    assert "measured on tiny (vocab 16)" in capsys.readouterr().err


def test_a_collective_takes_the_fit_measured_under_its_load():
    """A hybrid step's groups of 2 run while 4 ranks share the host: their fit, not the 2-rank world's."""
    from zeroshard.tools.sim.measured import MeasuredLink, pick_link

    alone = MeasuredLink(op="all_gather", group=2, world=2, alpha_s=1e-4, bandwidth=2e9)
    loaded = MeasuredLink(op="all_gather", group=2, world=4, alpha_s=2e-4, bandwidth=1e9)
    whole = MeasuredLink(op="all_gather", group=4, world=4, alpha_s=3e-4, bandwidth=1e9)
    links = (alone, loaded, whole)
    assert pick_link(links, "all_gather", 2) is alone
    assert pick_link(links, "all_gather", 2, world=4) is loaded
    assert pick_link(links, "all_gather", 8, world=8) is whole
    assert pick_link(links, "all_reduce", 2) is None
    hw = dataclasses.replace(_calibrated(), links=links)
    assert simulate(_tiny(), hw, Layout.of(world=4, stage=3, shards=2, param_bytes=4)).comm_s > \
        simulate(_tiny(), dataclasses.replace(hw, links=(alone, whole)), Layout.of(world=4, stage=3, shards=2,
                                                                                param_bytes=4)).comm_s
    with pytest.raises(ValueError, match="group <= world"):
        MeasuredLink(op="all_gather", group=4, world=2, alpha_s=0.0, bandwidth=1e9)


# --------------------------------------------------------------------------- collectives in flight together


def _shared(two: float, three: float, world: int = 2, group: int = 2):
    from zeroshard.tools.sim.measured import MeasuredConcurrency

    return dataclasses.replace(_calibrated(), concurrency=(MeasuredConcurrency(world=world, group=group, two=two,
                                                                               three=three),))


def test_collectives_in_flight_together_take_the_calibrated_factor_of_their_serial_time():
    from zeroshard.tools.sim.step import CommLink

    layout, n = Layout.of(world=2, stage=3, param_bytes=4), 8e6
    one = collective_seconds("all_gather", n, 2, _calibrated())
    for k, factor in ((2, 1.4), (3, 0.8)):
        link = CommLink(_shared(two=1.4, three=0.8), layout)
        ops = [link.launch("all_gather", n, 2, at=0.0) for _ in range(k)]
        assert [link.when(o) for o in ops] == pytest.approx([k * factor * one] * k)
    # A fair share (factor 1): the second, launched halfway through the first, shares the link from
    # then on; the pair still ends when the two run back to back would.
    link = CommLink(_shared(two=1.0, three=1.0), layout)
    first, second = link.launch("all_gather", n, 2, at=0.0), link.launch("all_gather", n, 2, at=one / 2)
    assert (link.when(first), link.when(second)) == pytest.approx((1.5 * one, 2 * one))
    # Without a measured figure each stream runs one at a time, as one NCCL stream does.
    fifo = CommLink(_calibrated(), layout)
    a, b = fifo.launch("all_gather", n, 2, at=0.0), fifo.launch("all_gather", n, 2, at=0.0)
    assert (fifo.when(a), fifo.when(b)) == pytest.approx((one, 2 * one))


def test_a_step_without_overlapping_collectives_is_unchanged_by_concurrency():
    """Stage 0, tiny in one bucket: a single all-reduce, never in flight with another."""
    layout = Layout.of(world=2, stage=0, param_bytes=4)
    alone = simulate(_tiny(), _calibrated(), layout)
    for two, three in ((0.6, 0.7), (1.0, 1.0), (2.0, 3.0)):
        assert simulate(_tiny(), _shared(two, three), layout).step_s == pytest.approx(alone.step_s)


def test_concurrency_slows_a_step_whose_collectives_overlap():
    """Stage 3 prefetches a gather while reductions run: thrashing (factor > 1) costs time, a
    figure below 1 (spare cores) saves it, and the comm volume does not change."""
    layout = Layout.of(world=2, stage=3, param_bytes=4)
    fair, thrash, spare = (simulate(_tiny(), _shared(f, f), layout) for f in (1.0, 2.0, 0.6))
    assert spare.step_s < fair.step_s < thrash.step_s
    assert spare.wire_bytes == fair.wire_bytes == thrash.wire_bytes


def test_concurrency_is_picked_by_world_and_shard_group_and_round_trips(tmp_path):
    from zeroshard.tools.sim.measured import MeasuredConcurrency, pick_concurrency, to_toml

    full = MeasuredConcurrency(world=4, group=4, two=1.1, three=1.2)
    hybrid = MeasuredConcurrency(world=4, group=2, two=2.0, three=1.5)
    pair = MeasuredConcurrency(world=2, group=2, two=0.9, three=0.95)
    entries = (full, hybrid, pair)
    assert pick_concurrency(entries, 4) is full
    assert pick_concurrency(entries, 4, 2) is hybrid
    assert pick_concurrency(entries, 2) is pair
    assert pick_concurrency((), 2) is None
    assert hybrid.factor(1) == 1.0 and hybrid.factor(2) == 2.0 and hybrid.factor(5) == 1.5
    assert MeasuredConcurrency(world=2, group=2, two=0.1, three=0.1).factor(2) == 0.5  # never faster than alone
    hw = dataclasses.replace(_calibrated(), concurrency=entries)
    f = tmp_path / "host.toml"
    f.write_text(to_toml(hw))
    assert load_hardware(str(f)) == hw
    with pytest.raises(ValueError, match="group <= world"):
        MeasuredConcurrency(world=2, group=4, two=1.0, three=1.0)


def test_hidden_comm_is_collective_work_under_compute_on_the_timeline():
    """Stage 3: what the timeline puts under compute is hidden; with the stream's total it makes
    no more than the comm, and the contention charge is exactly its measured share of it."""
    layout = Layout.of(world=2, stage=3, param_bytes=4)
    for hw in (_calibrated(), _shared(1.3, 1.6)):
        r = simulate(_tiny(), hw, layout)
        assert 0 < r.hidden_comm_s <= r.comm_s + 1e-12
        loaded = dataclasses.replace(hw, compute=tuple(dataclasses.replace(c, contention_all_gather=0.5,
                                                                           contention_reduce_scatter=0.5)
                                                       for c in hw.compute))
        assert simulate(_tiny(), loaded, layout).breakdown["comm contention"] == pytest.approx(0.5 * r.hidden_comm_s)


def test_hardware_from_rounds_takes_the_median_of_each_figure():
    """Calibrations repeated over rounds (bench/sim_vs_measured.py): each figure is the median of
    the rounds', so one round under a load spike does not set it; a link fit is what it was."""
    from zeroshard.tools.sim.calibrate import STEP_SIZES, UNIT_KEYS, hardware_from

    link = _calibrated()

    def one_round(slow: float) -> dict:
        points = {f"{op}:2": [(float(n), slow * collective_seconds(op, n, 2, link)) for n in STEP_SIZES]
                  for op in ("all_gather", "reduce_scatter", "all_reduce")}
        unit = dict.fromkeys(UNIT_KEYS, 1e-3 * slow) | {"block_params": 1e5}
        return {"points": points, "unit": unit, "contention": {"contention_all_gather": 0.2 * slow},
                "concurrency": {2: {"two": 1.1 * slow, "three": 1.3 * slow}}}

    hw, raw = hardware_from({2: [one_round(1.0), one_round(5.0), one_round(1.0)]}, "tiny", 16, 1, 64)
    assert [(m.op, m.group, m.world) for m in hw.links] == [(op, 2, 2) for op in
                                                            ("all_gather", "reduce_scatter", "all_reduce")]
    assert all((m.alpha_s, m.bandwidth) == pytest.approx((1e-4, 1e9)) for m in hw.links)
    (c,) = hw.compute
    assert c.block_forward_s == pytest.approx(1e-3) and c.contention_all_gather == pytest.approx(0.2)
    (k,) = hw.concurrency
    assert (k.world, k.group, k.two, k.three) == (2, 2, pytest.approx(1.1), pytest.approx(1.3))
    assert len(raw) == 3


def test_a_schedule_that_gathers_every_block_pays_the_slowest_ranks_block(tmp_path):
    """Sharded params (stage 3, hybrid too) wait on a gather before each block, which every rank must
    have launched, so a block takes its slowest rank's time; stages 0-2 meet a few times a step and
    keep the ranks' mean blocks, paying the slowest rank's whole step once, on the root. A file
    without the slowest figures (written before they were measured) keeps the mean everywhere and
    still round-trips."""
    from zeroshard.tools.sim.measured import to_toml

    base = _calibrated()
    (c,) = base.compute
    slow = dataclasses.replace(base, compute=(dataclasses.replace(
        c, block_forward_slowest_s=1.5e-3, block_backward_slowest_s=2.5e-3,
        root_slowest_s=c.root_forward_s + c.root_backward_s + 0.75e-3),))
    L = _tiny().shape.n_layer
    for stage in (0, 1, 2, 3):
        layout = Layout.of(world=2, stage=stage, param_bytes=4)
        mean, slowest = simulate(_tiny(), base, layout), simulate(_tiny(), slow, layout)
        extra = L * (0.5e-3 + 0.5e-3) if stage == 3 else 0.25e-3 + 0.5e-3
        assert slowest.compute_s == pytest.approx(mean.compute_s + extra)
    hybrid = Layout.of(world=4, stage=3, shards=2, param_bytes=4)
    assert simulate(_tiny(), slow, hybrid).compute_s == pytest.approx(simulate(_tiny(), base, hybrid).compute_s + L * 1e-3)
    for hw in (base, slow):
        f = tmp_path / "host.toml"
        f.write_text(to_toml(hw))
        assert load_hardware(str(f)) == dataclasses.replace(hw, name="host")


def test_the_slowest_rank_figure_is_the_median_over_repeats_of_each_repeats_slowest():
    from zeroshard.tools.sim.calibrate import _slowest

    ranks = [{"unit": {"block_forward_reps": [1.0, 5.0, 1.0]}}, {"unit": {"block_forward_reps": [2.0, 1.0, 3.0]}}]
    # per repeat the slower rank: 2, 5, 3; their median 3 (a rank's own median would give 1 and 2)
    assert _slowest(ranks, "block_forward_reps") == 3.0
    # A stretch of two parts: each rank's sum per repeat, then the slower: 3, 6, 4 -> 4, not 3 + 2.
    ranks = [{"unit": {"f": [1.0, 5.0, 1.0], "b": [2.0, 1.0, 3.0]}}, {"unit": {"f": [2.0, 1.0, 3.0], "b": [1.0, 1.0, 1.0]}}]
    assert _slowest(ranks, "f", "b") == 4.0


def test_simulated_buckets_follow_the_engines_rule():
    """One bucketing rule (zeroshard.runtime.engine.merge_in_order) for the engine, the planner and
    the replay: consecutive units until a bucket reaches the size, the rest in a last one."""
    from zeroshard.runtime.engine import merge_in_order

    assert merge_in_order([10, 10, 10, 3], float, 15) == [[10, 10], [10, 3]]
    assert merge_in_order([20, 1], float, 15) == [[20], [1]]
    w = _tiny()
    per_block = w.shape.block_params * 4 / 2**20  # MiB of fp32 params per block
    two_blocks = simulate(w, _calibrated(), Layout.of(world=2, stage=0, param_bytes=4, bucket_mb=1.5 * per_block))
    one_bucket = simulate(w, _calibrated(), Layout.of(world=2, stage=0, param_bytes=4))
    # the same bytes either way; more buckets pay more latency
    assert two_blocks.wire_bytes == pytest.approx(one_bucket.wire_bytes)
    assert two_blocks.comm_s > one_bucket.comm_s


def test_offload_moves_the_optimizer_to_the_host_and_pays_the_host_link():
    """cpu offload (the runtime's OffloadPolicy): AdamW runs on the host at host memory bandwidth,
    the reduced fp32 grad shards go out over the host link while backward runs (the optimizer waits
    for the last), and the masters come back before their gathers. The copies back are exact: at
    stage 3 this rank's slice of the root once and of every block at each of its gathers (forward,
    and backward's regather but for the block kept from forward); at stages 1-2 the slice once,
    before the post-step all-gather; at stage 0 the whole model."""
    from zeroshard.tools.sim.step import HOST_ADAMW_BYTES_PER_PARAM, MASTER_BYTES

    w, hw = _small_workload(), PRESETS["h100"]
    s, world = w.shape, 8
    for stage in (0, 1, 2, 3):
        base = simulate(w, hw, Layout.of(world=world, stage=stage))
        off = simulate(w, hw, Layout.of(world=world, stage=stage, offload="cpu"))
        local = s.params / (world if stage else 1)
        assert off.optimizer_s == pytest.approx(local * HOST_ADAMW_BYTES_PER_PARAM / hw.host_memory_bandwidth)
        copies_back = (s.root_params + (2 * s.n_layer - 1) * s.block_params) / world if stage == 3 else local
        waited_out = off.breakdown["host copies (offload)"] - copies_back * MASTER_BYTES / hw.host_link_bandwidth
        assert waited_out >= -1e-12  # plus whatever the optimizer waited for grads still in transit
        assert waited_out <= local * MASTER_BYTES / hw.host_link_bandwidth + 1e-12
        assert off.compute_s == base.compute_s and off.step_s > base.step_s
        assert off.step_s == pytest.approx(off.compute_s + off.optimizer_s + off.exposed_comm_s
                                           + off.breakdown["host copies (offload)"], rel=1e-9)


def test_disk_offload_paces_the_step_by_the_slower_of_cpu_and_disk():
    from zeroshard.tools.sim.step import DISK_STATE_BYTES_PER_PARAM, HOST_ADAMW_BYTES_PER_PARAM

    w, hw, world = _small_workload(), PRESETS["h100"], 8
    local = w.shape.params / world
    disk = simulate(w, hw, Layout.of(world=world, stage=3, offload="disk")).optimizer_s
    cpu = local * HOST_ADAMW_BYTES_PER_PARAM / hw.host_memory_bandwidth
    io = 2 * local * DISK_STATE_BYTES_PER_PARAM / hw.disk_bandwidth
    assert max(cpu, io) < disk <= max(cpu, io) + local * DISK_STATE_BYTES_PER_PARAM / hw.disk_bandwidth
    fast = dataclasses.replace(hw, disk_bandwidth=1e15)  # the disk is then no limit
    assert simulate(w, fast, Layout.of(world=world, stage=3, offload="disk")).optimizer_s == pytest.approx(cpu, rel=1e-4)


def test_offload_needs_the_host_figures_and_the_whole_world():
    w = _small_workload()
    bare = dataclasses.replace(PRESETS["h100"], name="mine", host_link_bandwidth=0.0)
    with pytest.raises(ValueError, match="offload=cpu needs hardware 'mine' to give host_link_bandwidth"):
        simulate(w, bare, Layout.of(world=8, stage=3, offload="cpu"))
    no_disk = dataclasses.replace(PRESETS["h100"], name="mine", disk_bandwidth=0.0)
    with pytest.raises(ValueError, match="disk_bandwidth"):
        simulate(w, no_disk, Layout.of(world=8, stage=3, offload="disk"))
    with pytest.raises(ValueError, match="offload is simulated over the whole world"):
        Layout.of(world=8, stage=3, shards=4, offload="cpu")
    with pytest.raises(ValueError, match="offload must be 'none', 'cpu' or 'disk'"):
        Layout.of(world=8, stage=3, offload="nvme")


def test_offload_frees_device_memory_in_the_replays_peak():
    from zeroshard.tools.sim.memory import gpt_peak_bytes

    w = _tiny()
    for stage in (1, 2, 3):
        on, off = (gpt_peak_bytes("tiny", w, Layout.of(world=2, stage=stage, offload=o)) for o in ("cpu", "none"))
        assert on < off
    big = _small_workload()
    assert peak_bytes(big, Layout.of(world=8, stage=3, offload="cpu")) < peak_bytes(big, Layout.of(world=8, stage=3))


def test_measured_unit_host_seconds_are_paid_by_every_stage3_unit():
    """The runtime's per-unit host cost (``plan calibrate`` reads it from the host-time breakdown)
    adds to each unit's forward and backward at stage 3, blocks and root alike; stage 0 is unchanged."""
    import dataclasses

    hw, w = _calibrated(), _tiny()
    host = dataclasses.replace(hw, compute=(dataclasses.replace(hw.compute[0], unit_host_forward_s=1e-4,
                                                                unit_host_backward_s=2e-4),))
    units = w.shape.n_layer + 1
    s3 = Layout.of(world=2, stage=3, param_bytes=4)
    base, more = simulate(w, hw, s3), simulate(w, host, s3)
    assert more.breakdown["runtime host (measured)"] == pytest.approx(units * 3e-4)
    assert more.compute_s - base.compute_s == pytest.approx(units * 3e-4)
    assert more.step_s > base.step_s
    s0 = Layout.of(world=2, stage=0, param_bytes=4)
    assert simulate(w, host, s0).step_s == simulate(w, hw, s0).step_s

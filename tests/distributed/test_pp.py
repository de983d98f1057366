"""Pipeline parallelism with ZeRO inside every stage: world 4 = pp 2 x shard 2, against one process.

One spawned world-4 group runs every case (pp_workloads.CASES: the GPT at stages 1-3 and
Llama with its tied head at stages 3 and 1, 1F1B and interleaved 1F1B, 5 steps;
GRAD_REDUCE_CASES: the GPT reducing its grads after every microbatch); the tests below read its results.
"""

from __future__ import annotations

import pytest

import pp_workloads as w
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.train import reference_train

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> str:
    return w.write_moe_folder(tmp_path_factory.mktemp("pp-moe"))


@pytest.fixture(scope="module")
def suite(moe_folder):
    return spawn(w.suite, w.WORLD, args=(moe_folder,), timeout_s=900)


@pytest.fixture(scope="module")
def references():
    return {name: reference_train(w.config(name, 0)) for name in w.MODELS}


def _max_diff(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def _assert_matches_one_process(got: dict, ref: dict, label: str, seconds: float) -> None:
    """Within 1e-5 of one process after the run's steps, the tied head's copy bitwise its owner."""
    diff = _max_diff(got["params"], ref["params"])
    print(f"{label}, {w.STEPS} steps: max abs param diff vs one process {diff:.2e} ({seconds:.1f} s)")
    assert diff <= 1e-5
    owner, copy = got["tied"][0]
    assert (got["params"][owner] == got["params"][copy]).all()


@pytest.mark.parametrize("case", w.CASES, ids=[f"{n}-stage{s}-{sch}" for n, s, sch in w.CASES])
def test_pipeline_matches_single_process(suite, references, case):
    name, stage, schedule = case
    got, ref = suite[0][case], references[name]
    diff = _max_diff(got["params"], ref["params"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"{name} pp 2 x shard 2 stage {stage} {schedule}, {w.STEPS} steps: max abs param diff vs one process "
          f"{diff:.2e}, loss {loss_diff:.2e} ({suite[0]['times'][case]:.1f} s)")
    assert diff <= 1e-5
    assert loss_diff <= 1e-5
    # The tied head's copy on the last stage stays the owner's, bitwise.
    owner, copy = got["tied"][0]
    assert (got["params"][owner] == got["params"][copy]).all()
    # Every rank reports the same loss (the last stage's, summed over pp).
    assert all(other[case]["losses"] == got["losses"] for other in suite[1:])


def test_pipeline_stage0_matches_our_stage0_without_a_pipeline(suite, references):
    got, flat = suite[0][w.STAGE0_CASES[0]], suite[0]["flat-stage0"]
    diff = _max_diff(got["params"], flat["params"])
    print(f"gpt pp 2 x shard 2 stage 0 vs stage 0 over 4 ranks: {diff:.2e}; vs one process "
          f"{_max_diff(got['params'], references['gpt']['params']):.2e}")
    assert diff <= 1e-5


def test_pipeline_with_tensor_parallel_stages_matches_single_process(suite, references):
    got = suite[0]["pp-tp"]
    diff = _max_diff(got["params"], references["gpt"]["params"])
    print(f"gpt pp 2 x tp 2 stage 3 1f1b, {w.STEPS} steps: max abs param diff vs one process {diff:.2e} "
          f"({suite[0]['times']['pp-tp']:.1f} s)")
    assert diff <= 1e-5


@pytest.mark.parametrize("case,name,what", [
    ("pp-tp-llama", "llama", "pp 2 x tp 2"), ("pp-replicate", "gpt", "pp 2 x replicate 2 x shard 1"),
    ("pp-tp-microbatch", "gpt", "pp 2 x tp 2, pp_grad_reduce=microbatch,"),
    ("pp-replicate-microbatch", "gpt", "pp 2 x replicate 2 x shard 1, pp_grad_reduce=microbatch,")])
def test_pipeline_of_other_layouts_matches_single_process(suite, references, case, name, what):
    got = suite[0][case]
    _assert_matches_one_process(got, references[name], f"{name} {what} stage 3 1f1b", suite[0]["times"][case])
    if case.startswith("pp-replicate"):
        assert (got["replicate"], got["shard"]) == (2, 1)


def test_pipeline_stages_1_to_3_are_bitwise_its_stage_0(suite):
    """Each stage's shard group has 2 ranks, so every reduction is one commutative add and the flat
    buffers are aligned: ZeRO inside the pipeline changes no bit against DDP inside it."""
    base = suite[0][w.STAGE0_CASES[0]]["params"]
    for stage in (1, 2, 3):
        got = suite[0][("gpt", stage, "1f1b")]["params"]
        assert all((got[k] == base[k]).all() for k in base), stage
    # Under the zero-bubble schedule, stage 3 takes the grads torch assigns as stage 1 does: same bits.
    zb1, zb3 = (suite[0][("gpt", s, "interleaved-zero-bubble")]["params"] for s in (1, 3))
    assert all((zb1[k] == zb3[k]).all() for k in zb1)


@pytest.mark.parametrize("key", ["fp16", "fp16-ep"])
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(suite, key):
    """fp16-ep: at pp 2 x ep 2 the inf is in rank 0's own block of experts alone."""
    runs = [r[key] for r in suite]
    print(runs[0], runs[-1])
    for r in runs:  # ranks 0-1 hold the first stage (where the inf is), ranks 2-3 the last
        assert r["skipped"] == [0, 1, 1]
        assert r["moved"] == [True, False, True]
        assert r["scales"][1] == r["scales"][0] * 0.5 == r["scales"][2]


def test_mesh_puts_pp_outermost(suite):
    meshes = [r["mesh"] for r in suite]
    assert [m["pp_rank"] for m in meshes] == [0, 0, 1, 1]  # a stage's ranks are consecutive
    assert [m["shard_rank"] for m in meshes] == [0, 1, 0, 1]
    assert [m["dp_rank"] for m in meshes] == [0, 1, 0, 1]  # pp ranks of one dp index share a batch
    assert all(m["pp"] == 2 and m["shard"] == 2 and m["dp"] == 2 for m in meshes)


SCHEDULED = w.CASES + w.STAGE0_CASES + w.GRAD_REDUCE_CASES


@pytest.mark.parametrize("case", SCHEDULED, ids=lambda c: "-".join(map(str, c)))
def test_each_stage_engines_collectives_are_the_step_schedules_in_torchs_order(suite, case):
    """The step schedule walked in the order torch's schedule runs each stage's microbatches (a
    forward between two backwards finds what the earlier forward kept gathered) gives the steady
    step's collectives of every rank's stage engines, each as often as the ledger has it."""
    for rank, got in enumerate(suite):
        check = got[case]["schedule_vs_ledger"]
        assert check["recorded"], (case, rank)
        assert check["planned"] == check["recorded"], (case, rank)


@pytest.mark.parametrize("case", [c for c in w.CASES if c[1] == 3], ids=lambda c: f"{c[0]}-{c[2]}")
def test_ledger_sends_and_receives_equal_theory(suite, case):
    """Each stage boundary carries one activation forward and its grad backward per microbatch; the
    tied head's grad is all-reduced once per step over pp_ends by the two end ranks."""
    runs = [r[case] for r in suite]
    facts = runs[0]
    boundaries, m, act = facts["num_stages"] - 1, facts["microbatches"], facts["act_bytes"]
    replicas = w.WORLD // 2  # data-parallel copies of the pipeline
    for step in range(w.STEPS):
        per_step = [r["bytes"][step] for r in runs]
        for phase in ("forward", "backward"):
            sent = sum(b.get(f"pp:send:{phase}", 0) for b in per_step)
            received = sum(b.get(f"pp:recv:{phase}", 0) for b in per_step)
            assert sent == received == replicas * boundaries * m * act
        # The tied grad: the embedding's bytes on each of the 4 ranks (each holds an end).
        name = facts["tied"][0][0]
        numel = facts["params"][name].numel()
        assert all(b.get("pp_ends:all_reduce:backward", 0) == numel * 4 for b in per_step)


@pytest.mark.parametrize("case", w.GRAD_REDUCE_CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_grad_reduce_per_microbatch_matches_single_process_and_the_step_reduction(suite, references, case):
    got, once, ref = suite[0][case], suite[0][case[:3]], references[case[0]]
    diff, vs_step = _max_diff(got["params"], ref["params"]), _max_diff(got["params"], once["params"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"{case[0]} pp 2 x shard 2 stage {case[1]} {case[2]} pp_grad_reduce=microbatch, {w.STEPS} steps: max abs "
          f"param diff vs one process {diff:.2e}, vs pp_grad_reduce=step {vs_step:.2e}, loss {loss_diff:.2e} "
          f"({suite[0]['times'][case]:.1f} s)")
    assert diff <= 1e-5 and loss_diff <= 1e-5
    # Not bitwise the step reduction: each microbatch's grads are summed over the shard ranks and then
    # over microbatches, instead of over microbatches and then over ranks (another fp32 add order).
    assert vs_step <= 1e-5
    owner, copy = got["tied"][0]
    assert (got["params"][owner] == got["params"][copy]).all()  # the shard-level tied sum keeps them equal
    assert all(other[case]["losses"] == got["losses"] for other in suite[1:])


@pytest.mark.parametrize("case", w.GRAD_REDUCE_CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_grad_reduce_per_microbatch_traffic_is_microbatches_times_the_step_reduction(suite, case):
    """Each flat group of the rank's stages is reduce-scattered once per step under "step" and once
    per microbatch under "microbatch", its padded grads each time; the tied param adds one all-reduce
    of its size over shard (rebuilding the reduced grad from the shards) and the usual one over pp_ends."""
    key = "shard:reduce_scatter:backward"
    tied_bytes = 4 * suite[0][case]["params"][suite[0][case]["tied"][0][0]].numel()  # fp32 grads
    for rank in suite:
        got, once = rank[case], rank[case[:3]]
        m, groups = got["microbatches"], got["group_grad_bytes"]
        for step in range(w.STEPS):
            assert once["counts"][step][key] == len(groups) and once["bytes"][step][key] == sum(groups)
            assert got["counts"][step][key] == m * len(groups) and got["bytes"][step][key] == m * sum(groups)
            assert got["bytes"][step][key] == m * once["bytes"][step][key]
            assert got["bytes"][step]["shard:all_reduce:backward"] == tied_bytes
            assert "shard:all_reduce:backward" not in once["bytes"][step]
            assert got["bytes"][step]["pp_ends:all_reduce:backward"] == once["bytes"][step][
                "pp_ends:all_reduce:backward"] == tied_bytes


@pytest.mark.parametrize("case", w.GRAD_REDUCE_CASES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}")
def test_planned_reduce_scatters_equal_the_ledger_under_either_choice(suite, case):
    """plan --pp's reduce-scatter bytes per step, per pp rank, at the case's stage, are the ledger's:
    the planner reads pp_grad_reduce through the runtime's own stage options."""
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.pipeline import plan_pipeline
    from zeroshard.tools.planner.spec import STAGE_NAMES

    for twin in (case, case[:3]):
        cfg = w.config(*twin)
        pplan = plan_pipeline(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size), world=w.WORLD, pp=cfg.pp,
                              pp_schedule=cfg.pp_schedule, batch=cfg.batch, seq=cfg.seq_len, device="cpu",
                              stage=cfg.stage, pp_grad_reduce=cfg.engine.pp_grad_reduce)
        for rank in suite:
            layout = pplan.ranks[rank["mesh"]["pp_rank"]].plan[STAGE_NAMES[cfg.stage]]
            planned = sum(c.buffer_bytes * c.count for c in layout.collectives if c.op == "reduce_scatter")
            assert all(b["shard:reduce_scatter:backward"] == planned for b in rank[twin]["bytes"]), twin


@pytest.mark.parametrize("case", [c for c in SCHEDULED if c[0] == "gpt"], ids=lambda c: "-".join(map(str, c)))
def test_planned_gathers_and_reduce_scatters_per_phase_equal_the_ledger(suite, case):
    """plan --pp walks each stage's step schedule in torch's order, so its all-gather and
    reduce-scatter bytes per step, per phase, are the ledger's on every pp rank (rank 0's second
    forward under 1F1B finds the root and the kept block still gathered)."""
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.pipeline import plan_pipeline
    from zeroshard.tools.planner.spec import STAGE_NAMES

    cfg = w.config(*case)
    pplan = plan_pipeline(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size), world=w.WORLD, pp=cfg.pp,
                          pp_schedule=cfg.pp_schedule, batch=cfg.batch, seq=cfg.seq_len, device="cpu",
                          stage=cfg.stage, pp_grad_reduce=cfg.engine.pp_grad_reduce)
    for rank in suite:
        layout = pplan.ranks[rank["mesh"]["pp_rank"]].plan[STAGE_NAMES[cfg.stage]]
        planned: dict[str, int] = {}
        for c in layout.collectives:
            if c.op in ("all_gather", "reduce_scatter"):
                planned[f"{c.group}:{c.op}:{c.phase}"] = planned.get(f"{c.group}:{c.op}:{c.phase}", 0) + \
                    c.buffer_bytes * c.count
        got = {k: v for k, v in rank[case]["bytes"][-1].items() if k.split(":")[1] in ("all_gather", "reduce_scatter")}
        assert got == planned, (case, rank["mesh"])


def test_stage_params_keep_the_unsharded_names(suite, references):
    case = ("gpt", 1, "interleaved-1f1b")
    stages = {tuple(r[case]["stages"]): r[case]["names"] for r in suite}
    assert set(stages) == {(0, 2), (1, 3)}
    assert "tok_emb.weight" in stages[(0, 2)] and "blocks.2.attn.qkv.weight" in stages[(0, 2)]
    assert "lm_head.weight" in stages[(1, 3)] and "blocks.3.mlp.fc.weight" in stages[(1, 3)]


def test_refused_layouts_are_one_line(suite):
    errors = suite[0]["errors"]
    print(errors)
    assert "covers 6 ranks but the world has 4" in errors["mesh_product"]
    assert "pp=3 does not divide world size 4" in errors["pp_world"]
    assert "do not divide the model's 3 blocks" in errors["blocks"]
    assert "needs at least pp=2 microbatches" in errors["microbatches"]
    assert "microbatches=4 does not split" in errors["batch"]
    assert "pp_grad_reduce='microbatch' needs stage 2 or 3: stage 1 keeps full grads" in errors["grad_reduce_stage"]
    assert all("\n" not in e for e in errors.values())


@pytest.mark.parametrize("key", ["meta-init", "meta-init-tp"])
def test_meta_init_keeps_only_the_stage_and_matches_a_plain_build_bitwise(suite, key):
    """init="meta" at pp 2 x shard 2 (and pp 2 x tp 2) stage 3: each rank's stage (the tied head's
    copy included) is bitwise a plain seeded build's, and the params of the other stage never got storage."""
    for rank, got in enumerate(suite):
        meta = got[key]
        assert meta["built_on_meta"] and meta["init_path"] == "meta"
        assert meta["mismatched"] == [] and set(meta["compared"]) == set(meta["kept"])
        assert meta["outside_meta"] and all(meta["outside_meta"].values())
        assert not set(meta["outside_meta"]) & set(meta["kept"])
        # The replay holds one full param at a time: never more than the model's largest.
        assert 0 < meta["peak_temp_bytes"] <= meta["largest_param_bytes"]
        print(f"rank {rank}: {len(meta['compared'])} stage params bitwise equal, {len(meta['outside_meta'])} "
              f"left on meta, replay peak {meta['peak_temp_bytes']} B")
    assert "lm_head.weight" in suite[2][key]["compared"]  # the last stage's tied copy


@pytest.mark.parametrize("key", ["meta-init-train", "meta-init-train-tp"])
def test_meta_init_trains_like_one_process(suite, references, key):
    got = suite[0][key]
    diff = _max_diff(got["params"], references["gpt"]["params"])
    print(f"gpt {'pp 2 x tp 2' if key.endswith('tp') else 'pp 2 x shard 2'} stage 3 init=meta, {w.STEPS} steps: "
          f"max abs param diff vs one process {diff:.2e} ({suite[0]['times'][key]:.1f} s)")
    assert diff <= 1e-5


def test_a_pretrained_folder_is_read_stage_by_stage(suite):
    """A save_pretrained Llama (tied head) at pp 2 x shard 2 stage 3: each rank reads only its stage's
    shard of the files (the last stage's head copy under the embedding's name), bitwise transformers'
    own load, and the other stage's params never get storage."""
    for rank, got in enumerate(suite):
        folder = got["pretrained-folder"]
        assert folder["mismatched"] == [] and folder["outside_meta"] and all(folder["outside_meta"])
        assert folder["bytes_read"] == folder["bytes_held"] < folder["folder_bytes"] / 2
        print(f"rank {rank}: read {folder['bytes_read']} of the folder's {folder['folder_bytes']} B, "
              f"{len(folder['compared'])} stage params bitwise")
    assert suite[2]["pretrained-folder"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" in suite[2]["pretrained-folder"]["compared"]


@pytest.mark.parametrize("case", w.CHECKPOINTING_CASES, ids=[f"stage{s}-{sch}-{pol}" for _, s, sch, pol in
                                                             w.CHECKPOINTING_CASES])
def test_activation_checkpointing_inside_each_stage_matches_single_process(suite, references, case):
    name, stage, schedule, policy = case
    key = ("checkpointing", stage, schedule, policy)
    got = suite[0][key]
    _assert_matches_one_process(got, references[name], f"{name} pp 2 x shard 2 stage {stage} {schedule} "
                                f"checkpointing={policy}", suite[0]["times"][key])
    for rank in suite:  # every microbatch's first block ran twice a step: forward, then its recompute
        assert rank[key]["block_runs"] == 2 * rank[key]["microbatches"] * w.STEPS


@pytest.mark.parametrize("case", w.OFFLOAD_CASES, ids=[f"stage{s}-{sch}" for _, s, sch in w.OFFLOAD_CASES])
def test_cpu_offload_inside_each_stage_matches_single_process(suite, references, case):
    name, stage, schedule = case
    key = ("offload", stage, schedule)
    got = suite[0][key]
    _assert_matches_one_process(got, references[name], f"{name} pp 2 x shard 2 stage {stage} {schedule} offload=cpu",
                                suite[0]["times"][key])
    assert all(all(rank[key]["offloaded"]) for rank in suite)  # every stage's engine keeps its masters on the host


@pytest.mark.parametrize("case", w.COMPILE_CASES, ids=[f"{n}-stage{s}-{sch}-tp{tp}" for n, s, sch, tp in w.COMPILE_CASES])
def test_compiled_block_forwards_inside_each_stage_match_single_process_and_eager(suite, references, case):
    name, stage, schedule, tp = case
    key = ("compile", *case[1:3], name, tp)
    got, eager = suite[0][key], suite[0][(name, stage, schedule) if tp == 1 else "pp-tp"]
    _assert_matches_one_process(got, references[name], f"{name} pp 2 x {'tp' if tp > 1 else 'shard'} 2 stage {stage} "
                                f"{schedule} compiled (aot_eager)", suite[0]["times"][key])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], eager["losses"]))
    print(f"  max |loss compiled - eager| {loss_diff:.2e}, graphs per rank {[rank[key]['graphs'] for rank in suite]}")
    assert loss_diff <= 1e-5
    assert all(rank[key]["graphs"] >= 1 for rank in suite), "a stage's blocks fell back to eager"
    assert all(rank[key]["counts"] == rank[(name, stage, schedule) if tp == 1 else "pp-tp"]["counts"] for rank in suite)
    if tp > 1:  # the tp all-reduces inside the compiled blocks, as many as eager
        assert all(rank[key]["tp_counts"] == rank["pp-tp"]["tp_counts"] and rank[key]["tp_counts"] for rank in suite)


@pytest.mark.parametrize("case", w.QUANT_CASES, ids=[f"stage{s}-{sch}-{gr}-{q}" for _, s, sch, gr, q in w.QUANT_CASES])
def test_comm_quant_inside_each_stage_tracks_the_unquantized_run(suite, case):
    """The stage's int8 wire (qwZ weights at stage 3, qgZ grads at stages 2-3) under the pipeline: the
    same tolerances as without one (tests/distributed/test_quant_comm.py) against the same pipeline
    with fp32 comm, fewer bytes on the stage's shard group, and the tied head still the owner's bits."""
    name, stage, schedule, grad_reduce, quant = case
    got = suite[0][("comm_quant", stage, schedule, grad_reduce, quant)]
    twin = suite[0][(name, stage, schedule)] if grad_reduce == "step" else suite[0][(name, stage, schedule, grad_reduce)]
    diffs = [abs(a - b) for a, b in zip(got["losses"], twin["losses"])]
    wire = {k: v for k, v in got["bytes"][1].items() if k.startswith("shard:")}
    plain = {k: v for k, v in twin["bytes"][1].items() if k.startswith("shard:")}
    print(f"{name} pp 2 x shard 2 stage {stage} {schedule} pp_grad_reduce={grad_reduce} comm_quant={quant}: loss vs "
          f"fp32 comm first {diffs[0]:.2e}, max {max(diffs):.2e}; shard-group bytes/step {sum(wire.values())} vs "
          f"{sum(plain.values())}")
    assert diffs[0] < 5e-3 and max(diffs) < 2e-2
    assert got["losses"][-1] < got["losses"][0]  # it trains
    assert _max_diff(got["params"], twin["params"]) > 0  # the int8 wire really changed the numerics
    if quant == "weights":
        assert wire["shard:all_gather:forward"] < 0.5 * plain["shard:all_gather:forward"]
    else:
        assert wire["shard:all_to_all:backward"] > 0
        assert wire["shard:reduce_scatter:backward"] < plain["shard:reduce_scatter:backward"]
    owner, copy = got["tied"][0]
    assert (got["params"][owner] == got["params"][copy]).all()


GRAD_QUANT_CASES = [c for c in w.QUANT_CASES if c[4] == "grads"]


@pytest.mark.parametrize("case", GRAD_QUANT_CASES, ids=[f"stage{s}-{sch}-{gr}-{q}" for _, s, sch, gr, q in
                                                        GRAD_QUANT_CASES])
def test_planned_quantized_grad_traffic_equals_the_ledger(suite, case):
    """plan --pp --comm-quant grads: the bytes per step of the stage's int8 all-to-all and of the
    reduce-scatters left unquantized are the ledger's (as test_planned_reduce_scatters_equal_the_ledger)."""
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.pipeline import plan_pipeline
    from zeroshard.tools.planner.spec import STAGE_NAMES

    name, stage, schedule, grad_reduce, quant = case
    cfg = w.config(name, stage, schedule, grad_reduce, comm_quant=quant)
    pplan = plan_pipeline(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size), world=w.WORLD, pp=cfg.pp,
                          pp_schedule=cfg.pp_schedule, batch=cfg.batch, seq=cfg.seq_len, device="cpu",
                          stage=cfg.stage, pp_grad_reduce=grad_reduce, comm_quant=quant)
    keys = ("shard:all_to_all:backward", "shard:reduce_scatter:backward")
    for rank in suite:
        layout = pplan.ranks[rank["mesh"]["pp_rank"]].plan[STAGE_NAMES[cfg.stage]]
        planned: dict[str, int] = {}
        for c in layout.collectives:
            key = f"{c.group}:{c.op}:{c.phase}"
            planned[key] = planned.get(key, 0) + c.buffer_bytes * c.count
        got = rank[("comm_quant", stage, schedule, grad_reduce, quant)]["bytes"][1]
        assert {k: got.get(k, 0) for k in keys} == {k: planned.get(k, 0) for k in keys}, rank["mesh"]


# -- pp x ep: experts split over ep inside each pipeline stage -----------------------------------

@pytest.fixture(scope="module")
def ep_references():
    """One process per model, its global batch cut into the pipeline's 4 microbatches (tiny-moe's
    load-balancing loss is defined per microbatch), the same for both schedules."""
    out = {}
    for name in ("moe", "mixtral"):
        cfg = w.ep_config(name, 0)
        out[name] = reference_train(cfg, model=w.mixtral(cfg) if name == "mixtral" else None)
    return out


@pytest.mark.parametrize("case", w.EP_CASES, ids=[f"{n}-stage{s}-{sch}" for n, s, sch in w.EP_CASES])
def test_pipeline_with_expert_parallel_stages_matches_single_process(suite, ep_references, case):
    got = suite[0][("ep",) + case]
    _assert_matches_one_process(got, ep_references[case[0]], f"{case[0]} pp 2 x ep 2 (shard 2, edp 1) stage "
                                f"{case[1]} {case[2]}", suite[0]["times"][("ep",) + case])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ep_references[case[0]]["losses"], strict=True))
    print(f"  losses within {loss_diff:.2e} of one process")
    assert loss_diff <= 1e-5
    assert all(other[("ep",) + case]["losses"] == got["losses"] for other in suite[1:])


@pytest.mark.parametrize("name", ["moe", "mixtral"])
def test_pipeline_with_expert_parallel_clips_by_the_norm_of_every_param_once(suite, ep_references, name):
    """The norm each step clipped by, summed over dense and expert shards inside each stage and then
    over pp, is torch's over the unsplit model's grads; and the cases do clip."""
    ref = ep_references[name]["norms"]
    assert max(ref) > w.ep_config(name, 3).clip, "the case must clip to check the norm"
    for case in [c for c in w.EP_CASES if c[0] == name]:
        got = suite[0][("ep",) + case]["norms"]
        rel = max(abs(a - b) / b for a, b in zip(got, ref, strict=True))
        print(f"{case}: grad norms {[round(n, 4) for n in got[:3]]}..., max relative diff vs one process {rel:.1e}")
        assert rel <= 1e-5


def test_pipeline_with_expert_parallel_stages_1_to_3_are_bitwise_its_stage_0(suite):
    """Experts over edp 1 are not reduced at all and dense params over a shard group of 2 (one
    commutative add): ZeRO inside the pp x ep pipeline changes no bit against DDP inside it."""
    base = suite[0][("ep", "moe", 0, "1f1b")]["params"]
    for stage in (1, 2, 3):
        got = suite[0][("ep", "moe", stage, "1f1b")]["params"]
        assert all((got[k] == base[k]).all() for k in base), stage


@pytest.mark.parametrize("case", w.EP_CASES, ids=[f"{n}-stage{s}-{sch}" for n, s, sch in w.EP_CASES])
def test_pipeline_all_to_all_bytes_are_the_routing_counts_of_the_stage(suite, case):
    """On every rank and step the ledger's ep all-to-alls carry exactly what its routing counts say
    (counts, rows there and back, forward and backward), named by the stage's own MoE layers, and
    tokens really cross the stage's two ranks."""
    for rank in suite:
        got = rank[("ep",) + case]
        assert all(s["ledger"] == s["routed"] > 0 and s["received"] > 0 for s in got["a2a"])
        assert all(s["units"] == got["moe_layers"] for s in got["a2a"])
        stages = got["stages"]  # the blocks this rank's stages hold, and only theirs
        blocks = [b for s in stages for b in range(4 // got["num_stages"] * s, 4 // got["num_stages"] * (s + 1))]
        assert sorted(int(u.split(".")[-3]) for u in got["moe_layers"]) == blocks
        assert all(b.get("pp:send:forward", 0) + b.get("pp:recv:forward", 0) > 0 for b in got["bytes"])
    print(f"{case}: ep all-to-all bytes of step 1 on each rank "
          f"{[(r[('ep',) + case]['a2a'][0]['ledger']) for r in suite]}, from the routing counts alike")


def test_the_expert_mesh_lies_inside_each_stage(suite):
    """pp 2 x ep 2 at world 4: a stage's 2 consecutive ranks are its ep group (edp 1), the dense
    params sharded over both; the pp dim stays outermost."""
    meshes = [r["ppep-mesh"] for r in suite]
    assert [m["ep_rank"] for m in meshes] == [0, 1, 0, 1] and [m["edp_rank"] for m in meshes] == [0, 0, 0, 0]
    assert all(m["experts"]["world"] == 2 and m["experts"]["ep_size"] == 2 and m["experts"]["edp_size"] == 1
               for m in meshes)
    assert all(m["dense"]["pp_size"] == 2 and m["dense"]["shard_size"] == 2 and m["dense"]["ep_size"] == 2
               for m in meshes)


def test_tiny_moe_without_ep_keeps_its_load_balancing_loss_under_pp(suite, ep_references):
    """pp 2 x shard 2 at ep 1 (every rank holds every expert): each stage still backpropagates its
    own layers' load-balancing terms, with the routing counts summed over the stage's ranks."""
    got = suite[0]["moe-ep1"]
    _assert_matches_one_process(got, ep_references["moe"], "tiny-moe pp 2 x shard 2 (ep 1) stage 3 1f1b",
                                suite[0]["times"]["moe-ep1"])
    assert max(abs(a - b) for a, b in zip(got["losses"], ep_references["moe"]["losses"], strict=True)) <= 1e-5
    assert "a2a" not in got  # no expert parallelism: no all-to-all


def test_tiny_moe_load_balancing_loss_is_in_the_pipelines_loss(suite, ep_references):
    """Each stage backpropagates its own layers' load-balancing terms: the pp x ep losses match a
    reference with the loss, which sits well above the same model's without it."""
    import dataclasses

    import torch

    from zeroshard.models import GPT, GPTConfig

    cfg = dataclasses.replace(w.ep_config("moe", 3), steps=2)
    torch.manual_seed(cfg.seed)
    plain = GPT(GPTConfig.named("tiny-moe", vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, aux_loss_coef=0.0))
    without = reference_train(cfg, model=plain)["losses"]
    with_aux = ep_references["moe"]["losses"][:2]
    got = suite[0][("ep", "moe", 3, "1f1b")]["losses"][:2]
    gaps = [a - b for a, b in zip(with_aux, without, strict=True)]
    print(f"tiny-moe: the load-balancing loss adds {gaps[0]:.4f}, {gaps[1]:.4f}; pp x ep is "
          f"{max(abs(a - b) for a, b in zip(got, with_aux)):.1e} from the reference with it")
    assert min(gaps) > 1e-2
    assert max(abs(a - b) for a, b in zip(got, with_aux)) <= 1e-5


def test_a_mixtral_folder_trains_at_pp_2_x_ep_2_like_one_process(suite, moe_folder):
    """A save_pretrained Mixtral folder at pp 2 x ep 2 stage 3: built on meta, each stage reads its
    blocks and its ep block of their experts; 3 steps then match one process."""
    got = suite[0]["ep-folder"]
    ref = reference_train(w.moe_folder_config(moe_folder))
    diff, loss = _max_diff(got["params"], ref["params"]), max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"mixtral folder pp 2 x ep 2 stage 3, {w.MOE_FOLDER_STEPS} steps: max abs param diff vs one process "
          f"{diff:.2e}, losses {loss:.2e} ({suite[0]['times']['ep-folder']:.1f} s)")
    assert diff <= 1e-5 and loss <= 1e-5
    assert all(s["ledger"] == s["routed"] > 0 for r in suite for s in r["ep-folder"]["a2a"])


def test_meta_init_at_pp_2_x_ep_2_trains_bitwise_like_a_plain_build(suite, ep_references):
    """init="meta" at pp 2 x ep 2 stage 3: the replay draws another stage's split experts at their
    stacked shape, so the kept values and the 10 steps after are bitwise the plain build's run."""
    got, plain = suite[0]["ep-meta"], suite[0][("ep", "moe", 3, "1f1b")]
    diff = _max_diff(got["params"], ep_references["moe"]["params"])
    print(f"tiny-moe pp 2 x ep 2 stage 3 init=meta, {w.STEPS} steps: max abs param diff vs one process {diff:.2e} "
          f"({suite[0]['times']['ep-meta']:.1f} s)")
    assert diff <= 1e-5
    assert all((got["params"][k] == plain["params"][k]).all() for k in plain["params"])

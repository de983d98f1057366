"""Tensor parallelism composed with ZeRO: world 4 = 2 shard x 2 tp, against one process.

One spawned world-4 group runs every case (tp_workloads.CASES: GPT and Llama, stages 0-3, with
and without sequence parallelism; tp_workloads.META_CASES: the same built on the meta device);
the tests below read its results.
"""

from __future__ import annotations

import pytest
import torch

import tp_workloads as w
import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPTConfig

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)
PARITY = [pytest.param(case[:3], id=f"{case[0]}-stage{case[1]}{'-sp' if case[2] else ''}") for case in w.CASES]


@pytest.fixture(scope="module")
def suite():
    return spawn(w.suite, 4, timeout_s=900)


@pytest.fixture(scope="module")
def references():
    return {(name, steps): w.reference_run(name, steps) for name in w.MODELS
            for steps in sorted({c[3] for c in w.CASES if c[0] == name} | {w.META_STEPS})}


@pytest.mark.parametrize("key", PARITY)
def test_tp_matches_single_process(suite, references, key):
    name, stage, sp = key
    steps = next(c[3] for c in w.CASES if c[:3] == key)
    got, ref = suite[0]["params"][key], references[(name, steps)]
    assert set(got) == set(ref)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    print(f"{name} 2 shard x 2 tp stage {stage}{' sequence-parallel' if sp else ''}, {steps} steps: "
          f"max abs param diff vs one process {diff:.2e}")
    assert diff <= 1e-5
    # Every rank ends with the same full model (tp parts reassembled, shards gathered).
    for other in suite[1:]:
        assert all((other["params"][key][k] - got[k]).abs().max().item() == 0 for k in got)


@pytest.mark.parametrize("key", w.META_CASES, ids=[f"{n}-stage{s}" for n, s in w.META_CASES])
def test_meta_build_then_tp_then_shard_starts_from_the_single_process_weights(suite, references, key):
    """Built on meta, parallelised there, materialised by zs.shard: every rank's tp part of every
    param is cut from the replayed full param, so the gathered weights are bitwise a plain
    ``torch.manual_seed(s); Model(cfg)``; training from them stays within the TP tolerance."""
    name, stage = key
    got = suite[0]["meta"][key]
    plain = w.reference_run(name, 0)
    assert set(got["built"]) == set(plain)
    assert all(torch.equal(got["built"][k], plain[k]) for k in plain)
    assert got["init_stats"]["path"] == "meta"
    # One full param at a time: the largest one, not its tp part.
    assert got["init_stats"]["peak_temp_bytes"] == max(v.numel() * v.element_size() for v in plain.values())
    ref = references[(name, w.META_STEPS)]
    diff = max((got["trained"][k] - ref[k]).abs().max().item() for k in ref)
    print(f"{name} meta-built 2 shard x 2 tp stage {stage}, {w.META_STEPS} steps: max abs param diff vs one process "
          f"{diff:.2e}")
    assert diff <= 1e-5
    for other in suite[1:]:
        assert all(torch.equal(other["meta"][key]["built"][k], got["built"][k]) for k in plain)


def test_mesh_is_named_with_tp_innermost(suite):
    assert suite[0]["mesh"]["tp_size"] == 2 and suite[0]["mesh"]["shard_size"] == 2
    assert suite[0]["mesh"]["replicate_size"] == 1


def _tp_theory(led: dict, sp: bool) -> dict[str, int]:
    act, layers = led["activation_bytes"], led["layers"]
    if not sp:
        # Per block one all-reduce of the (batch/dp, seq, hidden) activation after each row-wise
        # linear in forward, and one of the input grad of each column-wise group in backward.
        return {"all_reduce:tp:forward": 2 * layers * act, "all_reduce:tp:backward": 2 * layers * act}
    # Sequence parallel: each all-reduce becomes a reduce-scatter (row-wise output, column-wise
    # input grad) plus an all-gather (column-wise input, row-wise output grad); the stream is
    # gathered once more after the last block (forward) and before the first (backward); each
    # norm's weight/bias grad is a partial sum over the ranks' sequence parts: all-reduced.
    return {"all_gather:tp:forward": (2 * layers + 1) * act, "all_gather:tp:backward": (2 * layers + 1) * act,
            "reduce_scatter:tp:forward": 2 * layers * act, "reduce_scatter:tp:backward": 2 * layers * act,
            "all_reduce:tp:backward": led["norm_bytes"]}


@pytest.mark.parametrize("key", PARITY)
def test_ledger_bytes_per_dim_equal_theory(suite, key):
    name, stage, sp = key
    led = suite[0]["ledger"][key]
    padded = led["padded_bytes"]
    theory = _tp_theory(led, sp)
    theory["all_reduce:tp:clip"] = 8  # the tp-sharded params' squared norm, one float64
    # ZeRO moves the tp-local flat buffers, as it would without TP.
    if stage == 0:
        theory["all_reduce:dp:backward"] = padded  # DDP over the data-parallel ranks (same tp index)
    else:
        theory["reduce_scatter:shard:backward"] = padded
        theory["all_reduce:shard:clip"] = 16  # two float64 partial sums
    if stage in (1, 2):
        theory["all_gather:shard:param_sync"] = padded
    if stage == 3:
        theory["all_gather:shard:forward"] = padded
        theory["all_gather:shard:backward"] = padded - led["root_bytes"] - led["kept_bytes"]
    assert led["by_key"] == theory


def test_tp_degree_or_sp_length_that_does_not_divide_is_one_clear_line(suite):
    errors = suite[0]["errors"]
    assert "tp=2 does not divide n_head=3" in errors["heads"]
    assert "tp=4 does not divide num_key_value_heads=2" in errors["kv_heads"]
    assert "tp=2 does not divide intermediate_size=91" in errors["hidden"]
    for name in ("gpt", "llama"):  # sequence parallelism on a length tp does not divide
        assert f"length is {w.SEQ_LEN - 1}; pad or crop sequences to a multiple of 2" in errors[f"sp_{name}"]
    assert all("\n" not in e for e in errors.values())


def test_mesh_shape_must_cover_the_world():
    try:
        with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) covers 4 ranks but the world has 1"):
            zs.init(mesh_shape=(2, 2), names=("shard", "tp"))
    finally:
        zs.shutdown()


def _plan(stage: int, sp: bool = False):
    cfg = GPTConfig.named("tiny", seq_len=w.SEQ_LEN, vocab_size=w.dataset().vocab_size)
    return zs.plan(cfg, world=4, tp=2, stage=stage, batch=w.GLOBAL_BATCH, seq=w.SEQ_LEN, device="cpu",
                   sequence_parallel=sp)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_model_states_at_2x2_within_ten_percent(suite, stage):
    """The planner's per-rank params, grads, masters and optimizer state at (shard 2, tp 2) against
    the storages a tensor-parallel run holds (zeroshard/tools/planner/tp.py splits what the runtime splits)."""
    measured = suite[0]["model_states"][("gpt", stage, False)]
    layout = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]
    predicted = _plan(stage)[layout].device
    for part in ("params", "grads", "master", "optimizer"):
        print(f"stage {stage} {part}: planned {getattr(predicted, part):,} measured {measured[part]:,}")
    total = sum(measured[p] for p in ("params", "grads", "master", "optimizer"))
    error = abs(predicted.model_states - total) / total
    print(f"stage {stage}: model states planned {predicted.model_states:,} measured {total:,} ({error:.1%})")
    assert error <= 0.10


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_planner_tp_comm_and_activations_equal_the_runtime(suite, sp):
    """The planner's tp collectives per step (bytes per buffer x count) equal the ledger's tp bytes,
    and its activations per rank equal what autograd saves in the tensor-parallel forward."""
    for stage in (1, 3) if sp else (1, 2, 3):
        plan = _plan(stage, sp)
        layout = {1: "zero1", 2: "zero2", 3: "zero3"}[stage]
        planned: dict[str, int] = {}
        for c in plan[layout].collectives:
            if c.group == "tp":
                planned[c.op] = planned.get(c.op, 0) + c.buffer_bytes * c.count
        measured: dict[str, int] = {}
        for key, value in suite[0]["ledger"][("gpt", stage, sp)]["by_key"].items():
            op, group, phase = key.split(":")
            if group == "tp" and phase != "clip":  # the clip's 8-byte norm is not a layer's traffic
                measured[op] = measured.get(op, 0) + value
        print(f"stage {stage} sp={sp}: tp bytes per step planned {planned} measured {measured}")
        assert planned == measured
    acts = _plan(1, sp).activations
    assert acts is not None
    print(f"sp={sp}: activations per rank planned {acts.saved:,} measured {suite[0]['activations'][sp]:,}")
    assert acts.saved == suite[0]["activations"][sp]


# -- the command line's path: `zeroshard train --tp 2`, `zeroshard plan [--time] --tp 2` ------------
@pytest.fixture(scope="module")
def cli_suite():
    return spawn(w.cli_suite, 4, timeout_s=900)


def _cli_json(capsys, argv: list[str]) -> dict:
    import json

    from zeroshard.cli.main import main

    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("keys", w.CLI_CASES, ids=lambda k: "-".join(f"{a}{b}" for a, b in sorted(k.items())))
def test_cli_tp_bytes_planned_and_simulated_equal_the_ledger(cli_suite, capsys, keys):
    """A TrainConfig with tp=2 (what `zeroshard train --tp 2` runs, at shard 2 x tp 2 on 4 gloo ranks)
    records in its ledger exactly the tp all-reduce bytes per step that `zeroshard plan --tp 2`
    (the memory planner's collectives) and `zeroshard plan --time --tp 2` (the simulator) predict."""
    cfg = TrainConfig(**{**w.CLI_BASE, **keys})
    got = cli_suite[0][tuple(sorted(keys.items()))]
    assert (got["tp_size"], got["dp_size"]) == (2, 2)
    measured = {k: v for k, v in got["by_key"].items() if k.split(":")[1] == "tp" and not k.endswith(":clip")}
    assert set(measured) == {"all_reduce:tp:forward", "all_reduce:tp:backward"}  # the blocks were split
    same = ["--model", cfg.model, "--vocab-size", str(cfg.vocab_size), "--seq", str(cfg.seq_len), "--world",
            str(cfg.nproc), "--tp", str(cfg.tp), "--stage", str(cfg.stage), "--mp", cfg.mp, "--accum", str(cfg.accum),
            "--checkpointing", cfg.engine.checkpointing, "--json"]
    layout = {1: "zero1", 2: "zero2", 3: "zero3"}[cfg.stage]
    planned = sum(c["buffer_bytes"] * c["count"] for c in _cli_json(capsys, ["plan", "--batch", str(cfg.batch),
                                                                             "--device", "cpu", *same])
                  ["layouts"][layout]["collectives"] if c["group"] == "tp")
    (row,) = _cli_json(capsys, ["plan", "--time", "--batch", str(cfg.batch), *same])["rows"]
    assert (row["tp"], row["stage"]) == (2, cfg.stage)
    ledger = sum(measured.values())
    # Per block and micro-step 2 all-reduces in forward and 2 in backward, each of the micro-batch's
    # activations (batch / dp / accum x seq x width x fp32); a checkpoint's rebuild runs the forward's
    # again but the segment's last (torch's early stop: nothing saves that output).
    gpt = GPTConfig.named(cfg.model)
    per_op = cfg.batch // 2 // cfg.accum * cfg.seq_len * gpt.n_embd * 4
    segments = {"none": 0, "all": gpt.n_layer, "every:2": gpt.n_layer // 2}[cfg.engine.checkpointing]
    rebuilt = 2 * gpt.n_layer - segments if segments else 0
    theory = cfg.accum * (4 * gpt.n_layer + rebuilt) * per_op
    print(f"stage {cfg.stage} accum {cfg.accum} ckpt {cfg.engine.checkpointing}: tp bytes per step ledger {ledger:,} "
          f"planned {planned:,} simulated {row['tp_bytes']:,.0f} theory {theory:,}")
    assert ledger == planned == row["tp_bytes"] == theory

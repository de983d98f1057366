"""Tensor parallelism composed with ZeRO: world 4 = 2 shard x 2 tp, against one process."""

from __future__ import annotations

import pytest

import tp_workloads as w
import zeroshard as zs
from zeroshard.launch import spawn


# One spawned world-4 group per model (each well inside the per-test timeout on a loaded machine).
pytestmark = pytest.mark.timeout(600)
_RUNS: dict[str, list] = {}


def _suite(name: str) -> list:
    if name not in _RUNS:
        _RUNS[name] = spawn(w.suite, 4, ((name,),), timeout_s=900)
    return _RUNS[name]


@pytest.fixture(scope="module")
def suite():
    return _suite("gpt")


@pytest.fixture(scope="module")
def references():
    return {name: w.reference_run(name) for name in w.MODELS}


@pytest.mark.parametrize("name", w.MODELS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp_matches_single_process(references, name, stage):
    suite = _suite(name)
    got, ref = suite[0]["params"][(name, stage)], references[name]
    assert set(got) == set(ref)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    print(f"{name} 2 shard x 2 tp stage {stage}: max abs param diff vs one process {diff:.2e}")
    assert diff <= 1e-5
    # Every rank ends with the same full model (tp parts reassembled, shards gathered).
    for other in suite[1:]:
        assert all((other["params"][(name, stage)][k] - got[k]).abs().max().item() == 0 for k in got)


def test_mesh_is_named_with_tp_innermost(suite):
    assert suite[0]["mesh"]["tp_size"] == 2 and suite[0]["mesh"]["shard_size"] == 2
    assert suite[0]["mesh"]["replicate_size"] == 1


@pytest.mark.parametrize("name", w.MODELS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ledger_bytes_per_dim_equal_theory(name, stage):
    led = _suite(name)[0]["ledger"][(name, stage)]
    by, act, layers, padded = led["by_key"], led["activation_bytes"], led["layers"], led["padded_bytes"]
    # TP: per block one all-reduce of the (batch/dp, seq, hidden) activation after each row-wise
    # linear in forward, and one of the input grad of each column-wise group in backward.
    theory = {"all_reduce:tp:forward": 2 * layers * act, "all_reduce:tp:backward": 2 * layers * act,
              "all_reduce:tp:clip": 8}  # the tp-sharded params' squared norm, one float64
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
    assert by == theory


def test_tp_degree_that_does_not_divide_is_one_clear_line(suite):
    errors = suite[0]["errors"]
    assert "tp=2 does not divide n_head=3" in errors["heads"]
    assert "tp=4 does not divide num_key_value_heads=2" in errors["kv_heads"]
    assert "tp=2 does not divide intermediate_size=91" in errors["hidden"]
    assert all("\n" not in e for e in errors.values())


def test_mesh_shape_must_cover_the_world():
    try:
        with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) covers 4 ranks but the world has 1"):
            zs.init(mesh_shape=(2, 2), names=("shard", "tp"))
    finally:
        zs.shutdown()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_model_states_at_2x2_within_ten_percent(stage):
    """The planner's per-rank params, grads, masters and optimizer state at (shard 2, tp 2) against
    the storages a tensor-parallel run holds (zeroshard/plan/tp.py splits what the runtime splits)."""
    from zeroshard.models import GPTConfig

    measured = _suite("gpt")[0]["model_states"][("gpt", stage)]
    cfg = GPTConfig.named("tiny", seq_len=w.SEQ_LEN, vocab_size=w.dataset().vocab_size)
    plan = zs.plan(cfg, world=4, tp=2, stage=stage, batch=w.GLOBAL_BATCH, seq=w.SEQ_LEN, device="cpu")
    layout = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]
    predicted = plan[layout].device
    for part in ("params", "grads", "master", "optimizer"):
        print(f"stage {stage} {part}: planned {getattr(predicted, part):,} measured {measured[part]:,}")
    total = sum(measured[p] for p in ("params", "grads", "master", "optimizer"))
    error = abs(predicted.model_states - total) / total
    print(f"stage {stage}: model states planned {predicted.model_states:,} measured {total:,} ({error:.1%})")
    assert error <= 0.10

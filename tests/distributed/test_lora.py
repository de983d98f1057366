"""LoRA (peft adapters on a frozen base) at stages 0-3 on 2 ranks against one process: the adapters
train the same, the base stays as it was and is held only in its compute dtype, with no grad or
optimizer state."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

import lora_workloads as lw  # noqa: E402
from zeroshard.trainer.config import TrainConfig  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402
from zeroshard.trainer.train import reference_train  # noqa: E402

PARAM_TOL = 1e-5


def _cfg(stage: int, **kw) -> TrainConfig:
    return TrainConfig(model="tiny", stage=stage, nproc=2, steps=4, batch=8, seq_len=32, warmup=0, lr=1e-2,
                       min_lr=1e-2, lora_r=4, lora_alpha=8.0, lora_targets="qkv,fc", dropout=False, **kw)


@pytest.fixture(scope="module")
def runs():
    cfgs = {stage: _cfg(stage) for stage in range(4)}
    cfgs["bf16-3"] = _cfg(3, mp="bf16")
    return spawn(lw.lora_suite, 2, args=(cfgs,), timeout_s=420)[0]


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_matches_one_process(runs, stage):
    ref = reference_train(_cfg(stage))
    run = runs[stage]
    diff = _diff(run["params"], ref["params"])
    adapters = [k for k in ref["params"] if "lora_" in k]
    base_diff = max((ref["params"][k] - run["params"][k]).abs().max().item() for k in ref["params"] if "lora_" not in k)
    print(f"stage {stage}: max|param - single| = {diff:.3e} over {len(ref['params'])} tensors "
          f"({len(adapters)} adapters)")
    assert diff <= PARAM_TOL
    assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= 1e-5
    assert _diff(run["params"], runs[0]["params"]) == 0.0, "stages 1-3 bitwise equal to stage 0 on 2 ranks"
    assert base_diff == 0.0 and len(adapters) == 16  # 4 blocks x (qkv, fc) x (A, B)
    assert run["losses"][-1] < run["losses"][0] - 0.05, "the adapters must actually train"


def test_frozen_base_holds_weights_only(runs):
    import torch

    from zeroshard.trainer.step import build_model

    base = build_model(_cfg(3).replace(lora_r=0), 16, torch.device("cpu"), allow_meta=False)
    frozen = sum(p.numel() for p in {id(p): p for p in base.parameters()}.values())
    for key, dtype in ((3, "torch.float32"), ("bf16-3", "torch.bfloat16")):
        run = runs[key]
        assert run["frozen_dtypes"] == [dtype] and run["master_dtypes"] == ["torch.float32"], key
        assert run["frozen_grads"] == 0, "no grad buffer for a frozen param"
        # Adam's two moments for the adapters' shard only (and its step counters).
        assert run["optimizer_numel"] == 2 * run["trainable_shard_numel"], key
        assert frozen <= run["frozen_numel"] < frozen * 1.01  # the whole base, padded
    trained = runs["bf16-3"]["losses"]
    assert max(abs(a - b) for a, b in zip(trained, runs[3]["losses"])) < 2e-2 and trained != runs[3]["losses"]

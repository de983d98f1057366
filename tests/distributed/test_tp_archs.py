"""Tensor parallelism derived from transformers' declared plans, on architectures zeroshard has no
line for, and on a model of the user's own through a spec the user writes: each at 2 shard x 2 tp,
stage 3, against one process (what `zeroshard verify --nproc 4 --stage 3 --tp 2` checks).
scripts/arch_matrix.py runs every architecture of tp_arch_workloads.configs()."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import moe_matrix  # noqa: E402
import tp_arch_workloads as w  # noqa: E402
from zeroshard.cli.verify import default_tolerances  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402
from zeroshard.trainer.train import reference_train  # noqa: E402

pytestmark = pytest.mark.timeout(900)
MLA = "deepseek_v2"
"""Latent attention (MLA): its kv_a_proj_with_mqa is whole on every rank, and the rotary key part of its
output, which every rank's heads read, has its grad summed over tp (transformers' 'mla_kv_a_proj')."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-archs")
    return {**w.make_folders(root, w.SUITE), MLA: moe_matrix.make_folder(MLA, root)}


@pytest.fixture(scope="module")
def world4(folders) -> dict:
    # One group of 4 runs every architecture and the user's NanoGPT.
    return spawn(w.suite, 4, args=({k: str(v) for k, v in folders.items()}, True), timeout_s=900)[0]


@pytest.mark.parametrize("name", [*w.SUITE, MLA])
def test_declared_plan_at_tp2_trains_as_one_process_does(world4, folders, name):
    index = json.loads((folders[name] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    run = world4[name]
    assert "refused" not in run, run.get("refused")
    ref = reference_train(w.train_config(str(folders[name])))
    tol, loss_tol = default_tolerances("fp32")[0], 1e-6  # loss: one process within 1e-6
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    assert set(run["params"]) == set(ref["params"])
    param_diff = max((run["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    print(f"{name} 2 shard x 2 tp stage 3: |loss diff| {loss_diff:.2e}, |param diff| {param_diff:.2e}")
    assert loss_diff <= loss_tol and param_diff <= tol


def test_a_users_nanogpt_through_its_own_spec_at_tp2_equals_one_process(world4):
    got, ref = world4["nanoGPT"], w.nano_reference()
    assert set(got) == set(ref)
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    print(f"nanoGPT (user spec) 2 shard x 2 tp stage 3, {w.NANO_STEPS} steps: max abs param diff {diff:.2e}")
    assert diff <= 1e-5

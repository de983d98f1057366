"""FSDP2 <-> zeroshard through torch.distributed.checkpoint, at world 2 in one process group:
an FSDP2 ``fully_shard`` run saved with ``dcp.save`` imports and loads into zeroshard stage 3
bitwise (params and AdamW state), and the export of zeroshard's checkpoint, read back with
``dcp.load`` into a fresh FSDP2 model, is bitwise the original again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dcp_workloads as dw
from zeroshard.trainer.launch import spawn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root: Path = tmp_path_factory.mktemp("dcp")
    return spawn(dw.suite, 2, args=(str(root),), timeout_s=300)[0]


def test_import_records_what_moved(run):
    got = run["imported"]
    assert run["world"] == 2
    assert got["tied"] == {"head.weight": "embed.weight"}, "the tied head is an alias, not a second param"
    assert got["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"]
    assert got["step"] == 2 and run["loaded_step"] == 2
    assert got["ignored"] and all(k.startswith("optim.param_groups.") for k in got["ignored"])


def test_fsdp2_dcp_loads_into_stage3_bitwise(run):
    fsdp, zs_state = run["fsdp"]["model"], run["zeroshard"]
    assert set(zs_state) == set(fsdp)
    for key, value in fsdp.items():
        assert zs_state[key].dtype == value.dtype and torch.equal(zs_state[key], value), key


def test_export_dcp_loads_into_fsdp2_bitwise(run):
    fsdp, back = run["fsdp"], run["back"]
    assert set(back["model"]) == set(fsdp["model"])
    for key, value in fsdp["model"].items():
        assert torch.equal(back["model"][key], value), key
    assert set(back["optim"]) == set(fsdp["optim"])
    for fqn, state in fsdp["optim"].items():
        assert set(back["optim"][fqn]) == set(state) == {"exp_avg", "exp_avg_sq", "step"}
        for name, value in state.items():
            assert torch.equal(back["optim"][fqn][name], value), f"{fqn}.{name}"


def test_the_moved_runs_continue_alike(run):
    """One more AdamW step from the moved state. A lost moment would show as a change of order lr
    (Adam's first step); what remains is reduction order."""
    nxt = run["next"]
    for key, value in nxt["fsdp"].items():
        assert torch.equal(nxt["back"][key], value), f"{key}: FSDP2 -> zeroshard -> FSDP2 steps differently"
        diff = (nxt["zeroshard"][key] - value).abs().max().item()
        print(f"{key}: max |zeroshard - fsdp2| after one more step = {diff:.3e}")
        assert diff <= 1e-6, key

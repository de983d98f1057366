"""Checkpoints keep tensor-parallel placements: save at (2 shard, 2 tp), resume at (4, 1), (1, 1),
(1, 2), directly and after an offline ``ckpt reshard`` to (4, 1) and (1, 2).

One spawned group visits the layouts in turn (tp_workloads.ckpt_suite: world 4 at (2, 2), then
(4, 1), then ranks 0-1 at (1, 2)); the (1, 1) resume runs in this process.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import tp_workloads as w
import zeroshard as zs
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.export import export, reshard
from zeroshard.checkpoint.format import rank_file
from zeroshard.trainer.launch import spawn

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_ckpt")


@pytest.fixture(scope="module")
def suite(root):
    ranks = spawn(w.ckpt_suite, 4, (str(root),), timeout_s=900)
    assert ranks[2] is None and ranks[3] is None  # they left before the (1, 2) part
    return ranks


def _diff(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_manifest_records_tp_placements(root, suite):
    manifest = json.loads((root / "tp" / "manifest.json").read_text())
    parts = {p["fqn"]: p["tp"] for p in manifest["params"] if "tp" in p}
    assert parts["blocks.0.attn.qkv.weight#tp1"] == {
        "placement": "shard", "dim": 0, "chunks": 3, "tp": 2, "of": "blocks.0.attn.qkv.weight", "rank": 1,
        "aliases": ["blocks.0.attn.qkv.weight"], "full_shape": [192, 64]}
    assert parts["blocks.0.attn.proj.weight#tp0"]["dim"] == 1
    assert "blocks.0.ln1.weight" in {p["fqn"] for p in manifest["params"]}  # replicated: saved whole, once
    assert manifest["mesh"]["tp_size"] == 2


@pytest.mark.parametrize("layout, source", [("4x1", "saved at (2,2)"), ("r41", "resharded offline to (4,1)"),
                                            ("r12", "resharded offline to (1,2)"),
                                            ("rt12", "resharded (2,2) -> (4,1) -> (1,2)")])
def test_resume_equals_continuous(suite, layout, source):
    """Loaded params equal the saved ones exactly; the next update (optimizer state, sampler and
    scheduler restored too) equals the continuous run's."""
    saved = suite[0]
    for rank in suite:
        if rank is None:
            continue
        assert _diff(rank[layout]["loaded"], saved["saved"]) == 0
        diff = _diff(rank[layout]["next"], saved["continuous"])
        assert diff <= 1e-5
    print(f"{source}, resumed: next update vs continuous {diff:.2e}")


def test_resharded_layout_is_the_runtimes(suite):
    """Loaded at the saved stage (the same units), each rank of the new layout reads its own rank
    file, plus tp rank 0's for the params every tp rank holds whole: the reshard lays the flat
    groups out as the runtime does."""
    for rank, out in enumerate(suite):
        if out is None:
            continue
        assert out["r41"]["files"] == [rank_file(rank)]
        if rank < 2:
            assert out["r12"]["files"] == sorted({rank_file(0), rank_file(rank)})


def test_round_trip_through_4x1_is_exact(root, suite):
    """(2,2) -> (4,1) -> (1,2) writes the same tensors as (2,2) -> (1,2)."""
    direct = json.loads((root / "r12" / "manifest.json").read_text())
    trip = json.loads((root / "rt12" / "manifest.json").read_text())
    assert direct["params"] == trip["params"] and direct["mesh"] == trip["mesh"]
    for name in direct["files"]:
        a, b = load_file(str(root / "r12" / name)), load_file(str(root / "rt12" / name))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_reshard_to_tp_without_placements_is_one_clear_line(root, suite, tmp_path):
    with pytest.raises(CheckpointError, match=r"saved without tensor parallelism.*--tp-plan gpt or llama\) or --tp 1"):
        reshard(root / "r41", tmp_path / "x", 2, tp=2)
    with pytest.raises(CheckpointError, match=r"tp 3 does not split dim 0 \(192\) of param 'blocks.0.attn.qkv.weight'"):
        reshard(root / "tp", tmp_path / "y", 3, tp=3)


def test_resume_at_1x1_equals_continuous(root, suite):
    zs.init()
    try:
        out = w.ckpt_resume(str(root), "tp", 0)
    finally:
        zs.shutdown()
    assert _diff(out["loaded"], suite[0]["saved"]) == 0
    diff = _diff(out["next"], suite[0]["continuous"])
    print(f"(2,2) saved -> (1,1) resumed: next update vs continuous {diff:.2e}")
    assert diff <= 1e-5


def test_4x1_checkpoint_loads_at_1x2(suite):
    for out in suite[:2]:
        assert _diff(out["dp4 at 1x2"]["loaded"], suite[0]["saved"]) == 0


def test_export_gives_full_tensors(root, suite, tmp_path):
    export(root / "tp", tmp_path / "full.safetensors")
    full = load_file(str(tmp_path / "full.safetensors"))
    assert _diff(full, suite[0]["saved"]) == 0
    assert full["blocks.0.attn.qkv.weight"].shape == torch.Size([192, 64])


def test_plain_model_loads_the_checkpoint_and_its_reshards(root, suite):
    manifest = json.loads((root / "r41" / "manifest.json").read_text())
    assert not any("tp" in p for p in manifest["params"]) and len(manifest["ranks"]) == 4
    for source in ("tp", "r41", "r12"):
        model = w.build("gpt", w.dataset().vocab_size)
        zs.load(root / source, model, rng=False)
        assert _diff({k: v.detach() for k, v in model.state_dict().items()}, suite[0]["saved"]) == 0

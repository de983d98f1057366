"""Checkpoints keep tensor-parallel placements: save at (2 shard, 2 tp), resume at (4, 1), (1, 1), (1, 2)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import tp_workloads as w
import zeroshard as zs
from zeroshard.checkpoint.export import export, reshard
from zeroshard.launch import spawn

pytestmark = pytest.mark.timeout(600)  # a spawned gloo group per layout; slow on a loaded 2-core machine


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp_ckpt")


@pytest.fixture(scope="module")
def saved(root):
    return spawn(w.ckpt_save_suite, 4, (str(root),), timeout_s=600)[0]


@pytest.fixture(scope="module")
def resumed(root, saved):
    return spawn(w.ckpt_resume_suite, 4, (str(root),), timeout_s=600)[0]


def _diff(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_manifest_records_tp_placements(root, saved):
    manifest = json.loads((root / "tp" / "manifest.json").read_text())
    parts = {p["fqn"]: p["tp"] for p in manifest["params"] if "tp" in p}
    assert parts["blocks.0.attn.qkv.weight#tp1"] == {
        "placement": "shard", "dim": 0, "chunks": 3, "tp": 2, "of": "blocks.0.attn.qkv.weight", "rank": 1,
        "aliases": ["blocks.0.attn.qkv.weight"], "full_shape": [192, 64]}
    assert parts["blocks.0.attn.proj.weight#tp0"]["dim"] == 1
    assert "blocks.0.ln1.weight" in {p["fqn"] for p in manifest["params"]}  # replicated: saved whole, once
    assert manifest["mesh"]["tp_size"] == 2


def test_resume_at_4x1_equals_continuous(saved, resumed):
    assert _diff(resumed["loaded"], saved["saved"]) == 0
    diff = _diff(resumed["next"], saved["continuous"])
    print(f"(2,2) saved -> (4,1) stage 3 resumed: next update vs continuous {diff:.2e}")
    assert diff <= 1e-5


def test_resume_at_1x1_equals_continuous(root, saved):
    zs.init()
    try:
        out = w.ckpt_resume(str(root), 0)
    finally:
        zs.shutdown()
    assert _diff(out["loaded"], saved["saved"]) == 0
    diff = _diff(out["next"], saved["continuous"])
    print(f"(2,2) saved -> (1,1) resumed: next update vs continuous {diff:.2e}")
    assert diff <= 1e-5


def test_4x1_checkpoint_loads_at_1x2(root, saved, resumed):
    out = spawn(w.ckpt_back_to_tp_suite, 2, (str(root),), timeout_s=600)[0]
    assert _diff(out["loaded"], saved["saved"]) == 0


def test_export_gives_full_tensors(root, saved, tmp_path):
    export(root / "tp", tmp_path / "full.safetensors")
    full = load_file(str(tmp_path / "full.safetensors"))
    assert _diff(full, saved["saved"]) == 0
    assert full["blocks.0.attn.qkv.weight"].shape == torch.Size([192, 64])


def test_reshard_joins_tp_parts_and_plain_load_reads_either(root, saved, tmp_path):
    resharded = reshard(root / "tp", tmp_path / "dp4", 4)
    manifest = json.loads((resharded / "manifest.json").read_text())
    assert not any("tp" in p for p in manifest["params"]) and len(manifest["ranks"]) == 4
    for source in (root / "tp", resharded):
        model = w.build("gpt", w.dataset().vocab_size)
        zs.load(source, model, rng=False)
        assert _diff({k: v.detach() for k, v in model.state_dict().items()}, saved["saved"]) == 0

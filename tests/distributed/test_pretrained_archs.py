"""Architectures written in other ways than Llama and Qwen2, from save_pretrained folders of small
random configs in >= 3 shards: each trains 3 steps at stage 3 on 2 ranks as the single process
does (what `zeroshard verify` checks), exports a folder from_pretrained opens with no missing or
unexpected keys, and that folder's logits equal the trained model's within 1e-6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import arch_workloads as aw  # noqa: E402
from zeroshard.cli.verify import default_tolerances  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402
from zeroshard.trainer.train import reference_train  # noqa: E402

LOGIT_TOL = 1e-6
NAMES = list(aw.configs())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("archs")


@pytest.fixture(scope="module")
def folders(root) -> dict[str, Path]:
    return aw.make_folders(root)


@pytest.fixture(scope="module")
def world2(folders, root) -> dict:
    return spawn(aw.suite, 2, args=({k: str(v) for k, v in folders.items()}, str(root)), timeout_s=600)[0]


@pytest.mark.parametrize("name", NAMES)
def test_folder_is_sharded_and_trains_as_one_process_does(world2, folders, name):
    index = json.loads((folders[name] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ref = reference_train(aw.train_config(str(folders[name])))
    run = world2[name]
    tol, loss_tol = default_tolerances("fp32")
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True))
    assert set(run["params"]) == set(ref["params"])
    param_diff = max((run["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    print(f"{name}: losses {[round(x, 5) for x in run['losses']]}, |loss diff| {loss_diff:.2e}, "
          f"|param diff| {param_diff:.2e}")
    assert loss_diff <= loss_tol and param_diff <= tol
    assert run["losses"][-1] < run["losses"][0], "three steps must lower the loss"


@pytest.mark.parametrize("name", NAMES)
def test_export_opens_in_from_pretrained_with_the_trained_logits(world2, folders, name):
    out = Path(world2[name]["exported"])
    assert len(list(out.glob("*.safetensors"))) >= 3
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    if name == "buffers":  # from_pretrained leaves the unsaved gain as allocated: set it as the constructor does
        fresh = aw.buffer_model.BufferLM(aw.configs()["buffers"])
        with torch.no_grad():
            for block, built in zip(model.blocks, fresh.blocks):
                block.gain.copy_(built.gain)
    with torch.no_grad():
        logits = model(input_ids=aw.probe()).logits
    diff = (logits - world2[name]["logits"]).abs().max().item()
    print(f"{name}: max|logits(export) - logits(trained)| = {diff:.2e}")
    assert diff <= LOGIT_TOL


def _file_names(folder: Path) -> set[str]:
    return set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])


@pytest.mark.parametrize("name, stored, held", [
    ("gpt_neox", "embed_out.weight", "lm_head.weight"),  # renamed on load
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
])
def test_names_transformers_converts_load_and_export_in_the_folders_layout(world2, folders, name, stored, held):
    """The files keep a layout the model class converts on load (transformers' conversion mapping):
    the trained model holds its own names, the export is written in the folder's."""
    source = _file_names(folders[name])
    assert stored in source and held not in source and held in world2[name]["params"]
    assert _file_names(Path(world2[name]["exported"])) == source


def test_buffers_set_in_init_come_back_as_the_constructor_and_files_give_them(world2, folders):
    """The saved table is read from the files, the unsaved gain is the constructor's: the same
    model a plain build gives, where transformers' from_pretrained leaves the gain uninitialised."""
    from zeroshard.checkpoint.hf.pretrained import build_pretrained

    model = build_pretrained(folders["buffers"])
    fresh = aw.buffer_model.BufferLM(aw.configs()["buffers"])
    for block, built in zip(model.blocks, fresh.blocks):
        assert torch.equal(block.gain, built.gain) and torch.equal(block.position_bias, built.position_bias)

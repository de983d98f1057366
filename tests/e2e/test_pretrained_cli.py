"""The user's path through the CLI: `zeroshard train --model FOLDER` on a folder written by
transformers' save_pretrained, then `zeroshard ckpt export --hf`, opened by from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_cli import read_metrics, run_cli, run_main  # noqa: E402


def tiny_llama(folder: Path) -> None:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="40KB")


def test_train_from_a_folder_then_export_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, ckpt, run_dir, out = tmp_path / "src", tmp_path / "ck", tmp_path / "run", tmp_path / "out"
    tiny_llama(source)
    (source / "tokenizer_config.json").write_text("{}")  # copied along, as a real folder's tokenizer is
    trained = run_cli(["train", "--model", str(source), "--stage", "3", "--nproc", "2", "--steps", "3",
                       "--batch", "4", "--seq-len", "16", "--num-samples", "64", "--save-every", "3",
                       "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir)], env={"HF_HUB_OFFLINE": "1"})
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "pretrained folder" in trained.stdout, "the summary must say where the weights came from"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]

    # Offline, no ranks: in this process, an interpreter start less.
    exported = run_main(["ckpt", "export", str(ckpt), "--hf", str(out), "--max-shard-size", "64KB"], capsys)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    source_model = transformers.AutoModelForCausalLM.from_pretrained(source)
    changed = max((a - b).abs().max().item() for a, b in zip(model.parameters(), source_model.parameters()))
    assert changed > 0, "three steps of training must change the weights"


def test_unknown_architecture_is_one_line_naming_config_json(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    tiny_llama(folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "not-a-model"
    (folder / "config.json").write_text(json.dumps(config))
    result = run_cli(["train", "--model", str(folder), "--nproc", "1", "--steps", "1", "--batch", "2",
                      "--seq-len", "16", "--run-dir", str(tmp_path / "run")], env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if "not-a-model" in ln]
    assert len(lines) == 1 and "config.json" in lines[0], result.stderr

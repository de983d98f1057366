"""`zeroshard generate` on a checkpoint of zeroshard's own GPT (no tokenizer: ids or bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import FAST, run_cli

from zeroshard.checkpoint import resolve
from zeroshard.checkpoint.format import from_json, read_manifest
from zeroshard.cli.main import main
from zeroshard.models.gpt import GPT, GPTConfig


def reference_greedy(model: GPT, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


def test_gpt_checkpoint_generates_like_its_exported_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, run_dir, out = tmp_path / "ck", tmp_path / "run", tmp_path / "full.safetensors"
    trained = run_cli(["train", *FAST, "--nproc", "2", "--stage", "2", "--steps", "2", "--save-every", "2",
                       "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir)])
    assert trained.returncode == 0, trained.stdout + trained.stderr
    args = ["generate", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == first

    assert main(["ckpt", "export", str(ckpt), str(out)]) == 0
    capsys.readouterr()
    record = read_manifest(resolve(ckpt))["model"]
    model = GPT(GPTConfig.from_dict(from_json(record["config"])))
    model.load_state_dict(load_file(out))
    assert first["new_ids"] == reference_greedy(model.eval(), [1, 2, 3], 8)

    sampled = ["generate", str(ckpt), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json",
               "--temperature", "0.8", "--top-k", "4", "--seed", "5"]
    assert main(sampled) == 0
    a = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == a

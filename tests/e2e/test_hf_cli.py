"""`zeroshard train --model hf:...` and `zeroshard verify` on Hugging Face models, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from test_cli import FAST, read_metrics, run_cli, run_main  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1"}  # the configs are built in code; nothing may be fetched


def test_train_hf_gpt2_at_stage3_from_meta_and_export_loads_into_plain_hf_model(tmp_path: Path, capsys) -> None:
    import torch

    from zeroshard.models.hf import build_hf_model

    run_dir, ckpt = tmp_path / "run", tmp_path / "ck"
    proc = run_cli(["train", *FAST[2:], "--model", "hf:gpt2-tiny", "--stage", "3", "--init", "meta", "--nproc", "2",
                    "--steps", "20", "--lr", "3e-3", "--warmup", "3", "--save-every", "20", "--ckpt-dir", str(ckpt),
                    "--run-dir", str(run_dir)], env=OFFLINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hf:gpt2-tiny" in proc.stdout and "meta" in proc.stdout  # the summary's init path
    metrics = read_metrics(run_dir)
    first, last = sum(m["loss"] for m in metrics[:4]) / 4, sum(m["loss"] for m in metrics[-4:]) / 4
    assert last < first - 0.05, f"loss did not fall: {first:.4f} -> {last:.4f}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["name"] == "hf:gpt2-tiny" and config["model"]["hf_config"]["model_type"] == "gpt2"

    out = tmp_path / "full.safetensors"
    exported = run_main(["ckpt", "export", str(ckpt), str(out)], capsys)  # offline, no ranks: in this process
    assert exported.returncode == 0, exported.stdout + exported.stderr
    plain = build_hf_model("hf:gpt2-tiny", vocab_size=config["model"]["hf_config"]["vocab_size"], seq_len=32,
                           seed=0, device=torch.device("cpu"))
    plain.load_state_dict(load_file(out), strict=True)  # the tied head comes back under both names
    assert plain.lm_head.weight is plain.transformer.wte.weight


def test_verify_hf_llama_matches_single_process() -> None:
    # Stage 0 keeps this to one distributed run; every stage's parity is in tests/distributed/test_hf.py.
    proc = run_cli(["verify", "--json", "--model", "hf:llama-tiny", "--stage", "0", "--nproc", "2", "--steps", "6",
                    *FAST[2:]], env=OFFLINE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True and result["model"] == "hf:llama-tiny"
    assert result["max_abs_param_diff_vs_single"] <= 1e-5
    assert result["mismatched_param_names"] == []

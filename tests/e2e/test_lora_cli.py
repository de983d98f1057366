"""LoRA from the command line: train a save_pretrained folder's adapters at stage 3 on 2 ranks, then
export it merged (a folder from_pretrained opens) and as the adapter folder PeftModel.from_pretrained
opens on the base; both give the trained model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_cli import read_metrics, run_cli, run_main  # noqa: E402
from test_pretrained_cli import tiny_llama  # noqa: E402

from zeroshard.trainer.lora import inject_lora  # noqa: E402

LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj"]


def test_lora_train_then_export_merged_and_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, ckpt, run_dir = tmp_path / "src", tmp_path / "ck", tmp_path / "run"
    tiny_llama(source)
    trained = run_cli(["train", "--model", str(source), "--stage", "3", "--nproc", "2", "--steps", "3", "--lr", "1e-2",
                       "--batch", "4", "--seq-len", "16", "--num-samples", "64", "--save-every", "3",
                       "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir), "--no-profile", *LORA],
                      env={"HF_HUB_OFFLINE": "1"})
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    for flag, out in (("--hf", tmp_path / "merged"), ("--adapter", tmp_path / "adapter"),
                      (None, tmp_path / "plain.safetensors")):
        done = run_main(["ckpt", "export", str(ckpt), *([flag] if flag else []), str(out)], capsys)
        assert done.returncode == 0, done.stdout + done.stderr

    # The trained model: the base folder with the same adapters, every param as the checkpoint holds it.
    model = inject_lora(transformers.AutoModelForCausalLM.from_pretrained(source), r=4, alpha=8.0,
                        targets="q_proj,v_proj,down_proj")
    model.load_state_dict(load_file(tmp_path / "plain.safetensors"), strict=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(source)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits
        untrained = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
    print(f"merged {(merged - want).abs().max():.2e}, adapter {(adapted - want).abs().max():.2e}, "
          f"training moved the logits by {(untrained - want).abs().max():.2e}")
    assert (merged - want).abs().max() <= 1e-6
    assert (adapted - want).abs().max() <= 1e-6
    assert (untrained - want).abs().max() > 1e-3, "the adapters must have trained"
    refused = run_main(["ckpt", "export", str(ckpt), "--adapter", str(tmp_path / "a2"), "--hf", str(tmp_path / "m2")],
                       capsys)
    assert refused.returncode == 1 and "give one of OUT, --hf OUT and --adapter OUT" in refused.stderr

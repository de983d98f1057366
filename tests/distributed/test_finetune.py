"""Fine-tuning a save_pretrained folder on a chat file (system turns, multi-turn dialogues), as a
user runs it: `zeroshard train` at stage 3 on 2 ranks with accumulation and held-out evaluation,
equal to one process; and the held-out loss at every stage equal to one process's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from chat_fixtures import dialogues, make_chat_folder, write_jsonl  # noqa: E402

import finetune_workloads as fw  # noqa: E402
from zeroshard.cli.verify import default_tolerances  # noqa: E402
from zeroshard.trainer.evaluate import reference_eval  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402
from zeroshard.trainer.step import build_data  # noqa: E402
from zeroshard.trainer.train import reference_train  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {"folder": make_chat_folder(root), "data": write_jsonl(root / "chat.jsonl", dialogues(32)),
            "eval": write_jsonl(root / "held-out.jsonl", dialogues(7, seed=11)), "root": root}


def _plain(folder: Path, params: dict[str, torch.Tensor] | None = None):
    from zeroshard.checkpoint.hf.pretrained import plain_pretrained

    model = plain_pretrained(str(folder), torch.device("cpu")).eval()
    if params is not None:
        model.load_state_dict(params)
    return model


def test_train_a_folder_on_a_chat_file_at_stage_3_as_one_process_does(files):
    from zeroshard.cli.main import main

    run_dir = files["root"] / "run"
    args = ["train", "--model", str(files["folder"]), "--data", str(files["data"]), "--eval-data", str(files["eval"]),
            "--eval-every", "10", "--stage", "3", "--nproc", "2", "--steps", str(STEPS), "--batch", "4",
            "--accum", "2", "--seq-len", "256", "--lr", "3e-3", "--warmup", "2", "--run-dir", str(run_dir)]
    assert main(args) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    evals = {r["step"]: r["eval_loss"] for r in steps if "eval_loss" in r}
    cfg = fw.TrainConfig(**{k: v for k, v in json.loads((run_dir / "config.json").read_text())["train"].items()})
    ref = reference_train(cfg, _plain(files["folder"]).train())
    eval_ref = reference_eval(_plain(files["folder"], ref["params"]), build_data(cfg, str(files["eval"])))
    _, loss_tol = default_tolerances("fp32")
    loss_diff = max(abs(r["loss"] - x) for r, x in zip(steps, ref["losses"], strict=True))
    print(f"losses {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}, |loss diff| vs one process {loss_diff:.1e}; "
          f"eval {evals}, one process after step {STEPS}: {eval_ref:.6f}")
    assert sorted(evals) == [10, 20] and all(r["eval_perplexity"] > 1 for r in steps if "eval_loss" in r)
    assert loss_diff <= loss_tol and abs(evals[STEPS] - eval_ref) <= loss_tol
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5 and evals[20] < evals[10]


def test_held_out_loss_at_every_stage_equals_one_process_and_packed_steps_match_stage_0(files):
    out = spawn(fw.eval_every_stage, 2, args=(str(files["folder"]), str(files["data"]), str(files["eval"])),
                timeout_s=300)[0]
    cfg = fw.eval_config(str(files["folder"]), str(files["data"]), str(files["eval"]), stage=0)
    ref = reference_eval(_plain(files["folder"]), build_data(cfg, str(files["eval"])))
    trained = {k: out.pop(k) for k in list(out) if k.startswith("train")}
    for stage in (1, 2, 3):  # packed rows, accum 2: stages 1-3 bitwise stage 0
        losses, _, params = trained[f"train{stage}"]
        assert losses == trained["train0"][0] and torch.equal(params, trained["train0"][2])
    print(f"packed training, 2 steps at stages 0-3: losses {trained['train0'][0]} (bitwise equal)")
    diffs = {k: abs(v - ref) for k, v in out.items()}
    print(f"one process {ref:.8f}; |diff| {', '.join(f'{k} {d:.1e}' for k, d in diffs.items())}")
    assert max(diffs.values()) <= 1e-6
    assert out["stage1"] == out["stage2"] == out["stage3"] == out["stage0"]  # bitwise: sharding changes no sum


def test_lora_on_a_chat_file_at_stage_3_trains_only_the_adapters(files):
    """The same chat file with LoRA adapters: the loss falls, the held-out loss is reported, and the
    base model's weights leave the run as they came (only the adapters train)."""
    from zeroshard.checkpoint.hf.pretrained import plain_pretrained
    from zeroshard.cli.main import main

    run_dir, ckpt = files["root"] / "lora-run", files["root"] / "lora-ckpt"
    args = ["train", "--model", str(files["folder"]), "--data", str(files["data"]), "--eval-data", str(files["eval"]),
            "--stage", "3", "--nproc", "2", "--steps", "10", "--batch", "4", "--seq-len", "256", "--lr", "1e-2",
            "--warmup", "1", "--lora-r", "4", "--lora-alpha", "8", "--run-dir", str(run_dir),
            "--save-every", "10", "--ckpt-dir", str(ckpt)]
    assert main(args) == 0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step" in r]
    assert steps[-1]["loss"] < steps[0]["loss"] and any("eval_loss" in r for r in steps)
    merged = files["root"] / "lora-merged"
    assert main(["ckpt", "export", str(ckpt), "--hf", str(merged)]) == 0
    base = plain_pretrained(str(files["folder"]), torch.device("cpu")).state_dict()
    trained = plain_pretrained(str(merged), torch.device("cpu")).state_dict()
    moved = [k for k in base if not torch.equal(base[k], trained[k])]
    # Merging folds each adapter into its target weight; every other weight is bitwise the base's.
    assert moved and all(k.endswith("weight") and ("proj" in k or "attn" in k) for k in moved), moved

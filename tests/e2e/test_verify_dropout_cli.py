"""`zeroshard verify` on a folder whose config turns dropout on: it turns dropout off for both runs
and says so (it passes, rather than reporting a meaningless difference), and `--dropout`, which
would keep the masks, is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from test_cli import run_cli, run_main  # noqa: E402

DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dropout") / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=96, **DROPOUT)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, max_shard_size="20KB")
    return out


# Stage 0: verify reuses its run as the stage-0 reference, one spawn rather than two.
ARGS = ["--nproc", "2", "--stage", "0", "--steps", "2", "--batch", "4", "--seq-len", "16", "--num-samples", "64"]


def test_verify_turns_dropout_off_for_both_runs_and_says_so(folder):
    done = run_cli(["verify", "--model", str(folder), *ARGS, "--json"], env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"param diff {result['max_abs_param_diff_vs_single']:.2e}, loss diff {result['max_abs_loss_diff_vs_single']:.2e}")
    assert result["passed"] and result["dropout"]["on"] is False
    assert {k: result["dropout"]["model_asks"][k] for k in DROPOUT} == DROPOUT


def test_verify_refuses_to_keep_dropout_on_with_the_reason(folder, capsys):
    done = run_main(["verify", "--model", str(folder), *ARGS, "--dropout"], capsys)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "--dropout keeps the model's dropout (attn_pdrop=0.1" in done.stderr and "drop --dropout" in done.stderr

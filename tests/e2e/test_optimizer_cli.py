"""`zeroshard train` with a per-tensor optimizer: a TOML [optimizer] table trains and saves, and a
state the checkpoint cannot hold per element is refused by name."""

from __future__ import annotations

import json

from test_cli import FAST, run_cli


def test_toml_optimizer_table_trains_muon_and_saves(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('stage = 2\nnproc = 2\nsteps = 3\n[optimizer]\nname = "muon"\nlr = 0.02\nmomentum = 0.9\n')
    ckpt = tmp_path / "ck"
    proc = run_cli(["train", "--config", str(config), *FAST, "--save-every", "3", "--ckpt-dir", str(ckpt)],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((ckpt / "step-00000003" / "manifest.json").read_text())
    kinds = {p["fqn"]: p["state"] for p in manifest["params"]}
    muon = [f for f, state in kinds.items() if state == ["momentum_buffer"]]
    assert muon and all(".attn." in f or ".mlp." in f for f in muon)  # the hidden matrices, under Muon
    assert kinds["tok_emb.weight"] == ["exp_avg", "exp_avg_sq"]  # the embedding, under AdamW
    assert manifest["optimizer"]["param_groups"][0]["options"]["initial_lr"] == 0.02  # the peak; lr is mid-warm-up

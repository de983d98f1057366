"""`zeroshard verify --pp`: the runs it compares, built from the user's flags (no ranks spawned)."""

from __future__ import annotations

import json

import torch

from zeroshard.cli import verify
from zeroshard.cli.main import main


def test_the_stage0_reference_reduces_once_per_step_under_a_per_microbatch_run(monkeypatch, capsys):
    """pp_grad_reduce="microbatch" is refused at stage 0, which keeps full grads: verify's stage-0
    reference of such a run must reduce once per step, while the run itself keeps the user's choice."""
    import zeroshard.trainer.train

    ran = []

    def fake(cfg):
        ran.append(cfg)
        return {"losses": [2.0], "params": {"w": torch.zeros(2)}}

    monkeypatch.setattr(verify, "_distributed", fake)
    monkeypatch.setattr(zeroshard.trainer.train, "reference_train", fake)
    rc = main(["verify", "--model", "tiny", "--nproc", "4", "--pp", "2", "--stage", "3", "--pp-grad-reduce",
               "microbatch", "--steps", "1", "--json"])
    assert rc == 0, capsys.readouterr().err
    assert [(c.stage, c.engine.pp_grad_reduce) for c in ran] == [(3, "microbatch"), (3, "microbatch"), (0, "step")]
    assert json.loads(capsys.readouterr().out)["pp_grad_reduce"] == "microbatch"

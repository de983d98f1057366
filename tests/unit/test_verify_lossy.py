"""`zeroshard verify`'s tolerance mode for lossy (quantized) communication."""

from __future__ import annotations

import pytest
import torch

from zeroshard.cli.verify import LOSSY_COMM_TOLERANCES, compare, default_tolerances
from zeroshard.trainer.config import TrainConfig


def test_quantized_comm_selects_the_lossy_tolerances():
    assert default_tolerances("fp32") == (1e-5, 1e-5)
    assert default_tolerances("fp32", "weights,grads") == LOSSY_COMM_TOLERANCES
    assert default_tolerances("bf16", "grads+ef") == LOSSY_COMM_TOLERANCES
    assert all(1e-5 < t < 0.1 for t in LOSSY_COMM_TOLERANCES)  # looser than exact, still catches a broken path


def _run(losses, shift):
    return {"losses": losses, "params": {"w": torch.full((4,), 1.0 + shift)}}


@pytest.mark.parametrize("param_shift, loss_shift, passed", [(1e-2, 7e-3, True), (1e-2, 0.2, False), (0.3, 0.0, False)])
def test_lossy_mode_passes_rounding_and_fails_a_broken_run(param_shift, loss_shift, passed):
    cfg = TrainConfig(stage=3, comm_quant="weights,grads")
    tol, loss_tol = default_tolerances(cfg.mp, cfg.comm_quant)
    ref = _run([2.0, 1.5], 0.0)
    dist = _run([2.0 + loss_shift, 1.5], param_shift)
    result = compare(cfg, ref, dist, ref, tol=tol, loss_tol=loss_tol)
    assert result["passed"] is passed
    assert result["tolerance_mode"] == "lossy communication" and result["comm_quant"] == "weights,grads"

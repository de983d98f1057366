"""`zeroshard verify`'s float64 reference: asked for only when the fp32 params alone are over the
tolerance, and passing only a run within the tolerance of the float64 answer."""

from __future__ import annotations

import pytest
import torch

from zeroshard.cli.verify import compare, wants_float64_reference
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.exact import Float64Mode, float64_reference
from zeroshard.trainer.train import reference_train

TOL = 1e-5


def _run(shift: float, losses=(2.0, 1.5)) -> dict:
    return {"losses": list(losses), "params": {"w": torch.full((4,), 1.0 + shift, dtype=torch.float64)}}


@pytest.mark.parametrize("dist_shift, passed", [(4e-6, True), (-1.2e-5, False)])
def test_the_float64_answer_decides_only_within_the_tolerance(dist_shift, passed):
    """The fp32 reference is 1.5e-5 above the exact answer. A run 4e-6 above it (1.1e-5 from the
    reference) passes; a run 1.2e-5 below it fails: over the tolerance from both."""
    cfg = TrainConfig(stage=3)
    exact, ref, dist = _run(0.0), _run(1.5e-5), _run(dist_shift)
    first = compare(cfg, ref, dist, dist, tol=TOL, loss_tol=TOL)
    assert not first["passed"] and wants_float64_reference(cfg, first, TOL)
    result = compare(cfg, ref, dist, dist, tol=TOL, loss_tol=TOL, exact=exact)
    assert result["passed"] is passed
    assert result["max_abs_param_diff_vs_float64"] == pytest.approx(abs(dist_shift), rel=1e-9)
    assert result["max_abs_param_diff_single_vs_float64"] == pytest.approx(1.5e-5, rel=1e-9)


def test_no_float64_run_where_it_cannot_change_the_verdict():
    cfg = TrainConfig(stage=3)
    ref = _run(0.0)
    over_stage0 = compare(cfg, ref, _run(2e-5), _run(0.0), tol=TOL, loss_tol=TOL)  # stage 0 differs too
    assert not wants_float64_reference(cfg, over_stage0, TOL)
    bad_loss = compare(cfg, ref, _run(2e-5, losses=(2.0, 1.6)), _run(2e-5), tol=TOL, loss_tol=TOL)
    assert not wants_float64_reference(cfg, bad_loss, TOL)
    lossy = TrainConfig(stage=3, comm_quant="grads")
    assert not wants_float64_reference(lossy, compare(lossy, ref, _run(2e-5), _run(2e-5), tol=TOL, loss_tol=TOL),
                                       TOL)
    bf16 = TrainConfig(stage=3, mp="bf16")
    assert not wants_float64_reference(bf16, compare(bf16, ref, _run(2e-5), _run(2e-5), tol=TOL, loss_tol=TOL), TOL)
    passing = compare(cfg, ref, _run(1e-6), _run(1e-6), tol=TOL, loss_tol=TOL)
    assert passing["passed"] and not wants_float64_reference(cfg, passing, TOL)


def test_float64_mode_keeps_a_models_fp32_upcast_in_float64():
    x = torch.randn(3, dtype=torch.float64)
    with Float64Mode():
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert torch.softmax(x, dim=0, dtype=torch.float32).dtype == torch.float64
    assert x.float().dtype == torch.float32


def test_the_float64_reference_trains_the_fp32_reference_to_rounding():
    """hf:llama-tiny (its RMSNorm upcasts with .to(torch.float32)), three AdamW steps: the float64
    run keeps float64 params and lands within fp32 rounding of the fp32 run, not on it."""
    cfg = TrainConfig(model="hf:llama-tiny", steps=3, batch=4, seq_len=16, warmup=1, num_samples=64, dropout=False)
    exact, fp32 = float64_reference(cfg), reference_train(cfg)
    assert all(v.dtype == torch.float64 for v in exact["params"].values() if v.is_floating_point())
    diff = max((exact["params"][k] - fp32["params"][k].double()).abs().max().item() for k in fp32["params"])
    assert 0 < diff < 1e-5
    assert max(abs(a - b) for a, b in zip(exact["losses"], fp32["losses"])) < 1e-5

"""qwZ: stage 3's weight all-gather as blockwise int8 + fp32 scales, on a real gloo world of 2."""

from __future__ import annotations

import math

import pytest

import quant_workloads as qw
from zeroshard.trainer.launch import spawn

WORLD = 2


@pytest.fixture(scope="module")
def results():
    return spawn(qw.quant_suite, WORLD, timeout_s=420)


def test_ledger_counts_int8_payload_plus_scales(results):
    rec = results[0]["ledger_q"]
    assert 0 < rec["quantized_groups"] < rec["groups"]  # the root (and small groups) stay unquantized
    assert rec["by_phase"]["all_gather:forward"] == rec["forward_formula"]
    assert rec["by_phase"]["all_gather:backward"] == rec["backward_formula"]
    ratio = rec["by_phase"]["all_gather:forward"] / rec["fp32_forward"]
    print(f"qwZ forward all-gather bytes / fp32 = {ratio:.4f} (int8 + 4/{qw.BLOCK} scale bytes per element "
          "for quantized groups; the root unit stays fp32)")
    assert ratio < 0.5


def test_manifest_records_wire_format(results):
    manifest = results[0]["ledger_q"]["manifest"]
    assert manifest["weight_wire_dtype"] == "int8"
    assert manifest["weight_wire_scale_dtype"] == "float32"
    assert manifest["weight_wire_block_size"] == qw.BLOCK
    assert manifest["master_dtype"] == "float32"


def test_forward_uses_dequantized_masters_identically_on_every_rank(results):
    for rank in results:
        cons = rank["consistency"]
        assert cons["checked"] > 0
        assert cons["dequant_matches_masters"]
        assert cons["same_across_ranks"]
        assert 0 < cons["max_rel_err"] <= 1 / 254 + 1e-6


def test_training_with_qwz_tracks_fp32_comm(results):
    rec = results[0]
    fp32, qwz = rec["fp32_losses"], rec["qwz_losses"]
    assert all(math.isfinite(x) for x in qwz)
    diffs = [abs(a - b) for a, b in zip(fp32, qwz)]
    print(f"qwZ vs fp32 comm over {len(fp32)} steps: max |loss diff| {max(diffs):.2e}, "
          f"final {fp32[-1]:.4f} vs {qwz[-1]:.4f}; max param diff {rec['param_diff']:.2e}")
    assert diffs[0] < 5e-3  # same init; only the forward's weights are rounded
    assert max(diffs) < 2e-2
    assert qwz[-1] < qwz[0] - 0.1  # it trains
    assert rec["param_diff"] > 0  # quantization really changed the numerics


def test_wrong_stage_is_a_clear_error(results):
    errors = results[0]["errors"]
    assert "need stage 3" in errors["weights-stage2"]
    assert "need stage 3" in errors["weights-stage0"]
    assert "stage 2 or 3" in errors["grads-stage0"]
    assert "stage 2 or 3" in errors["grads-stage1"]


def test_qgz_ledger_counts_int8_pieces_plus_scales(results):
    rec = results[0]["ledger_qg"]
    assert rec["by_phase"]["all_to_all:backward"] == rec["grad_formula"] > 0
    assert rec["by_phase"].get("reduce_scatter:backward", 0) == rec["grad_unquantized_formula"]
    total = rec["by_phase"]["all_to_all:backward"] + rec["by_phase"].get("reduce_scatter:backward", 0)
    print(f"qgZ grad reduction bytes / fp32 = {total / rec['grad_fp32']:.4f}; manifest grad wire "
          f"{rec['manifest']['grad_wire_dtype']} B={rec['manifest']['grad_wire_block_size']}")
    assert rec["manifest"]["grad_wire_dtype"] == "int8"
    assert total / rec["grad_fp32"] < 0.5


@pytest.mark.parametrize("run, ref", [("both_losses", "fp32_losses"), ("qgz_s2_losses", "fp32_s2_losses")])
def test_training_with_qgz_tracks_fp32_comm(results, run, ref):
    got, want = results[0][run], results[0][ref]
    assert all(math.isfinite(x) for x in got)
    diffs = [abs(a - b) for a, b in zip(got, want)]
    print(f"{run} vs {ref}: max |loss diff| {max(diffs):.2e}, final {want[-1]:.4f} vs {got[-1]:.4f}")
    assert max(diffs) < 3e-2
    assert max(diffs) > 0  # the quantized path really ran
    assert got[-1] < got[0] - 0.1


def test_quantized_reduce_scatter_matches_exact_sum_within_bound(results):
    for rank in results:
        rec = rank["qgz"]
        assert rec["within_bound"]
        assert 0 < rec["rms_rel"] < 0.02
        assert rec["ops"] == ["all_to_all"]
        assert rec["bytes"] == rec["formula"]  # int8 payload + fp32 scales, one piece per rank
    print(f"quantized reduce-scatter rms rel error {results[0]['qgz']['rms_rel']:.2e}, "
          f"wire {results[0]['qgz']['bytes']} bytes vs fp32 {4 * 3000 * WORLD}")


def test_hybrid_mesh_world4_tracks_fp32_comm():
    rec = spawn(qw.hybrid_quant_suite, 4, timeout_s=420)[0]
    diffs = [abs(a - b) for a, b in zip(rec["fp32"], rec["quant"])]
    print(f"hybrid 2x2 qwZ+qgZ vs fp32 comm: max |loss diff| {max(diffs):.2e}")
    assert all(math.isfinite(x) for x in rec["quant"])
    assert 0 < max(diffs) < 2e-2


def test_error_feedback_bounds_the_summed_reduction(results):
    for rank in results:
        plain, ef = rank["qgz"]["drift"]["plain"], rank["qgz"]["drift"]["ef"]
        assert ef["drift"] <= ef["bound"]  # only the last step's rounding, however many steps
        assert plain["drift"] > 5 * ef["bound"]  # the same small values lost every step
    d = results[0]["qgz"]["drift"]
    print(f"100 quantized reductions of the same grads: max |sum - exact| without error feedback "
          f"{d['plain']['drift']:.3f}, with {d['ef']['drift']:.4f} (bound {d['ef']['bound']:.4f})")


def test_error_feedback_in_training(results):
    rec = results[0]
    ef, want = rec["ef_losses"], rec["fp32_losses"]
    diffs = [abs(a - b) for a, b in zip(ef, want)]
    print(f"qwZ+qgZ+EF vs fp32 comm: max |loss diff| {max(diffs):.2e}, final {want[-1]:.4f} vs {ef[-1]:.4f}")
    assert all(math.isfinite(x) for x in ef) and 0 < max(diffs) < 3e-2
    led = rec["ledger_ef"]
    # Error feedback changes what is sent, not how much: the same wire bytes as plain qgZ.
    assert led["by_phase"]["all_to_all:backward"] == led["grad_formula"] == rec["ledger_qg"]["grad_formula"]
    assert led["manifest"]["grad_error_feedback"] and not rec["ledger_qg"]["manifest"]["grad_error_feedback"]
    # The residual held per rank is what the manifest (and the planner) count: 4 bytes per grad element.
    assert led["residual_bytes"] == led["manifest"]["grad_error_feedback_bytes"] == led["residual_formula"] > 0

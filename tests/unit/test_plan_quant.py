"""The planner with quantized communication: the runtime's groups, int8 + scale bytes, the EF residual."""

from __future__ import annotations

import pytest

import zeroshard as zs
from zeroshard.comm.quant import CommQuant, wire_bytes
from zeroshard.models import GPTConfig
from zeroshard.tools.planner.inventory import Inventory, meta_gpt


def _ops(layout) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in layout.collectives:
        out[c.op] = out.get(c.op, 0) + c.buffer_bytes * c.count
    return out


def test_plan_counts_quantized_bytes_and_residual():
    base = zs.plan("tiny", world=2, device="cpu")
    quant = zs.plan("tiny", world=2, device="cpu", comm_quant="weights,grads+ef", comm_quant_block=128)
    model = meta_gpt(GPTConfig.named("tiny"))
    comm = CommQuant.parse("weights,grads+ef", 128)
    units = Inventory(model, name="tiny").comm_units(stage=3, shards=2, bucket_bytes=25 * 2**20)
    groups = [(u, g) for u in units for g in u.groups]
    weight_q = sum(2 * wire_bytes(g.layout.shard_numel, 128) for u, g in groups if comm.quantizes(g.numel, u.is_root))
    grad_q = sum(2 * wire_bytes(g.layout.shard_numel, 128) for u, g in groups
                 if g.trainable and comm.quantizes_grads(g.numel))
    residual = sum(4 * g.numel for u, g in groups if g.trainable and comm.quantizes_grads(g.numel))
    assert weight_q > 0 and grad_q > 0
    z3, b3 = quant.layouts["zero3"], base.layouts["zero3"]
    # The forward gather carries every quantized (non-root) group as int8; the backward re-gather
    # all of them but the last block of forward, which the engine keeps gathered into backward
    # (Engine.kept_for_backward; units[0] is first in reduction order).
    kept_q = sum(2 * wire_bytes(g.layout.shard_numel, 128) for g in units[0].groups
                 if comm.quantizes(g.numel, units[0].is_root))
    assert not units[0].is_root and kept_q > 0
    int8_gathers = {c.phase: c.buffer_bytes for c in z3.collectives if c.op == "all_gather" and c.buffer_bytes
                    in (weight_q, weight_q - kept_q)}
    assert int8_gathers == {"forward": weight_q, "backward": weight_q - kept_q}
    assert _ops(z3)["all_to_all"] == grad_q
    assert z3.device.grads - b3.device.grads == residual
    ratio = z3.comm_bytes / b3.comm_bytes
    print(f"planned zero3 comm bytes, qwZ+qgZ B=128 / fp32: {ratio:.3f}; EF residual {residual / 2**20:.2f} MiB")
    assert 0.25 < ratio < 0.5
    # Stages where an option does not apply keep fp32 traffic; zero2 quantizes grads only.
    for name in ("ddp", "zero1"):
        assert quant.layouts[name].collectives == base.layouts[name].collectives
    z2 = quant.layouts["zero2"]
    assert "all_to_all" in _ops(z2) and _ops(z2)["all_gather"] == _ops(base.layouts["zero2"])["all_gather"]
    assert quant.spec.describe()["comm_quant"] == "weights,grads+ef"


def test_plan_rejects_bad_comm_quant():
    with pytest.raises(ValueError, match="power of two"):
        zs.plan("tiny", world=2, comm_quant="grads", comm_quant_block=100)
    with pytest.raises(ValueError, match="stage 2 or 3"):
        zs.plan("tiny", world=2, stage=0, comm_quant="grads")
    with pytest.raises(ValueError, match="comm_quant"):
        zs.plan("tiny", world=2, comm_quant="gradz")


def test_analytic_plan_quantizes_everything():
    base = zs.plan(7e9, world=8)
    quant = zs.plan(7e9, world=8, comm_quant="weights,grads")
    ratio = quant.layouts["zero3"].comm_bytes / base.layouts["zero3"].comm_bytes
    assert ratio == pytest.approx((1 + 4 / 256) / 2, rel=0.05)  # fp16/bf16 compute in analytic mode

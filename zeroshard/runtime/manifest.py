"""The precision manifest: every dtype a run uses, by role, read from the buffers rather than the flags."""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.comm.quant import SCALE_DTYPE, ErrorFeedback
from zeroshard.comm.quant_kernel import codec_name
from zeroshard.runtime.engine import get_engine


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _wire(engine) -> dict:
    """What the weight all-gather and grad reduction put on the wire: int8 + fp32 block scales where quantized."""
    quantized = [g for g in engine.groups if g.weight_quant is not None]
    grads = [g for g in engine.groups if g.grad_quant is not None]
    return {
        "weight_wire_dtype": "int8" if quantized else None,
        "weight_wire_scale_dtype": _name(SCALE_DTYPE) if quantized else None,
        "weight_wire_block_size": engine.comm.block_size if quantized else None,
        "weight_wire_quantized_groups": len(quantized),
        "grad_wire_dtype": "int8" if grads else None,
        "grad_wire_block_size": engine.comm.block_size if grads else None,
        "grad_wire_quantized_groups": len(grads),
        # How quantize runs in this process: the compiled fused kernel, or eager and why.
        "wire_codec": codec_name() if quantized or grads else None,
        # Error feedback's persistent per-rank residual: one fp32 value per quantized grad element.
        "grad_error_feedback": engine.comm.error_feedback and bool(grads),
        "grad_error_feedback_bytes": sum(ErrorFeedback.bytes_for(g.layout.numel) for g in grads
                                         if g.grad_feedback is not None),
    }


def precision_manifest(model: nn.Module, optimizer=None) -> dict:
    """What each role's dtype actually is in this sharded model (read from the buffers, not flags)."""
    engine = get_engine(model)
    trainable = engine.trainable_groups
    first = trainable[0]
    state_dtypes: set[str | None] = set()
    if optimizer is not None:
        for state in optimizer.state.values():
            state_dtypes.update(_name(t.dtype) for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    buffers = {_name(b.dtype) for b in model.buffers()}
    if engine.policy.transient_grads:
        accumulation = _name(first.master_dtype) if engine.options.accumulation == "sharded" else _name(first.reduce_dtype)
        kept_in = "1/N grad shard" if engine.options.accumulation == "sharded" else "full grad buffer"
        accumulation_where = f"{engine.options.accumulation} ({kept_in})"
    else:
        accumulation, accumulation_where = _name(first.compute_dtype), "full grad buffer (local until the sync micro-step)"
    return {
        "stage": engine.policy.stage,
        "world": engine.mesh.world,
        "mesh": engine.mesh.describe(),
        "param_compute_dtype": _name(first.compute_dtype),
        "buffer_dtype": sorted(buffers) if buffers else None,
        "reduce_dtype": _name(first.reduce_dtype),
        "master_dtype": _name(first.master_dtype),
        "optimizer_state_dtypes": sorted(state_dtypes) or None,
        "grad_accumulation_dtype": accumulation,
        "grad_accumulation": accumulation_where,
        "all_gather_dtype": _name(first.compute_dtype) if engine.policy.shard_optimizer and engine.mesh.shard_size > 1 else None,
        **_wire(engine),
        "units": [u.name for u in engine.units],
        "bucket_mb": engine.options.bucket_bytes / 2**20 if engine.policy.reads("bucket_mb") else None,
        "prefetch": engine.options.prefetch if engine.policy.reads("prefetch") else None,
        "reshard_after_forward": engine.options.reshard_after_forward if engine.policy.reads("reshard_after_forward")
        else None,
    }

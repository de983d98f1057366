"""Quantized communication (``CommQuant``: qwZ, qgZ, error feedback) in a plan.

A layout planned from the model's units gets its quantized traffic from the runtime's step schedule
(zeroshard/runtime/schedule.py), which quantizes the groups the engine does (``CommQuant.quantizes``
/ ``quantizes_grads``): ``shards x wire_bytes(shard_numel)`` per group, an all-gather for weights
(stage 3) and an all-to-all for grads (stages 2-3). For a bare parameter count this module splits
the textbook volumes the same way. Either way error feedback adds its persistent residual, one
fp32 value per quantized grad element, to the ``grads`` component. Stages where an option does not apply
(weights below 3, grads below 2) keep fp32 communication, as the runtime refuses them.
"""

from __future__ import annotations

import dataclasses

from zeroshard.comm.quant import CommQuant, ErrorFeedback, wire_bytes
from zeroshard.tools.planner.comm import Collective
from zeroshard.tools.planner.result import LayoutPlan
from zeroshard.runtime.flat import StagePolicy


@dataclasses.dataclass(frozen=True)
class _Group:
    numel: int
    shard_numel: int
    is_root: bool
    trainable: bool


@dataclasses.dataclass(frozen=True)
class QuantVolume:
    """Bytes one all-gather / reduction of the affected groups takes, in fp32 (or compute dtype) and quantized."""

    weight_fp: int = 0
    weight_fp_blocks: int = 0
    """Of ``weight_fp``, the part outside the root (stage 3's backward re-gather skips the root)."""
    weight_q: int = 0
    weight_q_blocks: int = 0
    grad_fp: int = 0
    grad_q: int = 0
    residual: int = 0


def volume(groups: list[_Group], comm: CommQuant, *, stage: int, shards: int, compute_bytes: int,
           reduce_bytes: int) -> QuantVolume:
    policy = StagePolicy(stage)
    wf = wfb = wq = wqb = gf = gq = res = 0
    for g in groups:
        if policy.shard_params and comm.quantizes(g.numel, g.is_root):
            fp, q = g.numel * compute_bytes, shards * wire_bytes(g.shard_numel, comm.block_size)
            wf, wq = wf + fp, wq + q
            if not g.is_root:
                wfb, wqb = wfb + fp, wqb + q
        if policy.transient_grads and g.trainable and comm.quantizes_grads(g.numel):
            gf += g.numel * reduce_bytes
            gq += shards * wire_bytes(g.shard_numel, comm.block_size)
            res += ErrorFeedback.bytes_for(g.numel) if comm.error_feedback else 0
    return QuantVolume(weight_fp=wf, weight_fp_blocks=wfb, weight_q=wq, weight_q_blocks=wqb, grad_fp=gf, grad_q=gq,
                       residual=res)


def _split(c: Collective, fp: int, quantized: int, op: str) -> list[Collective]:
    """``c`` less ``fp`` bytes, plus the same traffic sent quantized as ``op``."""
    out = []
    if c.buffer_bytes - fp > 0:
        out.append(dataclasses.replace(c, buffer_bytes=c.buffer_bytes - fp))
    if quantized:
        out.append(dataclasses.replace(c, op=op, buffer_bytes=quantized))
    return out


def quantized_collectives(collectives: tuple[Collective, ...], v: QuantVolume, *, stage: int
                          ) -> tuple[Collective, ...]:
    """The textbook collectives (``comm.textbook_collectives``) with the quantized groups' traffic in
    int8 + scales. Stage 3 has its forward all-gather and the backward re-gather (without the
    root); stages 1-2's all-gather is the exact parameter sync and stays as it is. (A layout planned
    from units gets its quantized traffic from the step schedule instead.)"""
    out: list[Collective] = []
    for c in collectives:
        if c.op == "all_gather" and StagePolicy(stage).shard_params:
            backward = c.phase == "backward"
            out += _split(c, v.weight_fp_blocks if backward else v.weight_fp,
                          v.weight_q_blocks if backward else v.weight_q, "all_gather")
        elif c.op == "reduce_scatter" and v.grad_fp:
            out += _split(c, v.grad_fp, v.grad_q, "all_to_all")
        else:
            out.append(c)
    return tuple(out)


def apply(layout: LayoutPlan, comm: CommQuant, groups: list[_Group], *, compute_bytes: int,
          reduce_bytes: int, textbook: bool = False) -> LayoutPlan:
    """``layout`` with ``comm``'s error-feedback residual and, for ``textbook`` collectives, its
    quantized traffic (collectives from the step schedule are quantized already)."""
    v = volume(groups, comm, stage=layout.stage, shards=layout.shard_size, compute_bytes=compute_bytes,
               reduce_bytes=reduce_bytes)
    device = dataclasses.replace(layout.device, grads=layout.device.grads + v.residual)
    collectives = quantized_collectives(layout.collectives, v, stage=layout.stage) if textbook else layout.collectives
    return dataclasses.replace(layout, collectives=collectives, device=device)


def groups_of(inventory, *, stage: int, shards: int, bucket_bytes: int) -> list[_Group]:
    """The runtime's flat groups for one layout (from the model inventory)."""
    return [_Group(g.numel, g.layout.shard_numel, u.is_root, g.trainable)
            for u in inventory.comm_units(stage=stage, shards=shards, bucket_bytes=bucket_bytes) for g in u.groups]


def analytic_groups(params: int, shards: int) -> list[_Group]:
    """A bare parameter count: one trainable, non-root group (every element quantized)."""
    return [_Group(params, -(-params // shards), False, True)]

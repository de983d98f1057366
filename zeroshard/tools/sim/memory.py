"""Per-rank peak memory for the simulator, built on zeroshard.tools.planner's estimator.

zeroshard's GPT is planned by ``zeroshard.tools.planner.plan`` whole (it has the exact activation count).
Other shapes (Llama, a folder's) take model states and optimizer scratch from the planner's textbook
accounting of their parameter count (without expert parallelism's split: ``plan --ep`` without
``--time`` lays out a folder's experts) and add what the planner leaves out in that mode: the workload's activations,
the stage-3 all-gather window and the full grads of the reductions in flight.
"""

from __future__ import annotations

from zeroshard.tools.planner import plan
from zeroshard.parallel.cp.volume import transient_bytes
from zeroshard.tools.planner.spec import STAGE_NAMES
from zeroshard.runtime.engine import MAX_INFLIGHT_REDUCTIONS
from zeroshard.tools.sim.step import Layout
from zeroshard.tools.sim.workload import Workload


def _layout_name(layout: Layout) -> str:
    return STAGE_NAMES[layout.stage] + ("_hybrid" if layout.hybrid else "") + ("_offload" if layout.offload != "none" else "")


def peak_bytes(w: Workload, layout: Layout, *, headroom: float = 0.10) -> float:
    """Bytes per rank at the step's peak, with the planner's allocator headroom."""
    p = plan(w.shape.params, world=layout.world, stage=layout.stage, mp="bf16", seq=w.seq, tp=layout.tp, cp=layout.cp,
             batch=w.micro_batch * layout.dp, shard_size=layout.shard_group if layout.hybrid else None,
             prefetch=layout.prefetch, bucket_mb=layout.bucket_mb, headroom=headroom, accounting="textbook",
             offload=layout.offload)
    device = p[_layout_name(layout)].device
    s = w.shape
    window = 0.0
    if layout.policy.shard_params:
        # The root stays gathered; a block being computed plus ``prefetch`` gathered ahead.
        window = (s.root_params + (1 + layout.prefetch) * s.block_params / layout.tp) * layout.param_bytes
    inflight = 0.0
    if layout.policy.transient_grads:
        inflight = (MAX_INFLIGHT_REDUCTIONS + 1) * s.block_params / layout.tp * layout.reduce_bytes
    # A cp rank holds seq / cp of each sequence, and one layer's attention exchange buffers at a time.
    exchange = transient_bytes(layout.cp_attention, cp=layout.cp, rows=w.micro_batch, seq=w.seq,
                               q_width=s.hidden // layout.tp, kv_width=s.kv_dim // layout.tp, elem=w.compute_bytes)
    backward = w.activation_peak_bytes(tp=layout.tp) / layout.cp + exchange + window + inflight
    # Optimizer scratch and the backward peak happen at different moments: the larger one counts.
    allocated = device.model_states + max(backward, device.workspace)
    return allocated * (1 + headroom)


def gpt_peak_bytes(name: str, w: Workload, layout: Layout, *, headroom: float = 0.10) -> float:
    """zeroshard's own GPT preset, planned whole by the runtime-accounting estimator."""
    p = plan(name, world=layout.world, stage=layout.stage, mp="bf16", seq=w.seq, batch=w.micro_batch * layout.dp,
             tp=layout.tp, cp=layout.cp, cp_attention=layout.cp_attention,
             checkpointing=w.checkpointing, shard_size=layout.shard_group if layout.hybrid else None,
             prefetch=layout.prefetch, bucket_mb=layout.bucket_mb, headroom=headroom,
             reshard_after_forward=layout.reshard_after_forward, offload=layout.offload, ep=layout.ep,
             routing_skew=w.routing_skew if layout.ep > 1 else 0.0)
    return float(p[_layout_name(layout)].device.total)

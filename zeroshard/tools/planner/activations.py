"""Activation memory of our GPT: what autograd saves for backward, per layer and per token.

Counted against ``saved_tensors_hooks`` on the real model (tests/unit/test_plan.py asserts the
count is exact), with C = n_embd, c = bytes of the compute dtype, h = heads:

- per block and token: 16·C·c bytes. The block input (ln1), ln1's output (qkv), the qkv output
  (3C, which SDPA keeps as q, k, v views), the attention output (C, which is also out-proj's input:
  the transpose back is already contiguous), the residual after attention (ln2), ln2's output (fc),
  fc's output (4C, for GELU) and GELU's output (4C, for the MLP projection). Plus 4·c for the two
  LayerNorms' mean and rstd, and 4·h for SDPA's fp32 log-sum-exp.
- root, per token: the last block's output and norm_f's output (2·C·c), norm_f's stats (2·c), the
  fp32 log-probabilities (4·V, kept by log_softmax whatever the compute dtype), token ids and
  targets (int64, 16). Per sequence position: the position ids (8).

A block with an MoE MLP (``n_expert > 0``) saves, in place of the dense MLP's 2·hidden·c per token,
what its router and its routed rows keep (counted against ``saved_tensors_hooks`` on the unsplit
layer): per token the router's fp32 probabilities (4·E), top-k indices and renormalised weights
(12·k) and their sum (4); per routed row (k per token) its input, the expert's fc and GELU outputs,
the expert's output (saved by the routing-weight product) and one more C-wide copy (3·C + 2·hidden,
in c), its weight (4) and its (token, slot) index (16). Under expert parallelism a rank's rows are
the ones routed to its experts, ``tokens × k`` when balanced, ``× (1 + skew)`` on the busiest rank
(an estimate: the split layer's dispatch keeps index tensors of its own). With a load-balancing
loss each layer call also keeps its per-expert shares (4·E).

ZeRO does not divide any of this by N: it shards model states, while activations scale with the
micro-batch each rank runs. Checkpointing follows the runtime's segments (``Checkpointing.segments``,
which are ``zeroshard.runtime.recompute.segment_bounds``): each segment keeps only its input
(C·c per token) and backward rebuilds one whole segment at a time, so the longest segment's blocks
are alive again while it is rebuilt.
"""

from __future__ import annotations

import dataclasses

from zeroshard.tools.planner.spec import Checkpointing


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationEstimate:
    saved: int
    """Bytes held for backward when forward ends (the peak of saved activations)."""
    recompute: int
    """Bytes of the block or segment being recomputed during backward (0 without checkpointing)."""
    workspace: int
    """Backward temporaries alive at the peak: activation gradients, the logits' gradient."""
    per_layer: int
    root: int
    boundary: int = 0
    """What a checkpoint segment keeps for backward: its input."""
    head: int = 0
    """Backward temporaries at the loss head: the log-probs' and logits' gradients."""
    block: int = 0
    """Backward temporaries inside one block: the MLP's hidden-size gradients and the residual's."""
    segments: tuple[tuple[int, int], ...] = ()
    """The runtime's checkpoint segments, ``[start, stop)`` block ranges (empty: none)."""
    head_saved: int = 0
    """What the final norm, head and loss saved (a traced model's): the head's backward frees it
    before any block's backward runs, so a block's temporaries never sit next to it."""
    block_names: tuple[str, ...] = ()
    """The blocks' module names in forward order, where they are not our GPT's ``blocks.N``."""

    @property
    def total(self) -> int:
        return self.saved + self.recompute


def moe_mlp_bytes(cfg, compute_bytes: int, *, tokens: int, routed_tokens: int, skew: float = 0.0) -> int:
    """Bytes an MoE MLP saves for a micro-batch of ``tokens`` (see the module docstring): the
    router's on every token, the routed rows' on the ``routed_tokens`` this rank dispatches (all
    of them, or under ep with tp its tp run)."""
    C, k, E = cfg.n_embd, cfg.expert_top_k, cfg.n_expert
    hidden = cfg.mlp_ratio * C
    row = (3 * C + 2 * hidden) * compute_bytes + 4 + 16
    return routed_tokens * int(round(k * (1.0 + skew) * row)) + tokens * (4 * E + 12 * k + 4)


def gpt_activations(cfg, *, micro_batch: int, seq: int, compute_bytes: int, policy: Checkpointing,
                    tp: int = 1, sequence_parallel: bool = False, skew: float = 0.0,
                    routed_tokens: int | None = None) -> ActivationEstimate:
    """Per rank. Under tensor parallelism (Megatron's split, zeroshard.tools.planner.tp) the tensors inside
    the split linears are divided by ``tp``: qkv, the attention output, fc and GELU (4·C + 2·hidden
    per token) and the heads' log-sum-exp; the block input, the norms' outputs and the residual
    (4·C) stay whole on every tp rank. ``sequence_parallel`` splits the block input, the residual
    and the norms' statistics along the sequence; the norms' outputs stay whole, because torch's
    DTensor autograd keeps the all-gathered input of each column-wise linear for its weight grad
    (Megatron gathers it again in backward instead). Measured against ``saved_tensors_hooks`` on
    the tensor-parallel runtime (tests/distributed/test_tp.py). The embeddings and head are not split.
    An MoE block's MLP is not split by tp: its router saves on every token, its routed rows on the
    ``routed_tokens`` the rank dispatches (default all; under ep with tp, its tp run)."""
    C, L, V, h = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.n_head
    hidden = cfg.mlp_ratio * C
    tokens = micro_batch * seq
    c = compute_bytes
    whole = 1 if not sequence_parallel else tp  # divides what the layer split leaves whole
    # Block input and residual (2·C) plus the norms' stats split by SP; the norms' outputs (2·C)
    # whole either way; 8·C outside the MLP plus its two hidden-size tensors: 16·C for a 4× MLP.
    outside = (2 * C * c + 4 * c) // whole + 2 * C * c
    per_layer = tokens * (outside + 4 * C * c // tp + 4 * h // tp)
    if getattr(cfg, "n_expert", 0):
        # plus the load-balancing loss's per-expert shares (E fp32), once per layer call
        per_layer += moe_mlp_bytes(cfg, c, tokens=tokens, routed_tokens=tokens if routed_tokens is None else routed_tokens,
                                   skew=skew) + (4 * cfg.n_expert if cfg.aux_loss_coef > 0 else 0)
    else:
        per_layer += tokens * 2 * hidden * c // tp
    root = tokens * (2 * C * c + 2 * c + 4 * V + 16) + seq * 8 + 4
    boundary = tokens * C * c // whole  # what a checkpointed block keeps: its input

    segments = tuple(policy.segments(L))
    if not segments:
        saved, recompute = L * per_layer, 0
    else:
        saved = len(segments) * boundary
        recompute = max(b - a for a, b in segments) * per_layer

    # At backward's start the fp32 log-prob gradient and the logits gradient coexist; inside a block
    # the MLP's hidden-size gradients dominate (GELU's input and output grads, plus the residual).
    head = tokens * V * 4 * 2 + (tokens * V * c if c != 4 else 0)
    block = tokens * (2 * hidden // tp + 5 * C // whole) * c
    return ActivationEstimate(saved=saved + root, recompute=recompute, workspace=max(head, block),
                              per_layer=per_layer, root=root, boundary=boundary, head=head, block=block, segments=segments)


def block_index(act: ActivationEstimate, fqn: str) -> int | None:
    """The forward index of the block holding param ``fqn``: our GPT's ``blocks.N``, or where the
    estimate names its blocks (a traced model's), the block whose name prefixes it."""
    if not act.block_names:
        return int(fqn.split(".")[1]) if fqn.startswith("blocks.") else None
    return next((i for i, name in enumerate(act.block_names) if fqn.startswith(name + ".")), None)


def alive_activations(act: ActivationEstimate, units: list[tuple[list[str], bool]], policy: Checkpointing) -> list[int]:
    """Per unit (its params' names, whether it is the root), in reduction order, the activations
    still alive at its last grad.

    Each block saves ``per_layer`` and the root ``root`` (kept to the end: the embedding's grads come
    last). At a unit whose first block is k, blocks k and later are through backward. Without
    checkpointing blocks 0..k-1 still hold theirs; with it, each segment starting at or before k
    still holds its input (``boundary``), and k's own segment [a, b) has rebuilt blocks a..k-1 that
    are not through backward yet.
    """
    found = [min((k for fqn in names if (k := block_index(act, fqn)) is not None), default=None)
             for names, _ in units]
    # A pipeline stage keeps the unsplit model's names (its blocks are blocks.4, blocks.5, ...):
    # counted from the first block it holds.
    lowest = min((k for k in found if k is not None), default=0)
    firsts = [None if k is None else k - lowest for k in found]
    depth = 1 + max((k for k in firsts if k is not None), default=-1)
    segments = policy.segments(depth)
    out = []
    for (_, is_root), k in zip(units, firsts):
        if k is None or is_root:  # the root: reduced last, when every block is through backward
            out.append(0)
        elif not segments:
            out.append(act.root + k * act.per_layer)
        else:
            index = next(i for i, (a, b) in enumerate(segments) if a <= k < b)
            out.append(act.root + (index + 1) * act.boundary + (k - segments[index][0]) * act.per_layer)
    return out

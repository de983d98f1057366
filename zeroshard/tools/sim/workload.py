"""What one rank computes per micro-batch, per unit: FLOPs, memory-bound bytes, saved activations.

Blocks are identical units; the root (embeddings, final norm, LM head, loss) is one more unit that,
as in zeroshard's engine, stays gathered. FLOPs follow the usual count: a matmul of a (t x k) by a
(k x m) is 2tkm, backward is twice forward, so a step is 6 * params * tokens over the matmul params,
plus attention 4*s*h per token per layer forward (QK^T and AV). MFU uses the convention torchtitan
and PaLM use: 6 * (params - embedding) + 12 * layers * hidden * seq per token, causal mask not halved;
the time model does halve the attention work for causal masking (FlashAttention skips masked tiles).

Memory-bound work (norms, RoPE, activation functions, residual adds, the loss) is counted as bytes
moved by eager PyTorch kernels and costs bytes / HBM bandwidth; the counts are ours, stated per term.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zeroshard.runtime.recompute import segment_length

DEFAULT_SEQ = 8192
"""Tokens per sequence for a Llama shape when --seq is not given (torchtitan's Llama 3 runs)."""

# Checkpointing policies beyond zeroshard's own (none, all, every:K, sqrt): "op" is torchtitan's
# selective op-level policy, which keeps every other matmul output and SDPA's output, recomputing the rest.
TORCHTITAN_POLICIES = ("op", "full")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    n_layer: int
    hidden: int
    ffn: int
    n_head: int
    kv_dim: int
    vocab: int
    gated: bool = True
    """SwiGLU (three MLP matmuls) rather than GELU (two)."""
    tied: bool = False
    bias: bool = False
    n_expert: int = 0
    """Experts of each block's MoE MLP (each an MLP of ``ffn``, stacked), with a router of
    ``hidden × n_expert``; 0: a dense MLP."""
    top_k: int = 0
    """Experts each token runs (with ``n_expert``)."""

    @property
    def mlp_params(self) -> int:
        """One MLP's (one expert's) params."""
        h, f = self.hidden, self.ffn
        return (3 if self.gated else 2) * h * f + ((f + h) if self.bias else 0)

    @property
    def expert_params(self) -> int:
        """A block's stacked expert params (what expert parallelism splits); 0 for a dense MLP."""
        return self.n_expert * self.mlp_params

    @property
    def block_params(self) -> int:
        h = self.hidden
        attn = 2 * h * h + 2 * h * self.kv_dim + (3 * h + self.kv_dim if self.bias else 0)
        mlp = self.expert_params + h * self.n_expert if self.n_expert else self.mlp_params
        norms = (4 if self.bias else 2) * h
        return attn + mlp + norms

    @property
    def active_block_params(self) -> int:
        """What one token runs through: the router and ``top_k`` experts in place of every expert."""
        if not self.n_expert:
            return self.block_params
        return self.block_params - self.expert_params + self.top_k * self.mlp_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        return self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.n_layer * self.block_params + self.root_params

    @property
    def block_matmuls(self) -> list[int]:
        """Weights of the block's matmuls in forward order (k*m each); an MoE block's MLP part is
        one expert's (``block_gemm_flops`` adds the router and the ``top_k`` a token runs)."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        mlp = [h * f, h * f, h * f] if self.gated else [h * f, h * f]
        return [h * h, h * kv, h * kv, h * h, *mlp]


# Llama 3.1 model cards (config.json of meta-llama/Llama-3.1-8B and -70B): GQA with 8 KV heads of 128.
SHAPES = {
    "llama3-8b": Shape(name="llama3-8b", n_layer=32, hidden=4096, ffn=14336, n_head=32, kv_dim=1024, vocab=128256),
    "llama3-70b": Shape(name="llama3-70b", n_layer=80, hidden=8192, ffn=28672, n_head=64, kv_dim=1024,
                        vocab=128256),
}


class _Block(nn.Module):
    """A transformer block holding a ``Shape``'s params (two norms, q/k/v/o, the MLP's two or three
    matmuls): what the memory planner lays out, never run."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        h, f, kv = s.hidden, s.ffn, s.kv_dim
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, bias=s.bias), nn.LayerNorm(h, bias=s.bias)
        self.q, self.k, self.v, self.o = (nn.Linear(h, n, bias=s.bias) for n in (h, kv, kv, h))
        self.up, self.down = nn.Linear(h, f, bias=s.bias), nn.Linear(f, h, bias=s.bias)
        self.gate = nn.Linear(h, f, bias=False) if s.gated else None


class _Model(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.n_layer))
        self.norm = nn.Parameter(torch.empty(s.hidden))
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied:
            self.head.weight = self.embed.weight


def meta_module(shape: Shape) -> nn.Module:
    """A dense ``shape`` as a module on the meta device, so the memory planner lays out the same
    workload the simulator times (``plan memory --model llama3-8b``); no memory is allocated."""
    if shape.n_expert:
        raise ValueError(f"{shape.name} is an MoE shape; plan its memory from its folder or hf: name")
    with torch.device("meta"):
        return _Model(shape)


def activation_estimate(w: "Workload", tp: int = 1) -> Any:
    """The planner's ``ActivationEstimate`` of this workload: what ``per_layer_activation_bytes``
    and ``activation_peak_bytes`` count, split into the planner's terms."""
    from zeroshard.tools.planner.activations import ActivationEstimate

    s, c = w.shape, w.compute_bytes
    per_layer = int(w.per_layer_activation_bytes(tp=tp))
    root = int(w.tokens * (2 * s.hidden * c + 4 * s.vocab))
    rebuilt = int(w.per_layer_activation_bytes("none", tp=tp)) if w.checkpointing != "none" else 0
    head = int(w.tokens * (4 + c) * s.vocab)
    return ActivationEstimate(saved=s.n_layer * per_layer + root, recompute=rebuilt, workspace=head,
                              per_layer=per_layer, root=root, head=head)


def gpt_shape(cfg, name: str = "GPT") -> Shape:
    """zeroshard's GPT: full multi-head attention, GELU MLP (or MoE MLPs of that shape), tied head, biases."""
    return Shape(name=name, n_layer=cfg.n_layer, hidden=cfg.n_embd, ffn=cfg.mlp_ratio * cfg.n_embd,
                 n_head=cfg.n_head, kv_dim=cfg.n_embd, vocab=cfg.vocab_size, gated=False, tied=True,
                 bias=cfg.bias, n_expert=cfg.n_expert, top_k=cfg.expert_top_k if cfg.n_expert else 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    shape: Shape
    micro_batch: int
    seq: int
    checkpointing: str = "none"
    compute_bytes: int = 2
    accum: int = 1
    """Micro-steps per optimizer step (gradient accumulation); ``tokens`` is one micro-step's."""
    routing_skew: float = 0.0
    """Under expert parallelism, the busiest ep rank's extra share of routed rows (0: balanced):
    its experts run, and its all-to-alls carry, ``1 + routing_skew`` times its balanced share."""

    def __post_init__(self) -> None:
        if isinstance(self.accum, bool) or not isinstance(self.accum, int) or self.accum < 1:
            raise ValueError(f"accum must be a positive int (micro-steps per optimizer step), got {self.accum!r}")
        if self.checkpointing not in TORCHTITAN_POLICIES:
            segment_length(self.checkpointing, self.shape.n_layer)  # raises on an unknown policy

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq

    # --- FLOPs per micro-batch -------------------------------------------------------------
    @property
    def block_gemm_flops(self) -> float:
        """An MoE block runs its router and, on the busiest rank, its share of the routed rows
        through its experts: ``top_k`` MLPs per token, times ``1 + routing_skew``."""
        s = self.shape
        if not s.n_expert:
            return 2.0 * self.tokens * sum(s.block_matmuls)
        routed = (1.0 + self.routing_skew) * s.top_k * sum(s.block_matmuls[4:])
        return 2.0 * self.tokens * (sum(s.block_matmuls[:4]) + s.hidden * s.n_expert + routed)

    def block_gemm_flops_on(self, tp: int, *, experts_split: bool) -> float:
        """``block_gemm_flops`` on one of ``tp`` tensor-parallel ranks: a dense block's matmuls all
        split; an MoE block's attention split (the runtime's plan leaves the MoE layer whole), its
        router on every token, its experts on the rank's run of the tokens when ep splits them
        (each tp rank routes its own run: zeroshard/parallel/experts/tp_tokens.py), else on every token."""
        s = self.shape
        if not s.n_expert or tp == 1:
            return self.block_gemm_flops / tp
        attention = 2.0 * self.tokens * sum(s.block_matmuls[:4]) / tp
        router = 2.0 * self.tokens * s.hidden * s.n_expert
        routed = 2.0 * self.tokens * (1.0 + self.routing_skew) * s.top_k * sum(s.block_matmuls[4:])
        return attention + router + routed / (tp if experts_split else 1)

    @property
    def block_attention_flops(self) -> float:
        """Forward, causal mask counted as half (what the kernel does)."""
        return 0.5 * 4.0 * self.tokens * self.seq * self.shape.hidden

    @property
    def root_gemm_flops(self) -> float:
        return 2.0 * self.tokens * self.shape.vocab * self.shape.hidden

    def recompute_fraction(self) -> tuple[float, float]:
        """(fraction of the block's matmul FLOPs, of its attention) run again in backward."""
        if self.checkpointing == "op":
            # Every second matmul of the block is recomputed; SDPA's output is kept.
            mms = self.shape.block_matmuls
            return sum(mms[1::2]) / sum(mms), 0.0
        if self.checkpointing == "full" or segment_length(self.checkpointing, self.shape.n_layer) is not None:
            return 1.0, 1.0  # zeroshard's policies rebuild whole units
        return 0.0, 0.0

    def mfu_flops_per_token(self) -> float:
        s = self.shape  # an MoE block counts the params a token runs through
        active = s.params - s.n_layer * (s.block_params - s.active_block_params)
        return 6.0 * (active - s.embedding_params) + 12.0 * s.n_layer * s.hidden * self.seq

    # --- memory-bound bytes per micro-batch (forward; backward moves about twice) ------------
    @property
    def block_elementwise_bytes(self) -> float:
        h, f, kv = self.shape.hidden, self.shape.ffn, self.shape.kv_dim
        norms = 2 * 36 * h      # eager RMSNorm/LayerNorm in fp32: ~9 passes of a 4-byte row
        rope = 20 * (h + kv)    # q and k to fp32 complex, multiply, back
        residual = 2 * 6 * h    # two adds: read two bf16 rows, write one
        act = (10 if self.shape.gated else 4) * f  # SiLU and the gate product, or GELU
        layout = 8 * h          # transposes around attention
        return float(self.tokens * (norms + rope + residual + act + layout))

    @property
    def root_elementwise_bytes(self) -> float:
        # logits written in bf16, cast to fp32, log-softmax read and written, loss gathered.
        return float(self.tokens * 16 * self.shape.vocab)

    # --- activations per rank, bytes ---------------------------------------------------------
    def per_layer_activation_bytes(self, policy: str | None = None, tp: int = 1) -> float:
        """What autograd keeps per block for backward under ``policy`` (default: the workload's), on
        one of ``tp`` tensor-parallel ranks. The tp plan splits the heads and the MLP's hidden
        width, so q, k, v, the attention output, the MLP's hidden tensors and SDPA's log-sum-exp are
        1/tp on each rank; the block input, the norms' outputs and the residual stay whole (no
        sequence parallelism; as zeroshard.tools.planner.activations counts it for our GPT)."""
        s, c = self.shape, self.compute_bytes
        h, f, kv = s.hidden, s.ffn, s.kv_dim
        policy = self.checkpointing if policy is None else policy
        lse = 4 * s.n_head  # SDPA's fp32 log-sum-exp per token
        whole: float
        split: float
        if policy == "op":
            # kept: the block input, wq's and wv's outputs, w1's, w2's (after the row-wise sum: whole), SDPA's
            whole, split = c * 2 * h, c * (h + kv + f + h) + lse
        elif policy == "none":
            mlp: float = 4 * f if s.gated else 2 * f
            if s.n_expert:  # each routed row keeps its input, the MLP's and its output (planner/activations.py);
                # split: under ep with tp each tp rank routes its run of the tokens (experts/tp_tokens.py)
                mlp = (1.0 + self.routing_skew) * s.top_k * (mlp + 3 * h)
            # whole: the input, the two norms' outputs and the residual between the two halves;
            # split: q, the attention output, k, v and the MLP's hidden tensors
            whole, split = c * 4 * h, c * (2 * h + 2 * kv + mlp) + lse
        else:
            whole, split = c * h, 0.0  # only the block input
        return float(self.tokens * (whole + split / tp))

    def activation_peak_bytes(self, tp: int = 1) -> float:
        """At the start of backward, on one of ``tp`` tensor-parallel ranks: every block's saved
        tensors, the root's, the loss gradients (the head is not split), and (when checkpointing)
        one block being rebuilt."""
        s, c = self.shape, self.compute_bytes
        saved = s.n_layer * self.per_layer_activation_bytes(tp=tp)
        root = self.tokens * (2 * s.hidden * c + 4 * s.vocab)  # final norm in/out, fp32 log-probs
        loss_grads = self.tokens * (4 + c) * s.vocab           # grad of the fp32 logits and its bf16 cast
        rebuilt = self.per_layer_activation_bytes("none", tp=tp) if self.checkpointing != "none" else 0.0
        return saved + root + loss_grads + rebuilt

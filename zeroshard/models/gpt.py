"""A one-file GPT: token + position embeddings, pre-norm blocks, a tied LM head.

The model is deliberately plain so that the sharding code can be read against it:
every block is a natural FSDP unit, and the root owns the embeddings and the head.
The LM head's weight *is* the token embedding's weight (one Parameter object), which is
the tied-weight case the wrap policy and checkpoints must handle (one owner, one storage).

Initialisation lives in ``GPT.init_weights()`` so it can be replayed after a meta-device
build: ``with torch.device("meta"): m = GPT(cfg)`` then ``m.to_empty(device=...)`` and
``m.init_weights()`` under the same ``torch.manual_seed`` gives bitwise the same parameters
as building the model directly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "GPTExperts", "Block"]

IGNORE_INDEX = -100
"""Target value excluded from the loss (matches ``F.cross_entropy``'s default)."""

# Sizes by name. Only the shape fields; vocab_size and the rest keep their defaults
# unless overridden. Parameter counts below are for vocab_size=256.
_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.2M params: fast enough for unit tests on a laptop CPU.
    "tiny": {"n_layer": 4, "n_head": 4, "n_embd": 64, "seq_len": 64},
    # ~25M params: a real model that still trains on a few CPU cores.
    "small": {"n_layer": 8, "n_head": 8, "n_embd": 512, "seq_len": 256},
    # ~116M params: GPT-2-small scale once the 50k vocabulary is taken out.
    "medium": {"n_layer": 12, "n_head": 14, "n_embd": 896, "seq_len": 512},
    # tiny with a 4-expert, top-2 MoE MLP in every block (~0.6M params, ~0.3M active per token)
    # and a load-balancing loss.
    "tiny-moe": {"n_layer": 4, "n_head": 4, "n_embd": 64, "seq_len": 64, "n_expert": 4, "aux_loss_coef": 0.01},
}


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a layer count is always a mistake.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT. Build by name with ``GPTConfig.named("tiny")``."""

    vocab_size: int = 256
    """Number of token ids; 256 covers byte-level text."""
    seq_len: int = 128
    """Maximum context length (size of the position embedding table)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Residual stream width."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of n_embd."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""
    n_expert: int = 0
    """Experts per MoE MLP; 0 keeps the dense MLP. Each expert is an MLP of the dense one's shape."""
    expert_top_k: int = 2
    """Experts each token is routed to (top-k of the router's softmax, weights renormalised); no
    capacity limit, so routing is dropless."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss (Switch/Mixtral: n_expert * sum_e f_e * P_e, f_e the share
    of routed assignments and P_e the mean router probability of expert e, averaged over the MoE
    layers) added to the token loss; 0 adds none."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "mlp_ratio", "expert_top_k"):
            _check_positive_int(name, getattr(self, name))
        if isinstance(self.n_expert, bool) or not isinstance(self.n_expert, int) or self.n_expert < 0:
            raise ValueError(f"GPTConfig.n_expert must be an int >= 0 (0: a dense MLP), got {self.n_expert!r}")
        if isinstance(self.aux_loss_coef, bool) or not isinstance(self.aux_loss_coef, (int, float)) or \
                self.aux_loss_coef < 0:
            raise ValueError(f"GPTConfig.aux_loss_coef must be a number >= 0, got {self.aux_loss_coef!r}")
        if self.n_expert and self.expert_top_k > self.n_expert:
            raise ValueError(f"GPTConfig.expert_top_k ({self.expert_top_k}) must be at most n_expert "
                             f"({self.n_expert}); route each token to fewer experts")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head among the divisors of n_embd"
            )
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be a bool, got {self.bias!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def named(cls, name: str, **overrides: Any) -> GPTConfig:
        """The preset ``name`` (tiny, small, medium) with any field overridden."""
        if name not in _PRESETS:
            raise ValueError(
                f"unknown GPT size {name!r}; valid names are {', '.join(sorted(_PRESETS))}"
            )
        return cls(**{**_PRESETS[name], **overrides})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(_PRESETS)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, the form stored in checkpoints."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"GPTConfig.from_dict got unknown keys {unknown}; valid keys are {sorted(known)} "
                f"(was the checkpoint written by a newer zeroshard?)"
            )
        return cls(**d)


class PackedMask:
    """The block-diagonal causal mask of the forward in flight, or None (plain causal attention).

    One object shared by the model and every attention layer: the blocks keep their one-tensor
    signature (activation checkpointing chains them, pipelines cut between them), and a recompute in
    backward reads the mask its own micro-step's forward set."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None

    def set(self, position_ids: torch.Tensor | None) -> None:
        """From ``position_ids`` (B, T): a new sample starts wherever a position is not its
        predecessor's plus one (transformers' rule for packed sequences), and attends only inside it."""
        if position_ids is None:
            self.mask = None
            return
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        segment = (step != 1).cumsum(-1)  # (B, T)
        T = position_ids.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
        self.mask = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]  # (B, 1, T, T)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.packed: PackedMask | None = None  # set by GPT: its shared mask for packed samples
        self.n_head = cfg.n_head
        # One fused projection: a single GEMM (and one parameter to shard) instead of three.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        # Context parallelism (zeroshard/parallel/cp) puts its exact split attention here: (q, k, v)
        # of this rank's tokens -> their rows of causal attention over the whole sequence.
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x)
        # Under tensor parallelism qkv holds only this rank's heads (width C / tp; see
        # zeroshard/runtime/tp.py), so the head count is read from the width, not the config.
        width = qkv.shape[-1] // 3
        heads = width // (C // self.n_head)
        q, k, v = qkv.split(width, dim=2)  # 3 x (B, T, width)
        # (B, T, width) -> (B, nh, T, hd): heads become a batch dimension for SDPA.
        q = q.view(B, T, heads, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, heads, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, heads, C // self.n_head).transpose(1, 2)
        mask = self.packed.mask if self.packed is not None else None
        if self.attend is not None:  # context parallelism: its split attention (packed samples' too)
            y = self.attend(q, k, v)  # (B, nh, T, hd)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        else:  # packed samples: causal inside each one, nothing across
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, width)  # (B, T, width)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


def gpt_expert(experts: Any, e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a ``GPTExperts`` on the rows routed to it: the dense MLP's function."""
    hidden = F.linear(rows, experts.fc_weight[e], experts.fc_bias[e] if experts.fc_bias is not None else None)
    return F.linear(F.gelu(hidden), experts.proj_weight[e],
                    experts.proj_bias[e] if experts.proj_bias is not None else None)


class GPTExperts(nn.Module):
    """``n_expert`` MLPs stacked on dim 0 (transformers 5's layout, which expert parallelism splits):
    ``forward(hidden (T, C), top_k_index (T, k), top_k_weights (T, k)) -> (T, C)``."""

    PARAMS = ("fc_weight", "fc_bias", "proj_weight", "proj_bias")

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_expert
        hidden, e, c = cfg.mlp_ratio * cfg.n_embd, cfg.n_expert, cfg.n_embd
        self.fc_weight = nn.Parameter(torch.empty(e, hidden, c))
        self.fc_bias = nn.Parameter(torch.empty(e, hidden)) if cfg.bias else None
        self.proj_weight = nn.Parameter(torch.empty(e, c, hidden))
        self.proj_bias = nn.Parameter(torch.empty(e, c)) if cfg.bias else None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.PARAMS if getattr(self, n) is not None)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = gpt_expert(self, e, hidden_states[token]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        return out


class MoEMLP(nn.Module):
    """Top-k routed experts in place of the MLP: the router's softmax picks ``expert_top_k``
    experts per token, their weights renormalised to sum to 1 (Mixtral's rule), no capacity cap.

    With ``aux_loss_coef > 0`` each forward leaves ``aux_sum``: the load-balancing loss of its
    rows in sum form, ``n_expert * sum_e f_e * (sum over rows of p_e)``, so that, like the token
    loss, it adds over rows and divides once by the token count. ``f_e`` is a share of the whole
    batch's routing: ``reduce_counts``, when set (``zeroshard.trainer.step.build`` and expert parallelism
    set it to an all-reduce over the data-parallel ranks), sums the per-expert counts over every rank first, which makes the
    loss the one one process computes over the whole (micro-)batch.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.expert_top_k
        self.balance = cfg.aux_loss_coef > 0
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = GPTExperts(cfg)
        self.aux_sum: torch.Tensor | None = None
        self.reduce_counts: Callable[[torch.Tensor], None] | None = None
        """Sums a float64 (n_expert,) count tensor in place over the ranks sharing the batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (B*T, n_expert)
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # (B*T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.balance:
            # scatter_add, not bincount: bincount sizes its output from the values (a host sync on CUDA).
            flat_index = index.reshape(-1)
            counts = torch.zeros(probs.shape[-1], dtype=torch.int64, device=flat_index.device)
            counts = counts.scatter_add_(0, flat_index, torch.ones_like(flat_index)).to(torch.float64)
            if self.reduce_counts is not None:
                self.reduce_counts(counts)
            share = (counts / (counts.sum() / self.top_k)).to(probs.dtype)  # f_e: sums to top_k
            self.aux_sum = probs.shape[-1] * (share * probs.sum(dim=0)).sum()
        return self.experts(flat, index, weights.to(x.dtype)).view(B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block; the natural unit for per-module sharding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp: nn.Module = MoEMLP(cfg) if cfg.n_expert else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        x = x + self.mlp(self.ln2(x))  # (B, T, C)
        return x


# Linears that write into the residual stream. Their init is shrunk by depth so the
# residual's variance does not grow with the number of blocks (GPT-2 trick).
_RESIDUAL_PROJ_SUFFIXES = (".attn.proj", ".mlp.proj")


class GPT(nn.Module):
    """Decoder-only transformer; ``lm_head.weight is tok_emb.weight``.

    Built under ``torch.device("meta")`` it allocates nothing; ``to_empty`` then
    ``init_weights()`` materialises it with the same bits a direct build would have.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Context parallelism (zeroshard/parallel/cp): (local length, device) -> the global
        # positions of this rank's tokens; None is positions 0..T-1.
        self.positions: Callable[[int, torch.device], torch.Tensor] | None = None
        # Layers are built on meta so their default inits draw nothing from the RNG;
        # only init_weights does. That makes a direct build and a meta build followed by
        # init_weights() consume the same random numbers, hence give the same bits.
        device = torch.get_default_device()  # honours an enclosing `with torch.device(...)`
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.norm_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        self.packed = PackedMask()
        for module in self.modules():
            if isinstance(module, CausalSelfAttention):
                module.packed = self.packed
        self.init_weights()  # also ties lm_head to tok_emb

    @property
    def ep_plan(self) -> dict[str, str]:
        """Where the experts are, in transformers' ``base_model_ep_plan`` format (``*``: a block
        number), which expert parallelism reads (zeroshard/parallel/experts/plan.py); {} without MoE."""
        if not self.cfg.n_expert:
            return {}
        return {"blocks.*.mlp.experts": "ep_dispatch_experts",
                **{f"blocks.*.mlp.experts.{name}": "grouped_gemm" for name in GPTExperts.PARAMS}}

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very Parameter object of ``tok_emb.weight``.

        ``Module.to_empty`` (meta -> real device) creates a new Parameter per module and
        so silently unties them; ``init_weights`` calls this first to restore the tie.
        """
        self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG.

        The RNG is consumed in ``named_modules()`` order, one draw per parameter, so the
        result depends only on the seed: replaying this after a meta-device build gives
        the same bits. The tied matrix is drawn once (as the embedding, std 0.02).
        """
        self.tie_weights()
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        done: set[int] = set()  # ids of already-initialised params (the tied weight)

        def fresh(p: torch.Tensor | None) -> bool:
            if p is None or id(p) in done:
                return False
            done.add(id(p))
            return True

        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if fresh(module.weight):
                    s = resid_std if name.endswith(_RESIDUAL_PROJ_SUFFIXES) else std
                    nn.init.normal_(module.weight, mean=0.0, std=s)
                if fresh(module.bias):
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                if fresh(module.weight):
                    nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                if fresh(module.weight):
                    nn.init.ones_(module.weight)
                if fresh(module.bias):
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GPTExperts):  # each expert as the dense MLP's fc and proj
                if fresh(module.fc_weight):
                    nn.init.normal_(module.fc_weight, mean=0.0, std=std)
                if module.fc_bias is not None and fresh(module.fc_bias):
                    nn.init.zeros_(module.fc_bias)
                if fresh(module.proj_weight):
                    nn.init.normal_(module.proj_weight, mean=0.0, std=resid_std)
                if module.proj_bias is not None and fresh(module.proj_bias):
                    nn.init.zeros_(module.proj_bias)

    def _logits(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}; "
                f"truncate the input or build the model with a larger seq_len"
            )
        # Under context parallelism its attention masks packed samples by the whole rows' documents.
        self.packed.set(position_ids if self.positions is None else None)
        if position_ids is not None:  # packed samples: positions restart in each
            pos = position_ids  # (T,) or (B, T)
        elif self.positions is not None:  # context parallelism: this rank's tokens' global positions
            pos = self.positions(T, idx.device)  # (T,)
        else:
            pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        x = self.norm_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)

    def _token_losses(
        self, idx: torch.Tensor, targets: torch.Tensor, reduction: str, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = self._logits(idx, position_ids)  # (B, T, V)
        # The softmax is computed in fp32 even when the model runs in bf16/fp16: a
        # low-precision log-sum-exp over the vocabulary loses the digits the loss lives in.
        aux = self._aux_sum()
        loss = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),  # (B*T, V)
            targets.reshape(-1),  # (B*T,)
            ignore_index=IGNORE_INDEX,
            reduction=reduction if aux is None else "sum",
        )
        if aux is None:
            return loss
        # The load-balancing loss in sum form next to the token losses; a mean divides both once.
        loss = loss + self.cfg.aux_loss_coef * aux
        return loss if reduction == "sum" else loss / (targets != IGNORE_INDEX).sum()

    def _aux_sum(self) -> torch.Tensor | None:
        """The MoE layers' load-balancing losses of this forward, in sum form, averaged over layers."""
        if not self.cfg.aux_loss_coef:
            return None
        terms = [m.aux_sum for m in self.modules() if isinstance(m, MoEMLP) and m.aux_sum is not None]
        return torch.stack(terms).mean() if terms else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean", position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``, or with ``targets`` the loss over non-ignored tokens:
        their mean (``reduction="mean"``) or their sum (``"sum"``).

        Targets equal to -100 are excluded from both the sum and the count. ``position_ids`` (B, T)
        that restart at 0 mark packed samples: each attends only inside itself (``PackedMask``).
        """
        if targets is None:
            return self._logits(idx, position_ids)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        return self._token_losses(idx, targets, reduction=reduction, position_ids=position_ids)

    def loss_sum(
        self, idx: torch.Tensor, targets: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of per-token losses, number of counted tokens)`` as 0-dim tensors.

        Ranks all-reduce both and divide once, so a global batch whose ranks hold
        different numbers of real tokens is weighted per token, not per rank.
        """
        # Through __call__, not _token_losses: a sharded runtime gathers params in forward hooks.
        total = self(idx, targets, reduction="sum", position_ids=position_ids)
        n_tokens = (targets != IGNORE_INDEX).sum()
        return total, n_tokens

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, counting the tied embedding/head matrix once.

        With ``exclude_embeddings`` both lookup tables (token and position) are left out,
        which also leaves out the LM head since it is the same matrix.
        Works on meta-device models (only shapes are read).
        """
        skip = {id(self.tok_emb.weight), id(self.pos_emb.weight)} if exclude_embeddings else set()
        seen: set[int] = set()
        total = 0
        for p in self.parameters():  # parameters() already yields a shared one once
            if id(p) in seen or id(p) in skip:
                continue
            seen.add(id(p))
            total += p.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        ``6 * N + 6 * n_layer * seq_len * n_embd`` where

        - ``N`` is the number of parameters that take part in a matmul: all of them
          except the position table (a lookup). The tied matrix counts once, through
          the LM head; the token lookup itself is free. Norms and biases are included
          though they are not matmuls; they are a rounding error at these sizes.
          Each such weight costs 2 FLOPs per token forward and 4 backward, hence 6N.
        - attention scores and the weighted sum cost ``2 * 2 * seq_len * n_embd`` per
          token per layer forward for full attention, times 3 with backward, i.e.
          ``12 * n_layer * seq_len * n_embd``; causal attention only needs the lower
          triangle, so we count half of that: ``6 * n_layer * seq_len * n_embd``.
        """
        cfg = self.cfg
        n = self.num_params() - self.pos_emb.weight.numel()
        if cfg.n_expert:  # a token runs expert_top_k of the n_expert experts
            expert = sum(p.numel() for m in self.modules() if isinstance(m, GPTExperts) for p in m.parameters())
            n -= expert - expert * cfg.expert_top_k // cfg.n_expert
        return 6 * n + 6 * cfg.n_layer * cfg.seq_len * cfg.n_embd

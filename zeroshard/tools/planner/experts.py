"""Expert parallelism in the plan: which params are experts, how a rank holds them, what routing moves.

The MoE layers are the runtime's own (``zeroshard.parallel.experts.check_ep``, the layout of the ep plan the
model declares), read off the meta-device model, so the plan splits exactly the params ``zs.expert_parallel``
splits and refuses what it refuses (an ep that does not divide a layer's experts, a model with no
MoE layer). Per rank, as the runtime lays them out (docs/expert_parallel.md):

- an expert param keeps ``1/ep`` of its rows (experts on dim 0), and its flat groups are sharded
  over the ``world / ep`` expert-data-parallel ranks that hold the same experts (``dp / ep``
  without tp; none at stage 0);
  the inventory lays out that block with the runtime's ``FlatLayout``, so padding is as ``zs.shard``
  pads it; dense params are sharded over every data-parallel rank as without ep;
- every MoE layer call exchanges, over ep, the per-expert counts (an even all-to-all of E int64),
  then the routed rows and the experts' outputs (``tokens × top_k`` rows of ``hidden`` each way,
  in the compute dtype), and backward the same two row exchanges reversed. That is what the ledger
  records for them (the output of each: zeroshard/parallel/experts/dispatch.py);
- under tensor parallelism (ep borrows its ranks from dp × tp; the experts are not tp split) the
  layer's input is replicated over a tp group and each tp rank routes only its run of the tokens
  (``zeroshard.parallel.experts.tp_tokens.run_of``: ``c = ceil(tokens / tp)``, the busiest rank's), so its
  all-to-alls carry ``c × top_k`` rows, and the outputs are all-gathered over tp, each run padded
  to ``c`` rows: forward the outputs (``hidden`` wide), backward the input rows' and the routing
  weights' grads (``hidden`` and ``top_k`` wide), ``tp × c`` rows each as the ledger counts them;
- routing skew: ``skew`` is the share of extra rows the busiest ep rank receives over the balanced
  ``tokens × top_k`` (0: balanced; 1: twice its share). The busiest rank's receive and return
  buffers, and so the all-to-alls it waits on, grow by ``1 + skew``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zeroshard.tools.planner.comm import Collective


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertLayerShape:
    """One MoE layer as the plan needs it."""

    name: str
    num_experts: int
    params: tuple[str, ...]
    """Fully qualified names of its stacked expert params (dim 0 = expert)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertSplit:
    """The ep degree of a plan and the MoE layers it splits. ``ep=1`` splits nothing."""

    ep: int = 1
    layers: tuple[ExpertLayerShape, ...] = ()
    top_k: int = 0
    """Experts each token is routed to (the model's router); 0 without MoE layers."""
    hidden: int = 0
    """Width of a routed row (the model's hidden size)."""
    tp: int = 1
    """The dense mesh's tp degree: a tp group's ranks split the layer's tokens between them."""

    @property
    def params(self) -> frozenset[str]:
        return frozenset(p for layer in self.layers for p in layer.params) if self.ep > 1 else frozenset()

    def within(self, names: set[str]) -> ExpertSplit:
        """The MoE layers whose params are among ``names``: a pipeline stage's, split as the whole
        model's (the runtime splits the experts before it cuts the stages)."""
        return dataclasses.replace(self, layers=tuple(layer for layer in self.layers
                                                      if all(p in names for p in layer.params)))

    def is_expert(self, fqn: str) -> bool:
        return fqn in self.params

    def local_shape(self, fqn: str, shape: torch.Size) -> torch.Size:
        """This rank's block of an expert param (dim 0 divided by ep); a dense param whole."""
        if not self.is_expert(fqn):
            return torch.Size(shape)
        return torch.Size((shape[0] // self.ep, *shape[1:]))

    def calls(self) -> int:
        """MoE layer calls per micro-step forward."""
        return len(self.layers) if self.ep > 1 else 0

    def routed_tokens(self, tokens: int) -> int:
        """Tokens of a micro-batch of ``tokens`` the busiest rank routes: all of them, or under tp
        its run (tp rank 0's, the longest: the runtime's own cut)."""
        from zeroshard.parallel.experts.tp_tokens import run_of

        return tokens if self.tp == 1 else run_of(tokens, self.tp, 0)[2]

    def row_bytes(self, tokens: int, compute_bytes: int, skew: float = 0.0) -> int:
        """Bytes of one exchange of routed rows for a micro-batch of ``tokens`` on the busiest rank
        (its routed tokens ``× top_k`` rows of ``hidden``, times ``1 + skew``)."""
        return int(round(self.routed_tokens(tokens) * self.top_k * (1.0 + skew))) * self.hidden * compute_bytes

    def tp_gather_bytes(self, tokens: int, compute_bytes: int) -> tuple[int, int]:
        """Under tp, one MoE layer call's tp all-gathers as the ledger counts them (the gathered
        output, every run padded to ``c`` rows): (the ``hidden``-wide one, forward and backward;
        the ``top_k``-wide routing weights' grads, backward). (0, 0) at tp 1."""
        if self.tp == 1:
            return 0, 0
        rows = self.tp * self.routed_tokens(tokens)
        return rows * self.hidden * compute_bytes, rows * self.top_k * compute_bytes

    def buffer_bytes(self, tokens: int, compute_bytes: int, skew: float = 0.0) -> int:
        """The all-to-all buffers of one MoE layer call in forward, on the busiest rank: the rows it
        sends (gathered in expert order), the rows it receives, the experts' outputs and the
        outputs returned to it, alive together while the outputs return. The ones a rank
        receives are skewed; the ones it sends are its own."""
        return 2 * self.backward_buffer_bytes(tokens, compute_bytes, skew)

    def backward_buffer_bytes(self, tokens: int, compute_bytes: int, skew: float = 0.0) -> int:
        """One exchange of backward: the grads a rank sends and the ones it receives, next to the
        layer's backward temporaries (the rows themselves are saved activations)."""
        return self.row_bytes(tokens, compute_bytes) + self.row_bytes(tokens, compute_bytes, skew)


def _top_k_and_hidden(model: nn.Module) -> tuple[int, int]:
    """The model's routing top-k and hidden size: zeroshard's GPT config, or an HF config's
    ``num_experts_per_tok`` and ``hidden_size`` (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    cfg: Any = getattr(model, "cfg", None)
    if hasattr(cfg, "expert_top_k") and hasattr(cfg, "n_embd"):
        return int(cfg.expert_top_k), int(cfg.n_embd)
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    hidden = getattr(config, "hidden_size", None)
    if top_k is None or hidden is None:
        raise ValueError(f"cannot read the routing of {type(model).__name__}: its config has no num_experts_per_tok "
                         "or hidden_size; plan it with ep=1")
    return int(top_k), int(hidden)


def expert_split(model: nn.Module, ep: int, tp: int = 1) -> ExpertSplit:
    """The MoE layers of ``model`` (on any device, meta included) split over ``ep`` ranks, checked
    as ``zs.expert_parallel`` checks them: one line when ep cannot split the model. ``tp``: the
    dense mesh's tp degree, whose ranks split each layer's tokens."""
    if ep == 1:
        return ExpertSplit()
    from zeroshard.parallel.experts import check_ep

    layers = check_ep(model, ep)
    top_k, hidden = _top_k_and_hidden(model)
    return ExpertSplit(ep=ep, top_k=top_k, hidden=hidden, tp=tp, layers=tuple(
        ExpertLayerShape(name=layer.name, num_experts=layer.num_experts,
                         params=tuple(f"{layer.name}.{p}" for p in layer.params)) for layer in layers))


def ep_collectives(split: ExpertSplit, *, tokens: int, compute_bytes: int, micro_steps: int, skew: float = 0.0,
                   gpus_per_node: int | None = None) -> tuple[Collective, ...]:
    """The ep all-to-alls of one optimizer step on the busiest rank, per micro-step and MoE layer
    call, as the ledger records them (each by the bytes this rank sends): the counts (E int64), then
    forward the rows it dispatches (``tokens × top_k`` of its own) and the outputs it combines back
    (the rows it received: skewed), and backward the same two reversed (the grads of the returned
    outputs, then of the received rows). ``tokens`` is one rank's micro-batch (under tp, its tp
    group's, of which it routes its run). Under tp, each call's tp all-gathers follow
    (``tp_gather_bytes``), on the tp group of ``tp`` consecutive ranks."""
    if not split.calls():
        return ()
    spans = gpus_per_node is not None and split.ep > gpus_per_node
    own, received = split.row_bytes(tokens, compute_bytes), split.row_bytes(tokens, compute_bytes, skew)
    layers = split.calls() * micro_steps
    out = [Collective(op="all_to_all", group="ep", size=split.ep, buffer_bytes=experts * 8, count=n * micro_steps,
                      spans_nodes=spans, phase="forward")
           for experts, n in sorted(_count_by_experts(split).items())]
    for phase in ("forward", "backward"):
        out.append(Collective(op="all_to_all", group="ep", size=split.ep, buffer_bytes=own, count=layers,
                              spans_nodes=spans, phase=phase))
        out.append(Collective(op="all_to_all", group="ep", size=split.ep, buffer_bytes=received, count=layers,
                              spans_nodes=spans, phase=phase))
    hidden, weights = split.tp_gather_bytes(tokens, compute_bytes)
    if hidden:
        tp_spans = gpus_per_node is not None and split.tp > gpus_per_node
        out += [Collective(op="all_gather", group="tp", size=split.tp, buffer_bytes=nbytes, count=layers,
                           spans_nodes=tp_spans, phase=phase)
                for nbytes, phase in ((hidden, "forward"), (hidden, "backward"), (weights, "backward"))]
    return tuple(out)


def _count_by_experts(split: ExpertSplit) -> dict[int, int]:
    """MoE layers by their expert count (each count exchange is one int64 per expert)."""
    out: dict[int, int] = {}
    for layer in split.layers:
        out[layer.num_experts] = out.get(layer.num_experts, 0) + 1
    return out

"""The expert-parallel forward of one MoE layer: route rows to the experts' ranks, compute, return.

It replaces the forward of the module holding the stacked experts (see plan.py for the contract)
and keeps the model's own routing: it is given the top-k indices and weights the model's router
chose. On each rank:

1. the (token, k) assignments are sorted by expert (stable, so rows keep token order within an
   expert) and counted per expert; dropped assignments (index outside the experts) are left out;
2. counts are exchanged over ep, then the rows go to the ranks holding their experts;
3. received rows (grouped by source rank, then expert) are regrouped by local expert, each
   expert runs once on all of its rows, and the outputs go back in the order they came;
4. each output is scaled by its routing weight and summed into its token, as the model does.

The received rows run through the experts module's own forward on this rank's block of experts
(``plan.LocalExperts``, top-1 with unit weights), so a token's output is the one one process
computes, up to the order of the top-k sum.

Under tensor parallelism (the dense mesh has tp > 1) the layer's input is replicated over the tp
group: each tp rank runs steps 1-4 on its own run of the tokens only, and the outputs are
all-gathered over tp (zeroshard/parallel/experts/tp_tokens.py), so every token reaches its experts once.
The routing weights are cut the same way, so the router's grads are whole on every tp rank.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm import host_sync
from zeroshard.parallel.experts.dispatch import all_to_all_rows, exchange_counts
from zeroshard.parallel.experts.plan import LocalExperts, MoELayer
from zeroshard.parallel.experts.tp_tokens import all_rows, own_rows, run_of


class ExpertParallelForward:
    """The replacement forward of ``layer.module``; this rank holds experts [first, first + local).
    ``dense`` is the mesh the model's dense params are on: its tp group shares the layer's tokens."""

    def __init__(self, layer: MoELayer, mesh: Any, dense: Any = None) -> None:
        self.layer = layer
        self.mesh = mesh  # the expert mesh: its ep group carries the rows
        self.dense = dense if dense is not None and dense.tp_size > 1 else None
        self.ep = mesh.ep_size
        self.local = layer.num_experts // self.ep
        self.experts = LocalExperts(layer.module, layer.num_experts, self.local)
        self.sent_rows: list[int] = []
        """Rows this rank sent to other ranks' experts and its own at each call (the tests' record)."""
        self.received_rows: list[int] = []
        self.tokens: list[int] = []
        """The layer's tokens at each call (under tp: the tp group's, before the cut)."""
        self.tp_runs: list[int] = []
        """Under tp, the padded run of tokens each tp rank dispatches and gathers back, at each call."""

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, unit = hidden_states.shape[0], self.layer.name
        self.tokens.append(tokens)
        if self.dense is None:
            return self._route(hidden_states, top_k_index, top_k_weights)
        start, stop, chunk = run_of(tokens, self.dense.tp_size, self.dense.tp_rank)
        self.tp_runs.append(chunk)
        out = self._route(own_rows(hidden_states, unit=unit, mesh=self.dense), top_k_index[start:stop],
                          own_rows(top_k_weights, unit=unit, mesh=self.dense))
        return all_rows(out, tokens, unit=unit, mesh=self.dense)

    def _route(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
        """Steps 1-4 on these rows."""
        layer, unit = self.layer, self.layer.name
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        kept = (experts >= 0) & (experts < layer.num_experts)  # outside: dropped by the model's capacity rule
        # Dropped assignments go to one bin past the experts: sorted last, counted apart, cut off below.
        binned = torch.where(kept, experts, layer.num_experts)
        order = torch.argsort(binned, stable=True)
        # A scatter-add, not bincount: bincount's length depends on the values, so it sizes its output
        # on the host (a sync); this one's size is fixed, and its integer counts are the same.
        counts = torch.zeros(layer.num_experts + 1, dtype=torch.int64, device=binned.device)
        counts = counts.scatter_add_(0, binned, torch.ones_like(binned))[:layer.num_experts].view(self.ep, self.local)
        recv_counts = exchange_counts(counts, unit=unit, mesh=self.mesh)
        # The host needs the splits: both count tables cross in one copy, the call's only host sync.
        both = host_sync.tolist(torch.cat([counts.reshape(-1), recv_counts.reshape(-1)]), "moe.splits")
        sent_table = [both[d * self.local:(d + 1) * self.local] for d in range(self.ep)]
        recv_table = [both[(self.ep + s) * self.local:(self.ep + s + 1) * self.local] for s in range(self.ep)]
        send, recv = [sum(row) for row in sent_table], [sum(row) for row in recv_table]
        order = order[:sum(send)]
        token_of = order // k
        self.sent_rows.append(sum(send))
        self.received_rows.append(sum(recv))
        received = all_to_all_rows(hidden_states[token_of], send, recv, unit=unit, mesh=self.mesh)
        outputs = self._run_experts(received, recv_counts, recv_table)
        returned = all_to_all_rows(outputs, recv, send, unit=unit, mesh=self.mesh)
        # The weight in its own dtype, as the model's forward multiplies (DeepSeek-V3's are float32).
        weights = top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (returned * weights[:, None]).to(out.dtype))

    def _run_experts(self, received: torch.Tensor, recv_counts: torch.Tensor,
                     recv_table: list[list[int]]) -> torch.Tensor:
        """Rows arrive grouped by (source rank, local expert); each expert runs once on its rows.
        ``recv_table`` is ``recv_counts`` already on the host: no further sync here."""
        local = torch.arange(self.local, device=received.device).repeat(self.ep)
        expert_of_row = torch.repeat_interleave(local, recv_counts.reshape(-1), output_size=received.shape[0])
        if self.layer.expert is None:  # the module's own forward, on local expert ids
            return self.experts(received, expert_of_row)
        by_expert = torch.argsort(expert_of_row, stable=True)
        chunks = received[by_expert].split([sum(row[e] for row in recv_table) for e in range(self.local)])
        # Every local expert runs, on zero rows if none came: its params then get a zero grad, so
        # each rank's reduction holds the same params in every step.
        expert = self.layer.expert
        computed = torch.cat([expert(self.layer.module, e, rows) for e, rows in enumerate(chunks)])
        return computed[torch.argsort(by_expert)]

"""Held-out loss during training: every rank evaluates its share, one all-reduce makes the exact mean.

The held-out rows are cut as a training batch is: global batches of (micro-batch x data-parallel
ranks) rows in dataset order, each rank taking its contiguous slice. The last global batch is
filled with rows that carry no loss (every target -100), so every rank runs the same number of
forwards, which stage 3 needs (each forward gathers params with the other ranks). Each rank sums
its token losses and counts its loss-carrying tokens in float64; one all-reduce of the two over the
data-parallel ranks gives the token mean over every held-out sample, whatever the world size, the
stage or the micro-batch: the number one process computes over the whole set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.comm.collectives import all_reduce
from zeroshard.observing.rank_metrics import METRICS_PHASE
from zeroshard.trainer import adapter
from zeroshard.trainer.data import collate
from zeroshard.trainer.data_pack import IGNORE_INDEX, collate_positions

__all__ = ["EvalResult", "evaluate", "rank_rows"]


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Mean token loss over every held-out sample's loss-carrying tokens."""
    tokens: int
    """Loss-carrying tokens counted."""
    metric_bytes: int
    """Bytes of the one all-reduce."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def fields(self) -> dict[str, float]:
        """As metrics.jsonl and the loggers name them."""
        return {"eval_loss": self.loss, "eval_perplexity": self.perplexity, "eval_tokens": self.tokens}


def rank_rows(num_rows: int, micro: int, dp: int, dp_rank: int) -> list[list[int | None]]:
    """This rank's micro-batches of row indices; None is a filler row that carries no loss."""
    per_batch = micro * dp
    batches = -(-num_rows // per_batch)
    out = []
    for b in range(batches):
        lo = b * per_batch + dp_rank * micro
        out.append([i if i < num_rows else None for i in range(lo, lo + micro)])
    return out


def _batch(dataset: Any, rows: list[int | None], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    real = [0 if i is None else i for i in rows]
    x, y = collate(dataset, real)
    for j, i in enumerate(rows):
        if i is None:
            y[j] = IGNORE_INDEX
    pos = collate_positions(dataset, real)
    return x.to(device), y.to(device), None if pos is None else pos.to(device)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: Any, mesh: Any, *, micro: int) -> EvalResult:
    """The held-out loss of ``dataset`` (every row) for a `zs.shard` model, on every rank; collective."""
    was_training = model.training
    model.eval()  # no dropout: the held-out loss is the model's, not a draw of it
    try:
        totals = torch.zeros(2, dtype=torch.float64, device=mesh.device)
        for rows in rank_rows(len(dataset), micro, mesh.dp_size, mesh.dp_rank):
            x, y, pos = _batch(dataset, rows, mesh.device)
            loss_sum, count = adapter.loss_sum(model, x, y, pos)
            totals += torch.stack([loss_sum.detach().double(), count.double()])
    finally:
        model.train(was_training)
    all_reduce(totals, op="sum", group=mesh.dp_name, phase=METRICS_PHASE, mesh=mesh)
    if float(totals[1]) == 0:
        raise ValueError("the held-out data has no token to take a loss on; check --eval-data")
    return EvalResult(loss=float(totals[0] / totals[1]), tokens=int(totals[1]),
                      metric_bytes=totals.numel() * totals.element_size())


def reference_eval(model: torch.nn.Module, dataset: Any) -> float:
    """One process, every held-out row in one pass each: the number `evaluate` must equal."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for i in range(len(dataset)):
            x, y = collate(dataset, [i])
            loss_sum, n = adapter.loss_sum(model, x, y, collate_positions(dataset, [i]))
            total += loss_sum.double()
            count += int(n)
    return float(total / count)

"""Rank the measured candidates by useful tokens per second and turn the winner into a config.

"Useful" tokens are the global batch's tokens per optimizer step: recomputation (checkpointing)
and extra communication count as cost, never as work.
"""

from __future__ import annotations

from typing import Any

from zeroshard.tools.search import ranked
from zeroshard.trainer.config import TrainConfig
from zeroshard.tools.tune.grid import Candidate
from zeroshard.tools.tune.prune import Prediction, Pruned, mb

WORKLOAD_KEYS = ("model", "nproc", "batch", "seq_len", "mp", "accum")
"""Always written: the workload the ranking was measured on, so the file reproduces it."""


def rank(rows: list[dict], cands: list[Candidate], predictions: dict[Candidate, Prediction],
         pruned: list[Pruned]) -> list[dict]:
    """Measured rows fastest first, then failed ones, then pruned ones; each with its prediction."""
    for row, cand in zip(rows, cands):
        row["predicted_allocated_bytes"] = predictions[cand].allocated
        row["predicted_total_bytes"] = predictions[cand].total
    ok = ranked((r for r in rows if r["status"] == "ok"), lambda r: -r["tokens_per_s"], exact=True)
    best = ok[0]["tokens_per_s"] if ok else None
    for i, row in enumerate(ok, 1):
        row["rank"] = i
        row["vs_best"] = row["tokens_per_s"] / best
    failed = [r for r in rows if r["status"] != "ok"]
    dropped = [{"candidate": p.candidate.name, **p.candidate.train_keys(), "status": "pruned", "reason": p.reason,
                "predicted_allocated_bytes": p.prediction.allocated, "predicted_total_bytes": p.prediction.total}
               for p in pruned]
    return ok + failed + dropped


def tuned_values(base: TrainConfig, winner: dict) -> dict[str, Any]:
    """The winner's keys on top of the base config, keeping only what differs from the defaults
    (plus the workload), so the file reads as the decisions rather than a dump of every field."""
    # Every key a candidate sets (Candidate.train_keys), so the file runs what was measured.
    keys = {k: winner[k] for k in ("stage", "checkpointing", "bucket_mb", "prefetch", "reshard_after_forward",
                                   "comm_quant", "pp_schedule", "microbatches", "ep") if k in winner}
    cfg = base.replace(**keys)  # validates the result before anything is written
    defaults = TrainConfig().to_dict()
    values = cfg.to_dict()
    return {k: v for k, v in values.items() if k in WORKLOAD_KEYS or k in keys or v != defaults[k]}


def header(winner: dict, ranked: list[dict], base: TrainConfig, budget: int | None) -> str:
    ok = [r for r in ranked if r["status"] == "ok"]
    lines = [f"written by zeroshard tune: {winner['candidate']} won at {winner['tokens_per_s']:,.0f} useful tokens/s "
             f"(median step {winner['median_step_s'] * 1e3:.1f} ms)",
             f"workload: {base.model}, {base.nproc} ranks, tp {base.tp}{f', ep {base.ep}' if base.ep > 1 else ''}, "
             f"global batch {base.batch} x {base.seq_len}, "
             f"{base.mp}, accum {base.accum}",
             f"{len(ok)} measured, {sum(r['status'] == 'failed' for r in ranked)} failed, "
             f"{sum(r['status'] == 'pruned' for r in ranked)} pruned"
             + (f" by the planner at {mb(budget)} per rank" if budget else "")]
    if len(ok) > 1:
        lines.append(f"runner-up: {ok[1]['candidate']} at {ok[1]['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)


def close_call(ranked: list[dict]) -> bool:
    """Whether the runner-up is within the winner's measured spread: the order may be noise."""
    ok = [r for r in ranked if r["status"] == "ok"]
    if len(ok) < 2:
        return False
    return ok[1]["tokens_per_s"] >= ok[0]["tokens_per_s"] * (1 - ok[0]["spread"] / 2)

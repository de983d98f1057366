"""Drop the candidates the planner says cannot fit the device, before spending time measuring them.

The planner's per-rank total (allocated peak + allocator headroom) is what must fit, as in
`zeroshard plan --device-mem`; the allocated peak is kept too, because that is what a measured peak
of live tensors is comparable with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.trainer.config import TrainConfig
from zeroshard.tools.tune.grid import LAYOUT, Candidate


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    total: int
    """Bytes per rank the device must hold: allocated peak + headroom."""
    allocated: int
    """Bytes per rank of live tensors at the peak."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pruned:
    candidate: Candidate
    prediction: Prediction
    budget: int

    @property
    def reason(self) -> str:
        return f"predicted {mb(self.prediction.total)} per rank > budget {mb(self.budget)}"


def mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def vocab_size(base: TrainConfig) -> int:
    # What zeroshard.trainer.train builds the model with: bytes for a text file, else the synthetic vocabulary.
    return 256 if base.data.path else base.vocab_size


def predict(cands: list[Candidate], base: TrainConfig, *, device: str = "cpu") -> dict[Candidate, Prediction]:
    """The planner's per-rank memory for each candidate, on ``base``'s model, world, batch and precision."""
    from zeroshard.trainer.targets import build_target, is_preset
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.api import plan

    # A preset as its config (the planner knows its activations); a folder or hf: model built on meta.
    gpt = GPTConfig.named(base.model, vocab_size=vocab_size(base), seq_len=base.seq_len) if is_preset(base.model) \
        else build_target(base.model, seq_len=base.seq_len, seed=base.seed,
                          vocab_size=vocab_size(base) if base.model.startswith("hf:") else None)
    plans: dict[tuple, object] = {}
    out: dict[Candidate, Prediction] = {}
    for c in cands:
        # One plan covers every stage; only the knobs that change some layout make a new one.
        knobs: dict[str, Any] = dict(checkpointing=c.checkpointing, prefetch=1 if c.prefetch is None else c.prefetch,
                     reshard_after_forward=True if c.reshard_after_forward is None else c.reshard_after_forward,
                     bucket_mb=base.engine.bucket_mb if c.bucket_mb is None else c.bucket_mb,
                     comm_quant=c.comm_quant, comm_quant_block=base.comm_quant_block)
        ep = base.ep if c.ep is None else c.ep
        cp = base.cp if c.cp is None else c.cp
        if base.pp > 1:
            out[c] = _pipeline_prediction(gpt, c, base, knobs, device, plans, ep=ep)
            continue
        key = tuple(sorted(knobs.items())) + (("ep", ep), ("cp", cp))
        if key not in plans:
            # The planner splits the experts over ep (zeroshard/tools/planner/experts.py) and refuses, in
            # one line, what it does not model yet (ep with tp).
            plans[key] = plan(gpt, world=base.nproc, tp=base.tp, ep=ep, cp=cp, cp_attention=base.cp_attention,
                              mp=base.mp, batch=base.batch, clip=base.clip,
                              seq=base.seq_len, accum=base.accum, accumulation=base.engine.accumulation,
                              device=device, optimizer="adamw", offload=base.engine.offload.kind,
                              optimizer_kwargs={"weight_decay": base.weight_decay, "foreach": True}, **knobs)
        # The run offloads as the base config says, so its layout is the plan's offload variant.
        name = LAYOUT[c.stage] + ("_offload" if base.engine.offload.kind != "none" else "")
        layout = plans[key][name].device  # type: ignore[index]
        out[c] = Prediction(total=layout.total, allocated=layout.allocated)
    return out


def _pipeline_prediction(gpt: Any, c: Candidate, base: TrainConfig, knobs: dict[str, Any], device: str,
                         plans: dict[tuple, Any], *, ep: int = 1) -> Prediction:
    """The worst pp rank's memory (``plan_pipeline``, as `plan --pp` plans it: a preset's config or
    any other model built on meta) for ``c`` under
    ``base``'s pipeline, with the candidate's schedule and microbatches where it sets them."""
    from zeroshard.tools.planner.pipeline import plan_pipeline

    pipe: dict[str, Any] = {"pp_schedule": c.pp_schedule or base.pp_schedule,
                            "microbatches": c.microbatches or base.microbatches}
    engine = {k: v for k, v in knobs.items() if k not in ("comm_quant", "comm_quant_block")}
    key = tuple(sorted({**engine, **pipe, "ep": ep}.items()))
    if key not in plans:
        plans[key] = plan_pipeline(gpt, world=base.nproc, pp=base.pp, pp_stages_per_rank=base.pp_stages_per_rank,
                                   batch=base.batch, seq=base.seq_len, accum=base.accum, tp=base.tp, ep=ep, mp=base.mp,
                                   device=device, optimizer="adamw", **pipe, **engine)
    name = LAYOUT[c.stage]
    ranks = plans[key].ranks
    return Prediction(total=max(r.plan[name].device.total for r in ranks),
                      allocated=max(r.plan[name].device.allocated for r in ranks))


def prune(cands: list[Candidate], predictions: dict[Candidate, Prediction],
          budget: int | None) -> tuple[list[Candidate], list[Pruned]]:
    """(kept, pruned) in grid order; no budget keeps everything."""
    if budget is None:
        return list(cands), []
    kept = [c for c in cands if predictions[c].total <= budget]
    pruned = [Pruned(candidate=c, prediction=predictions[c], budget=budget) for c in cands
              if predictions[c].total > budget]
    return kept, pruned

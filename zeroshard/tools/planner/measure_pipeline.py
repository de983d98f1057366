"""``plan --pp --measure``: one real pipeline step per planned stage on gloo, each rank's peak read
against the pipeline planner's figure for its pp rank.

The run is built as ``zeroshard train --pp`` builds it (``zeroshard.trainer.step.build`` with the plan's
pp fields, on a GPT of the planned config or the model --model names) and stepped by
``zeroshard.trainer.step.pipeline_step``. Step 1
is a warm-up (optimizer state, torch's receive buffers); step 2 is measured. The peak is storage
accounting, torch's ``MemTracker`` as in ``--measure``, with every tensor alive before the step
registered with it (found through the garbage collector, grads included), so torch's receive
buffers and what the previous step left count with the model states. As
in ``--measure`` without a pipeline, reductions are reaped only when the engine must
(``reap_when_done=False``), so the step reaches the bound the plan describes.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from typing import Any

import torch

from zeroshard.tools.planner.mem_tracker import memory_tracker
from zeroshard.tools.planner.pipeline import PipelinePlan
from zeroshard.tools.planner.spec import STAGE_NAMES


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCheck:
    layout: str
    pp_rank: int
    predicted: int
    """The plan's allocated peak for this pp rank."""
    measured: int
    """The worst of the pp rank's data-parallel ranks."""

    @property
    def error(self) -> float:
        return abs(self.predicted - self.measured) / max(self.measured, 1)


def _live_tensors(skip: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """Every tensor the garbage collector can reach, and their grads: the model states, the
    optimizer's, torch's receive buffers and whatever else outlives a step; storages in ``skip``
    left out."""
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op object warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type != "meta"]
    found += [t.grad for t in found if t.grad is not None]
    return [t for t in found if (ptr := _data_ptr(t)) is not None and ptr not in skip]


def _data_ptr(t: torch.Tensor) -> int | None:
    """``t``'s storage address; None for a wrapper with no storage of its own (a tp run's DTensor,
    whose local tensor the garbage collector finds on its own)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def pipeline_measure_worker(req: dict) -> dict:
    """Runs on every rank: each requested stage on a fresh model; returns this rank's peaks."""
    return pipeline_measure_many([req])[0]


def pipeline_measure_many(reqs: list[dict]) -> list[dict]:
    """``pipeline_measure_worker`` for several requests of one pp layout, in one process group."""
    from zeroshard.comm.world import init

    first = reqs[0]["config"]
    mesh = init(pp=reqs[0]["pp"], shard_size=reqs[0]["shard_size"], tp=first["tp"], ep=first["ep"])
    return [_measure_stages(req, mesh) for req in reqs]


def _measure_stages(req: dict, mesh) -> dict:
    from zeroshard.trainer import step as step_mod
    from zeroshard.trainer.config import TrainConfig
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.runtime.flat import StagePolicy

    out: dict[str, Any] = {"pp_rank": mesh.pp_rank}
    for stage in req["stages"]:
        # A knob the stage does not read is left out (pp_grad_reduce="microbatch" is refused at stages 0-1).
        knobs = {k: v for k, v in req["knobs"].items() if StagePolicy(stage).reads(k)}
        cfg = TrainConfig(**req["config"], **knobs, stage=stage, nproc=mesh.world)
        # What is alive before the build is not this run's (an earlier stage's run can outlive its
        # gc.collect(): torch's pipelining keeps references outside Python's reach).
        # They are held here until the measurement ends, so no storage of this run can take the
        # address of one (the skip set is by address).
        held = _live_tensors()
        earlier = frozenset(p for t in held if (p := _data_ptr(t)) is not None)
        torch.manual_seed(0)
        # zeroshard's GPT at the planned config; any other model as train builds it from --model
        model = GPT(GPTConfig.from_dict(req["gpt"])) if req["gpt"] is not None else None
        run = step_mod.build(cfg, mesh, model=model, reap_when_done=False)
        del model
        gen = torch.Generator().manual_seed(1000 + mesh.dp_rank)
        rows = cfg.batch // mesh.dp_size  # a tp group's ranks read the same rows
        x = torch.randint(0, req["vocab"], (rows, cfg.seq_len), generator=gen)
        y = torch.randint(0, req["vocab"], (rows, cfg.seq_len), generator=gen)
        step_mod.pipeline_step(run, x, y)  # warm-up
        gc.collect()
        tracker = memory_tracker(per_microbatch=True)
        tracker.track_external(*_live_tensors(earlier))
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            step_mod.pipeline_step(run, x, y)
        out[stage] = int(max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()))
        del run, tracker, held
        gc.collect()
    return out


def request(pplan: PipelinePlan, stages: tuple[int, ...], *, name: str, knobs: dict | None = None,
            target: Any = None) -> dict:
    """What the workers need: the plan's GPT and pipeline as TrainConfig fields (``name`` is the
    --model the config check reads; a GPT built is the planned config, any other model is built from
    ``name`` as train builds it; ``target``, the plan's --model as a Target, gives its vocabulary)."""
    shape = pplan.shape
    if pplan.gpt is None and target is None:
        raise ValueError(f"measuring a pipeline plan of {pplan.name} builds the model again on each rank: pass "
                         "target=zeroshard.trainer.targets.Target(spec=...) (the CLI's --model)")
    if pplan.gpt is not None:
        vocab = pplan.gpt.vocab_size
    else:
        from zeroshard.trainer import adapter

        vocab = adapter.token_vocab(target.build())
    return {"pp": shape.pp, "shard_size": None, "stages": tuple(stages), "vocab": vocab,
            "gpt": pplan.gpt.to_dict() if pplan.gpt is not None else None,
            "knobs": {**pplan.knobs, **(knobs or {})},
            "config": {"model": name, "pp": shape.pp, "tp": pplan.tp, "ep": pplan.ep, "pp_schedule": shape.schedule,
                       "microbatches": shape.microbatches, "pp_stages_per_rank": shape.stages_per_rank,
                       "batch": pplan.batch, "seq_len": pplan.seq, "accum": pplan.accum,
                       "num_samples": max(4096, pplan.batch), "clip": 0.0}}


def checks(pplan: PipelinePlan, per_rank: list[dict]) -> list[StageCheck]:
    out = []
    for stage in (k for k in per_rank[0] if k != "pp_rank"):
        name = STAGE_NAMES[stage]
        for r in pplan.ranks:
            measured = max(res[stage] for res in per_rank if res["pp_rank"] == r.pp_rank)
            out.append(StageCheck(layout=name, pp_rank=r.pp_rank, predicted=r.plan[name].device.allocated,
                                  measured=measured))
    return out


def measure(pplan: PipelinePlan, stages: tuple[int, ...], *, name: str, target: Any = None,
            timeout_s: float = 600.0) -> list[StageCheck]:
    from zeroshard.trainer.launch import spawn
    from zeroshard.parallel.pipeline.schedules import schedule_spec

    if schedule_spec(pplan.shape.schedule).split_backward:
        raise ValueError(f"plan measure reads each rank's peak with torch's MemTracker, whose module hooks fail inside "
                         f"the torch.autograd.grad calls of {pplan.shape.schedule}'s split backward; plan it without "
                         "--measure, or measure interleaved-1f1b (the same stages, each backward whole)")

    return checks(pplan, spawn(pipeline_measure_worker, pplan.world, args=(request(pplan, stages, name=name, target=target),),
                               timeout_s=timeout_s))

"""`zeroshard plan --pp N`: per-stage memory of a pipeline-parallel run and its bubble.

The pp flags are TrainConfig's own fields (`pp`, `pp_schedule`, `microbatches`,
`pp_stages_per_rank`), added from its table as `train` adds them, so both commands read them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroshard.cli.typed_flags import add_typed_flag

PP_FIELDS = ("pp", "pp_schedule", "microbatches", "pp_stages_per_rank")
"""The TrainConfig fields that describe a pipeline: `plan` takes them as `train` does."""
PP_KNOBS = ("pp_grad_reduce",)
"""The engine's knobs read only under a pipeline (among plan's knob flags, from the engine's table)."""

_UNPLANNED = {
    "params": "--pp plans a model's stages; pass --model (a preset, a save_pretrained folder, hf:NAME or module:Class)",
    "shard_size": "--pp does not plan hybrid sharding inside a stage yet; drop --shard-size",
    "plot": "--pp has no chart yet; drop --plot",
    "topology": "--pp takes --world; drop --topology",
    "routing_skew": "plan --pp counts a stage's experts with balanced routing; drop --routing-skew (plan --ep "
                    "without --pp weighs it)",
}


def size_unit(largest: int) -> tuple[float, str, int]:
    """(divisor, unit, digits) for a table whose largest figure is ``largest`` bytes."""
    # kB below a megabyte: a small test model's components would all print as 0.0 MB.
    return (1e9, "GB", 2) if largest >= 1e9 else (1e6, "MB", 1) if largest >= 1e6 else (1e3, "kB", 1)


def add_pp_flags(group: Any) -> None:
    from zeroshard.trainer.config import TrainConfig, field_help, field_type

    shown = TrainConfig().to_dict()
    for name in PP_FIELDS:
        add_typed_flag(group, name, field_type(name), f"{field_help(name)} (default: {shown[name]})")


def wants_pipeline(args: argparse.Namespace) -> bool:
    return (getattr(args, "pp", None) or 1) > 1


def unread_flag(args: argparse.Namespace) -> str | None:
    """A flag --pp would not read, as one line; or a pp flag given without --pp."""
    if not wants_pipeline(args):
        given = [f for f in PP_FIELDS[1:] + PP_KNOBS if getattr(args, f, None) is not None]
        return (f"--{given[0].replace('_', '-')} describes a pipeline; add --pp N (N >= 2) or drop it"
                if given else None)
    if args.time:
        for dest in ("sweep", "shard_sizes", "shard_size", "plot", "topology", "offload", "checkpointing", "ep",
                     "routing_skew"):
            if getattr(args, dest, None) not in (None, False, "none"):
                flag = "--" + dest.replace("_", "-")
                return f"plan time --pp does not replay {flag} yet; drop {flag}"
        if (args.accum or 1) > 1:
            return "plan time --pp replays one run of the schedule per step; drop --accum (or fold it into --microbatches)"
        return None
    for dest, why in _UNPLANNED.items():
        if getattr(args, dest, None) not in (None, False, "none"):
            return why
    if args.device_mem is not None:
        for dest in ("intra_gbps", "inter_gbps"):
            if getattr(args, dest, None) is not None:
                flag = "--" + dest.replace("_", "-")
                return f"--pp --device-mem times each candidate on --hw (its links and node size); drop {flag}"
        if args.measure:
            return "plan measure checks one --pp plan; drop --device-mem (the recommender weighs several pp)"
        if args.stage is not None:
            return "--pp --device-mem weighs every ZeRO stage inside the stages; drop --stage"
        from zeroshard.cli.typed_flags import given_knobs
        from zeroshard.tools.planner.spec import PLANNED_KNOBS

        if knobs := sorted(k for k, v in given_knobs(args, PLANNED_KNOBS).items() if v != "none"):
            flag = "--" + knobs[0].replace("_", "-")
            return (f"--pp --device-mem times its candidates with the engine's defaults (the pipeline replay does "
                    f"not model {flag}); drop {flag}, or plan one pp with it by dropping --device-mem")
    return None


def _preset(args: argparse.Namespace) -> str:
    from zeroshard.trainer.targets import is_preset

    if args.model is None or not is_preset(args.model):
        raise ValueError(f"--pp --device-mem weighs zeroshard's GPT presets; got --model {args.model}: pass tiny, small "
                         "or medium, or plan the model at one --pp without --device-mem")
    return args.model


def _planned(args: argparse.Namespace) -> tuple[Any, Any]:
    """(what plan_pipeline plans, the Target --measure's ranks build again or None for a preset)."""
    from zeroshard.cli.plan_workload import model_target
    from zeroshard.models import GPTConfig
    from zeroshard.trainer.targets import is_preset

    if args.model is None:
        raise ValueError("--pp plans a model's stages; pass --model (a preset, a save_pretrained folder, hf:NAME or "
                         "module:Class)")
    if is_preset(args.model):
        return (GPTConfig.named(args.model, vocab_size=args.vocab_size) if args.vocab_size else args.model), None
    target = model_target(args)
    return target.build(), target  # on meta, as plan without --pp builds it


def plan_of(args: argparse.Namespace, planned: Any = None):
    from zeroshard.cli.typed_flags import given_knobs
    from zeroshard.tools.planner.pipeline import plan_pipeline
    from zeroshard.tools.planner.spec import PLANNED_KNOBS

    target = planned if planned is not None else _planned(args)[0]
    return plan_pipeline(target, world=args.world, pp=args.pp, pp_schedule=args.pp_schedule or "1f1b",
                         microbatches=args.microbatches or 0, pp_stages_per_rank=args.pp_stages_per_rank or 0,
                         batch=args.batch, seq=args.seq, accum=args.accum, tp=args.tp, ep=args.ep or 1, mp=args.mp,
                         optimizer=args.optimizer, headroom=args.headroom, accounting=args.accounting,
                         gpus_per_node=args.gpus_per_node,
                         device="cpu" if args.measure else args.device, stage=args.stage,
                         **given_knobs(args, PLANNED_KNOBS))


def stages_table(pplan) -> Table:
    names = list(pplan.ranks[0].plan.layouts)
    div, unit, digits = size_unit(max(r.plan[n].device.total for r in pplan.ranks for n in names))
    shape = pplan.shape
    table = Table(title=f"{pplan.layers}-block {pplan.name} in {shape.num_stages} stages on pp {shape.pp}, "
                        f"{shape.schedule}, {shape.microbatches} microbatches: per-rank {unit} (allocated peak), "
                        f"world {pplan.world} = pp {shape.pp} x {pplan.dp} data-parallel"
                        + (f" x tp {pplan.world // shape.pp // pplan.dp}" if pplan.world // shape.pp // pplan.dp > 1
                           else "") + (f", ep {pplan.ep}" if pplan.ep > 1 else ""),
                  caption=f"microbatch {pplan.micro_batch} x seq {pplan.seq}, accum {pplan.accum}; bubble "
                          f"{pplan.bubble:.1%}; decimal units")
    for col in ("pp rank", "stages", "blocks", "in flight", "activations", "p2p buffers"):
        table.add_column(col, justify="right" if col not in ("stages", "blocks") else "left", no_wrap=True)
    for n in names:
        table.add_column(n, justify="right")
    fmt = lambda v: f"{v / div:,.{digits}f}"  # noqa: E731
    for r in pplan.ranks:
        blocks = " ".join(f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0]) for b in r.blocks)
        held = " ".join(f"{r.in_flight[s]}" for s in r.stages)
        table.add_row(str(r.pp_rank), " ".join(map(str, r.stages)), blocks, held, fmt(r.activation_bytes),
                      fmt(r.buffer_bytes), *[fmt(r.plan[n].device.allocated) for n in names])
    return table


def measure_table(checks) -> Table:
    div, unit, digits = size_unit(max(c.measured for c in checks))
    table = Table(title=f"predicted vs measured peak per pp rank ({unit}; one step on gloo, storage accounting)")
    for col in ("layout", "pp rank", "predicted", "measured", "error"):
        table.add_column(col, justify="right")
    for c in checks:
        table.add_row(c.layout, str(c.pp_rank), f"{c.predicted / div:,.{digits}f}", f"{c.measured / div:,.{digits}f}",
                      f"{c.error:.1%}")
    return table


def simulated(args: argparse.Namespace) -> tuple[Any, Any, dict[int, Any]]:
    """(workload, hardware, ZeRO stage -> the pipeline replay): `plan time --pp`."""
    from zeroshard.cli.plan_workload import workload
    from zeroshard.tools.sim.hardware import DEFAULT_HW
    from zeroshard.tools.sim.hardware import load_hardware
    from zeroshard.tools.sim.pipeline import simulate_pipeline
    from zeroshard.tools.sim.step import Layout
    from zeroshard.tools.planner.pipeline import PipelineShape

    shape = PipelineShape.resolve(pp=args.pp, pp_schedule=args.pp_schedule or "1f1b",
                                  microbatches=args.microbatches or 0, pp_stages_per_rank=args.pp_stages_per_rank or 0)
    tp = args.tp or 1
    if args.world % (args.pp * tp):
        raise ValueError(f"--pp {args.pp} x --tp {tp} does not divide --world {args.world}; each stage has world / "
                         "(pp x tp) data-parallel ranks")
    dp = args.world // args.pp // tp
    w, _ = workload(args, args.world)
    if args.micro_batch is None:  # the global batch over the stage's data-parallel ranks and the microbatches
        batch = args.batch or dp * shape.microbatches
        if batch % (dp * shape.microbatches):
            raise ValueError(f"--batch {batch} does not split over {dp} data-parallel ranks x {shape.microbatches} "
                             f"microbatches; use a multiple of {dp * shape.microbatches}")
        w = dataclasses.replace(w, micro_batch=batch // (dp * shape.microbatches))
    hw = load_hardware(args.hw or DEFAULT_HW)
    param_bytes = 4 if args.mp == "fp32" else 2
    knobs = {k: getattr(args, k) for k in ("prefetch", "bucket_mb", "reshard_after_forward")
             if getattr(args, k, None) is not None}
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    out = {}
    for stage in stages:
        layout = Layout.of(world=args.world // args.pp, stage=stage, tp=tp, param_bytes=param_bytes, **knobs)
        out[stage] = simulate_pipeline(w, hw, layout, pp=args.pp, schedule=shape.schedule,
                                       microbatches=shape.microbatches, stages_per_rank=shape.stages_per_rank,
                                       world=args.world)
    return w, hw, out


def time_table(w, hw, results: dict[int, Any], args: argparse.Namespace) -> Table:
    from zeroshard.tools.planner.spec import STAGE_NAMES

    table = Table(title=f"{w.shape.name} on {hw.name}, world {args.world} = pp {args.pp} x "
                        f"{args.world // args.pp} per stage: one step replayed ({args.pp_schedule or '1f1b'})",
                  caption=f"microbatch {w.micro_batch} x seq {w.seq} per rank; bubble: the mean over pp ranks of "
                          "each one's idle share of the schedule")
    for col in ("layout", "step (ms)", "bubble", "p2p one way (ms)", "tokens/s/GPU", "slowest rank: schedule + tail"):
        table.add_column(col, justify="right")
    for stage, r in results.items():
        worst = max(r.ranks, key=lambda x: x.schedule_s + x.tail_s)
        table.add_row(STAGE_NAMES[stage], f"{r.step_s * 1e3:,.2f}", f"{r.bubble:.1%}", f"{r.p2p_s * 1e3:,.3f}",
                      f"{r.tokens_per_s_per_gpu:,.0f}",
                      f"rank {worst.pp_rank}: {worst.schedule_s * 1e3:,.2f} + {worst.tail_s * 1e3:,.2f}")
    return table


def run_time(args: argparse.Namespace) -> int:
    """`plan time --pp`: the pipeline replay (zeroshard/tools/sim/pipeline.py) for each ZeRO stage."""
    from zeroshard.cli.train import fail

    if args.world is None:
        return fail("plan", "plan time --pp needs --world: every rank of the run (pp x data-parallel x tp)")
    try:
        w, hw, results = simulated(args)
    except ValueError as e:
        return fail("plan", str(e))
    if args.json:
        print(json.dumps({"hardware": hw.name, "workload": {"model": w.shape.name, "micro_batch": w.micro_batch,
                                                            "seq": w.seq},
                          "pipeline": {"pp": args.pp, "pp_schedule": args.pp_schedule or "1f1b"},
                          "rows": {str(k): v.to_dict() for k, v in results.items()}}, indent=1))
        return 0
    Console(width=160).print(time_table(w, hw, results, args))
    return 0


def recommended(args: argparse.Namespace):
    """`plan --pp N --device-mem SIZE`: no pipeline against every pp up to N (planner/recommend_pipeline.py)."""
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.recommend_pipeline import recommend_pipeline
    from zeroshard.tools.sim.hardware import DEFAULT_HW
    from zeroshard.tools.sim.hardware import load_hardware

    if (args.tp or 1) > 1 or (args.accum or 1) > 1:
        raise ValueError("--pp --device-mem weighs pipelines with tp 1 and accum 1; drop --tp and --accum")
    name = _preset(args)
    cfg = GPTConfig.named(name, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
    hw = load_hardware(args.hw or DEFAULT_HW)
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return recommend_pipeline(cfg, device_mem=args.device_mem, world=args.world, max_pp=args.pp, hw=hw,
                              pp_schedule=args.pp_schedule or "1f1b", microbatches=args.microbatches or 0,
                              pp_stages_per_rank=args.pp_stages_per_rank or 0, batch=args.batch, seq=args.seq,
                              mp=args.mp, optimizer=args.optimizer, headroom=args.headroom, device=args.device,
                              accounting=args.accounting)


def recommend_table(rec) -> Table:
    table = Table(title=f"pp against none, device {rec.device_mem / 1e9:.1f} GB",
                  caption="memory: the worst rank's, headroom included; step: one replayed, bubble included")
    for col in ("pp", "layout", "memory (GB)", "step (ms)", "bubble", "fits"):
        table.add_column(col, justify="right")
    for c in rec.candidates:
        table.add_row(str(c.pp), c.layout, f"{c.total_bytes / 1e9:,.2f}", f"{c.step_s * 1e3:,.2f}",
                      f"{c.bubble:.1%}", "yes" if c.fits else "no")
    return table


def planning_failure(e: Exception) -> str | None:
    """The one line a planning or measuring error is shown as: a bad value, or a measurement rank that
    failed (WorkerError); None for anything else, which is a bug to raise."""
    from zeroshard.cli.train import one_line
    from zeroshard.trainer.launch import WorkerError

    if isinstance(e, ValueError):
        return str(e)
    return one_line(e) if isinstance(e, WorkerError) else None


def run_recommend(args: argparse.Namespace) -> int:
    from zeroshard.cli.train import fail

    try:
        rec = recommended(args)
    except ValueError as e:
        return fail("plan", str(e))
    if args.json:
        print(json.dumps({"recommendation": rec.to_dict()}, indent=1), flush=True)
        return 0
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    console.print(recommend_table(rec))
    pick = f"{rec.layout} at pp {rec.pp}" if rec.fits else "nothing fits"
    console.print(f"[bold]recommendation:[/bold] {pick} - {rec.reason}", highlight=False)
    return 0


def run(args: argparse.Namespace) -> int:
    """`plan memory --pp` and `plan measure --pp`, after `plan`'s own check of the flags given
    (zeroshard/cli/plan.py); `plan time --pp` is ``run_time``."""
    from zeroshard.cli.train import fail

    if args.world is None:
        return fail("plan", "--world is required: every rank of the run (pp x data-parallel x tp)")
    if args.device_mem is not None:
        return run_recommend(args)
    try:
        planned, target = _planned(args)
        pplan = plan_of(args, planned)
        checks = None
        if args.measure:
            from zeroshard.tools.planner.measure_pipeline import measure

            stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
            checks = measure(pplan, stages, name=args.model, target=target)
    except Exception as e:
        if (line := planning_failure(e)) is None:
            raise
        return fail("plan", line)
    if args.json:
        out = pplan.to_dict()
        if checks:
            out["measurement"] = [{"layout": c.layout, "pp_rank": c.pp_rank, "predicted_bytes": c.predicted,
                                   "measured_bytes": c.measured, "error": c.error} for c in checks]
        print(json.dumps(out, indent=1), flush=True)
        return 0
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    console.print(stages_table(pplan))
    for note in pplan.notes:
        console.print(f"[dim]note: {note}")
    if checks:
        console.print(measure_table(checks))
    return 0

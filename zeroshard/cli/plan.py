"""`zeroshard plan memory` (and `plan measure`): per-rank memory of DDP and ZeRO-1/2/3 before you
choose, so the choice rests on arithmetic rather than on "a higher stage is better".

  zeroshard plan memory --params 7e9 --world 8                    the ZeRO paper's textbook table
  zeroshard plan memory --model small --world 4 --batch 8 --seq 512
  zeroshard plan memory --model llama3-8b --world 8 --mp bf16     the simulator's Llama shape
  zeroshard plan memory --model medium --world 16 --device-mem 24GB --inter-gbps 100 --gpus-per-node 8
  zeroshard plan measure --model small --world 2 --batch 2 --seq 128     predicted vs measured
  zeroshard plan memory --model path/to/hf-folder --world 8 --batch 32 --seq 2048
  zeroshard plan memory --model mypkg.nets:Net --model-config '{"width": 1024}' --world 4
  zeroshard plan memory --model small --world 8 --pp 4 --pp-schedule 1f1b --microbatches 8 --batch 16

A model is built on the meta device: planning allocates nothing. `plan measure` builds it on gloo CPU
ranks as train does, runs one real step per stage (with the same --checkpointing and --offload),
prints predicted against measured bytes per component, and times a few plain steps (the figure
plan time predicts). `plan` without a subcommand is `plan memory` (docs/planner.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroshard.trainer.targets import is_module_spec, is_preset
from zeroshard.cli.train import fail
from zeroshard.cli.typed_flags import given_knobs
from zeroshard.cli import plan_pipeline
from zeroshard.cli.plan_flags import DEFAULT_COMM_QUANT_BLOCK
from zeroshard.cli.plan_workload import model_target
from zeroshard.cli.plan_pipeline import size_unit
from zeroshard.tools.sim.hardware import DEFAULT_HW, Hardware, load_hardware, with_links
from zeroshard.tools.planner.spec import PLANNED_KNOBS

MEASURE_TIMED_STEPS = 3
"""Plain steps `plan measure` times per stage after the measured one: the median of the slowest
rank's is the measured step time that `plan time` predicts."""


def plan_table(p) -> Table:
    from zeroshard.tools.planner.result import COMPONENTS

    names = list(p.layouts)
    div, unit, digits = size_unit(max(p[n].device.total for n in names))
    spec = p.spec
    count = f"{p.params / 1e6:,.1f}M" if p.params >= 1e6 else f"{p.params:,}"  # a test model is not "0.0M"
    what = f"{p.model.name}: {count} params" if p.model else f"{p.params / 1e9:.3g}B params (analytic)"
    where = f"world {spec.world}" + (f" = {spec.dp} data-parallel x tp {spec.tp}" if spec.tp > 1 else "")
    where += f", experts split over ep {spec.ep} x edp {spec.edp}" if spec.ep > 1 else ""
    table = Table(title=f"{what}, per-rank {unit}, {where}",
                  caption=f"micro-batch {spec.micro_batch} x seq {spec.seq}, accum {spec.accum}, "
                          f"{spec.optimizer.__name__}, {spec.accounting} accounting; decimal units"
                          + (f"; {p.model.tied} tied param(s) counted once" if p.model and p.model.tied else ""))
    table.add_column("component", no_wrap=True)
    for n in names:
        style = "bold" if spec.stage is not None and p[n].stage == spec.stage and "_" not in n else None
        table.add_column(n, justify="right", style=style)
    fmt = lambda v: f"{v / div:,.{digits}f}"  # noqa: E731
    for comp in COMPONENTS:
        table.add_row(comp, *[fmt(getattr(p[n].device, comp)) for n in names])
    if any(p[n].device.overlap for n in names):
        # Components are each at their own peak; this is what they over-count together.
        table.add_row("[dim]not simultaneous", *[f"[dim]{'-' if p[n].device.overlap else ''}"
                                                  f"{fmt(p[n].device.overlap)}" for n in names])
    table.add_section()
    table.add_row("model states", *[fmt(p[n].device.model_states) for n in names])
    table.add_row("[bold]total", *[f"[bold]{fmt(p[n].device.total)}" for n in names])
    if any(p[n].host_bytes for n in names):
        table.add_row("host (offload)", *[fmt(p[n].host_bytes) for n in names])
    table.add_row("comm / step", *[fmt(p[n].comm_bytes) for n in names])
    if spec.ep > 1:  # the experts' part of the rows above (zeroshard/tools/planner/experts.py)
        table.add_section()
        for key, label in (("expert_params", "of which expert params"), ("expert_grads", "expert grads"),
                           ("expert_optimizer", "expert optimizer"),
                           ("expert_held_in_forward", "experts held in forward"),
                           ("all_to_all_buffers", "all-to-all buffers")):
            table.add_row(f"[dim]{label}", *[f"[dim]{fmt(p[n].experts.get(key, 0))}" for n in names])
        table.add_row("[dim]all-to-all / step", *[f"[dim]{fmt(sum(c.wire_bytes for c in p[n].collectives if c.group == 'ep'))}"
                                                  for n in names])
    return table


def measure_table(checks) -> Table:
    from zeroshard.tools.planner.measure import MEASURED

    div, unit, digits = size_unit(max(c.measured_total for c in checks))
    table = Table(title=f"predicted vs measured, per rank ({unit}; {checks[0].method})")
    table.add_column("component", no_wrap=True)
    for c in checks:
        table.add_column(f"{c.layout} pred", justify="right")
        table.add_column("meas", justify="right")
    fmt = lambda v: "-" if v is None else f"{v / div:,.{digits}f}"  # noqa: E731  (- : the plan has no estimate)
    for comp in MEASURED:
        if comp == "activations":  # what is kept for backward; a checkpointed rebuild is in the residual
            table.add_row("activations (kept)", *[x for c in checks for x in (fmt(c.predicted_kept),
                                                                            fmt(c.measured[comp]))])
            continue
        table.add_row(comp, *[x for c in checks for x in (fmt(getattr(c.predicted, comp)), fmt(c.measured[comp]))])
    # What the measured peak leaves unexplained by the terms above, against the same for the plan.
    table.add_row("workspace - overlap", *[x for c in checks for x in (
        fmt(c.predicted.workspace - c.predicted.overlap), fmt(c.measured["workspace"]))])
    table.add_section()
    table.add_row("model states", *[x for c in checks for x in (
        fmt(c.predicted.model_states), fmt(sum(c.measured[k] for k in ("params", "grads", "master", "optimizer"))))])
    if any(c.predicted_host or c.measured_host for c in checks):
        table.add_row("host (offload)", *[x for c in checks for x in (fmt(c.predicted_host), fmt(c.measured_host))])
    # With offload on CPU the measured peak holds host and device (one memory), and so does the prediction.
    table.add_row("peak", *[x for c in checks for x in (fmt(c.predicted_peak or c.predicted.allocated),
                                                          fmt(c.measured_total))])
    table.add_row("error: model states", *[x for c in checks for x in ("", f"{c.model_state_error:.1%}")])
    table.add_row("error: total", *[x for c in checks for x in ("", f"{c.total_error:.1%}")])
    if any(c.step_s is not None for c in checks):  # predicted by plan time (with --hw from --calibrate here)
        table.add_section()
        table.add_row("step time (ms)", *[x for c in checks for x in (
            "", "-" if c.step_s is None else f"{c.step_s * 1e3:,.1f}")])
    return table


def _plan_kwargs(args: argparse.Namespace) -> tuple[Any, dict]:
    from zeroshard.models import GPTConfig

    from zeroshard.tools.sim.workload import SHAPES

    if args.params is not None:
        target: Any = args.params
    elif args.model in SHAPES:  # the simulator's shape, laid out on meta: the workload plan time times
        if args.vocab_size is not None:
            raise ValueError(f"--vocab-size needs a model to build; {args.model} is a shape with its own vocabulary: "
                             "drop --vocab-size")
        if args.measure:
            raise ValueError(f"plan measure trains the model on gloo ranks; {args.model} is a shape, planned only: "
                             "run plan memory, or measure a folder or hf: model")
        target = args.model
    elif is_preset(args.model):
        # The preset's name reads better in the report; a vocabulary override needs the config itself.
        target = GPTConfig.named(args.model, vocab_size=args.vocab_size) if args.vocab_size else args.model
    else:  # a folder, hf:NAME or module:Class, built on meta as train builds it
        target = model_target(args).build()
    kwargs = dict(world=args.world, stage=args.stage, mp=args.mp, optimizer=args.optimizer, batch=args.batch,
                  seq=args.seq, accum=args.accum, clip=getattr(args, "clip", None), **given_knobs(args, PLANNED_KNOBS),
                  headroom=args.headroom, accounting=args.accounting,
                  comm_quant=args.comm_quant or "none", comm_quant_block=args.comm_quant_block or DEFAULT_COMM_QUANT_BLOCK,
                  device="cpu" if args.measure else args.device, tp=args.tp,
                  sequence_parallel=args.sequence_parallel, ep=args.ep or 1,
                  routing_skew=args.routing_skew or 0.0, cp=args.cp or 1, cp_attention=args.cp_attention or "ring")
    return target, kwargs


def _hardware(args: argparse.Namespace) -> Hardware:
    """--hw with the links and node size given as flags on top: what the recommender prices on."""
    return with_links(load_hardware(args.hw or DEFAULT_HW), intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
                      gpus_per_node=args.gpus_per_node)


def _topology(args: argparse.Namespace):
    """The run's hosts (``plan_time.run_topology``), after setting --world and --gpus-per-node from
    them: they decide which collectives cross hosts."""
    from zeroshard.cli.plan_time import run_topology

    if (topology := run_topology(args)) is None:
        return None
    if args.gpus_per_node is not None and args.gpus_per_node != topology.ranks_per_host:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} disagrees with the {topology.ranks_per_host} ranks "
                         "per host of --topology; drop --gpus-per-node")
    args.gpus_per_node = topology.ranks_per_host
    return topology


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    """The flags among ``dests`` that were given (argparse default None, or False for a switch)."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) not in (None, False)]


def unread_flag(args: argparse.Namespace) -> str | None:
    """The one-line error for a flag read only together with another one that is missing.

    A flag `plan memory` never reads is refused by argparse (zeroshard/cli/plan_flags.py); these
    are read only under a condition, and taken silently they would hand back a result without
    what the user asked for."""
    if args.model_config is not None and not is_module_spec(args.model or ""):
        return ("--model-config gives a module:Class its keyword arguments; pass --model module:Class or drop "
                "--model-config")
    if args.routing_skew is not None and (args.ep or 1) == 1:
        return "--routing-skew sizes the expert-parallel all-to-alls; add --ep N (N > 1) or drop --routing-skew"
    if args.device_mem is None and (flags := _given(args, "hw", "intra_gbps", "inter_gbps")):
        return f"{flags[0]} prices the recommender's candidates; add --device-mem SIZE or drop {flags[0]}"
    if args.comm_quant_block is not None and args.comm_quant in (None, "none"):
        return "--comm-quant-block sizes the blocks of --comm-quant; add --comm-quant (e.g. weights) or drop it"
    return None


def run(args: argparse.Namespace) -> int:
    """`plan memory` and `plan measure`."""
    from zeroshard.tools.planner import plan
    from zeroshard.tools.planner.recommend import recommend

    unread = unread_flag(args) or plan_pipeline.unread_flag(args)
    if unread is not None:
        return fail("plan", unread)
    if plan_pipeline.wants_pipeline(args):
        return plan_pipeline.run(args)  # per-stage memory and the bubble
    try:
        topology = _topology(args)
    except ValueError as e:
        return fail("plan", str(e))
    if args.world is None:
        return fail("plan", "--world is required: the number of data-parallel ranks (or --topology HOSTSxRANKS)")
    if (args.params is None) == (args.model is None):
        return fail("plan", "give exactly one of --model NAME or --params COUNT")
    try:
        target, kwargs = _plan_kwargs(args)
        hw = _hardware(args)
        p = plan(target, shard_size=args.shard_size, gpus_per_node=hw.gpus_per_node, **kwargs)
        rec = recommend(target, device_mem=args.device_mem, hw=hw, **kwargs) if args.device_mem else None
        checks = _measure(p, args) if args.measure else None
        chart = None
        if args.plot:
            from zeroshard.tools.planner.chart import plot

            chart = plot(p, args.plot, device_mem=rec.device_mem if rec else None)
    except Exception as e:
        if (line := plan_pipeline.planning_failure(e)) is None:
            raise
        return fail("plan", line)
    if args.json:
        print(json.dumps(_as_json(p, topology, rec, checks, chart), indent=1), flush=True)
        return 0
    _print_plan(p, topology, rec, checks, chart)
    return 0


def _as_json(p, topology, rec, checks, chart) -> dict[str, Any]:
    """`plan --json`: the plan, with the topology, recommendation, measurement and chart path given."""
    out = p.to_dict()
    out["topology"] = topology.to_dict() if topology else None
    if rec:
        out["recommendation"] = rec.to_dict()
    if checks:
        out["measurement"] = [{"layout": c.layout, "method": c.method, "measured_bytes": c.measured,
                               "measured_total_bytes": c.measured_total, "model_state_error": c.model_state_error,
                               "total_error": c.total_error, "predicted_bytes": dataclasses.asdict(c.predicted),
                               "predicted_peak_bytes": c.predicted_peak or c.predicted.allocated,
                               "predicted_kept_activation_bytes": c.predicted_kept, "step_s": c.step_s}
                              for c in checks]
    if chart:
        out["plot"] = str(chart)
    return out


def _print_plan(p, topology, rec, checks, chart) -> None:
    """The plan's table and notes, then the recommendation, measurement and chart given."""
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log keeps whole columns ("zero1 pred"), not 80-column cuts
    if topology is not None:
        console.print(f"topology: {topology.text}", highlight=False)
    console.print(plan_table(p))
    for note in p.notes:
        console.print(f"[dim]note: {note}")
    if rec:
        pick = rec.layout or "nothing fits"
        extra = "" if rec.checkpointing == "none" else f" + {rec.checkpointing} checkpointing"
        extra += f" with tp {rec.tp}" if rec.tp > 1 else ""
        extra += f" with ep {rec.ep}" if rec.ep > 1 else ""
        console.print(f"[bold]recommendation:[/bold] {pick}{extra} - {rec.reason}")
    if checks:
        console.print(measure_table(checks))
    if chart:
        console.print(f"chart written to {chart}")


def _measure(p, args: argparse.Namespace):
    from zeroshard.tools.planner.measure import measure

    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    target = None if args.params is not None or is_preset(args.model) else model_target(args)
    return measure(p, stages, target=target, timed_steps=MEASURE_TIMED_STEPS)


def add_parser(sub: Any) -> None:
    from zeroshard.cli import plan_time
    from zeroshard.cli.plan_flags import HELP, add_subcommands

    p = sub.add_parser("plan", help="per-rank memory, step time, a recommendation, and a measured check",
                       description="\n".join(f"  plan {mode:10s} {text}" for mode, text in HELP.items()) + "\n\n"
                       "`plan ARGS` is `plan memory ARGS`; `plan --time`, `plan --calibrate [OP]` and `plan --measure` "
                       "are `plan time`, `plan calibrate [OP]` and `plan measure`.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subcommands(p, {"memory": run, "measure": run, "time": plan_time.run, "calibrate": plan_time.run_calibrate})

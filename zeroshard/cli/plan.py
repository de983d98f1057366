"""`zeroshard plan`: per-rank memory of DDP and ZeRO-1/2/3 before you choose, so the choice rests
on arithmetic rather than on "a higher stage is better".

  zeroshard plan --params 7e9 --world 8                    the ZeRO paper's textbook table
  zeroshard plan --model small --world 4 --batch 8 --seq 512
  zeroshard plan --model medium --world 16 --device-mem 24GB --inter-gbps 100 --gpus-per-node 8
  zeroshard plan --model small --world 2 --batch 2 --seq 128 --measure   predicted vs measured
  zeroshard plan --model path/to/hf-folder --world 2 --batch 4 --seq 64 --measure   the same for a folder
  zeroshard plan --model path/to/hf-folder --world 8 --batch 32 --seq 2048    the folder you will train
  zeroshard plan --model mypkg.nets:Net --model-config '{"width": 1024}' --world 4
  zeroshard plan --model small --world 8 --pp 4 --pp-schedule 1f1b --microbatches 8 --batch 16   per stage

A model is built on the meta device: planning allocates nothing. --measure builds it on gloo CPU
ranks as train does, runs one real step per stage (with the same --checkpointing and --offload),
prints predicted against measured bytes per component, and times a few plain steps (the figure
plan --time predicts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroshard.trainer.targets import Target, is_module_spec, is_preset
from zeroshard.cli.train import fail, one_line
from zeroshard.trainer.config import MODEL_NAMES, field_help, field_type
from zeroshard.cli.typed_flags import add_knob_flags, add_typed_flag, given_knobs
from zeroshard.cli import plan_pipeline
from zeroshard.cli.plan_pipeline import add_pp_flags, size_unit
from zeroshard.tools.sim.hardware import DEFAULT_HW, PRESETS, Hardware, load_hardware, with_links
from zeroshard.tools.planner.spec import PLANNED_KNOBS
from zeroshard.tools.sim.step import SIMULATED_KNOBS

PLAN_KNOBS = PLANNED_KNOBS + tuple(k for k in SIMULATED_KNOBS if k not in PLANNED_KNOBS)
"""The engine's knobs `plan` takes: those the memory planner or the step-time simulator models."""

MEASURE_TIMED_STEPS = 3
"""Plain steps --measure times per stage after the measured one: the median of the slowest rank's is
the measured step time that `plan --time` predicts."""

DEFAULT_COMM_QUANT_BLOCK = 256
"""zs.plan's (and TrainConfig's) quantization block when --comm-quant-block is not given."""


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
    if any(c.step_s is not None for c in checks):  # predicted by plan --time (with --hw from --calibrate here)
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
        if args.vocab_size is not None or args.measure:
            flag = "--vocab-size" if args.vocab_size is not None else "--measure"
            raise ValueError(f"{flag} needs a model to build; {args.model} is a shape with its own vocabulary: "
                             f"drop {flag}")
        target = args.model
    elif is_preset(args.model):
        # The preset's name reads better in the report; a vocabulary override needs the config itself.
        target = GPTConfig.named(args.model, vocab_size=args.vocab_size) if args.vocab_size else args.model
    else:  # a folder, hf:NAME or module:Class, built on meta as train builds it
        target = _target(args).build()
    kwargs = dict(world=args.world, stage=args.stage, mp=args.mp, optimizer=args.optimizer, batch=args.batch,
                  seq=args.seq, accum=args.accum, **given_knobs(args, PLANNED_KNOBS),
                  headroom=args.headroom, accounting=args.accounting,
                  comm_quant=args.comm_quant or "none", comm_quant_block=args.comm_quant_block or DEFAULT_COMM_QUANT_BLOCK,
                  device="cpu" if args.measure else args.device, tp=args.tp,
                  sequence_parallel=args.sequence_parallel, ep=args.ep or 1,
                  routing_skew=args.routing_skew or 0.0)
    return target, kwargs


def _target(args: argparse.Namespace) -> Target:
    """--model as a non-preset target, with what it is built with (--measure's ranks build it again)."""
    return Target(spec=args.model, vocab_size=args.vocab_size, seq_len=args.seq or 64, config=args.model_config)


def _hardware(args: argparse.Namespace) -> Hardware:
    """--hw with the links and node size given as flags on top: what the recommender prices on."""
    return with_links(load_hardware(args.hw or DEFAULT_HW), intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
                      gpus_per_node=args.gpus_per_node)


def _topology(args: argparse.Namespace):
    """--topology as a RunTopology (None when not given), after setting --world and --gpus-per-node
    from it: the run's hosts decide which collectives cross them."""
    from zeroshard.tools.planner.topology_source import parse

    if args.topology is None:
        return None
    topology = parse(args.topology)
    if args.world is None:
        args.world = topology.world
    elif args.world != topology.world:
        raise ValueError(f"--world {args.world} is not the {topology.world} ranks of --topology ({topology.text}); "
                         "drop --world or make them agree")
    if args.gpus_per_node is not None and args.gpus_per_node != topology.ranks_per_host:
        raise ValueError(f"--gpus-per-node {args.gpus_per_node} disagrees with the {topology.ranks_per_host} ranks "
                         "per host of --topology; drop --gpus-per-node")
    args.gpus_per_node = topology.ranks_per_host
    return topology


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    """The flags among ``dests`` that were given (argparse default None, or False for a switch)."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) not in (None, False)]


def unread_flag(args: argparse.Namespace) -> str | None:
    """The one-line error for a flag the chosen mode would not read, or None when every flag given is read.

    ``plan`` has three modes over one parser: memory (the default), --time (the step-time simulator)
    and --calibrate. A flag one of them ignores must not be taken silently: the user would read a
    result that does not have what they asked for. --calibrate reads its own few flags (see its help).
    """
    if args.model_config is not None and not is_module_spec(args.model or ""):
        return ("--model-config gives a module:Class its keyword arguments; pass --model module:Class or drop "
                "--model-config")
    if args.hw_out is not None and not args.calibrate:
        return "--hw-out is where --calibrate writes its hardware TOML; add --calibrate or drop --hw-out"
    if args.calibrate:
        return None
    if args.routing_skew is not None and (args.ep or 1) == 1:
        return "--routing-skew sizes the expert-parallel all-to-alls; add --ep N (N > 1) or drop --routing-skew"
    if not args.time:
        if flags := _given(args, *(() if args.device_mem is not None else ("hw",)), "micro_batch", "sweep",
                           "shard_sizes"):
            return f"{flags[0]} is read only with --time (the step-time simulator); add --time or drop {flags[0]}"
        if args.device_mem is None and (flags := _given(args, "intra_gbps", "inter_gbps")):
            return f"{flags[0]} prices the recommender's candidates; add --device-mem SIZE or drop {flags[0]}"
        if args.comm_quant_block is not None and args.comm_quant in (None, "none"):
            return "--comm-quant-block sizes the blocks of --comm-quant; add --comm-quant (e.g. weights) or drop it"
        return None
    from zeroshard.tools.sim.workload import SHAPES

    quant = "--time does not simulate quantized communication (the memory planner, without --time, prices it)"
    why = {"params": "--time simulates a model's shape: pass --model (a zeroshard preset, llama3-8b, llama3-70b, "
                     "a save_pretrained folder or hf:NAME)",
           "sequence_parallel": "--time does not model sequence parallelism (the memory planner, without --time, "
                                "does)",
           "comm_quant_block": quant,
           "accounting": "--time plans memory its own way (runtime accounting for zeroshard's GPT, textbook for the "
                         "Llama shapes)",
           "intra_gbps": "--time takes its links from --hw (a preset, or a TOML file's intra_bandwidth)",
           "inter_gbps": "--time takes its links from --hw (a preset, or a TOML file's inter_bandwidth)",
           "gpus_per_node": "--time takes GPUs per node from --hw (a preset, or a TOML file's gpus_per_node) or "
                            "from --topology",
           "measure": "--measure checks the memory planner against one real step; run it without --time"}

    if unsimulated := sorted(given_knobs(args, tuple(k for k in PLAN_KNOBS if k not in SIMULATED_KNOBS))):
        flag = "--" + unsimulated[0].replace("_", "-")
        return f"--time does not simulate {flag} (the memory planner, without --time, plans it); drop {flag}"
    if args.comm_quant not in (None, "none"):  # "none" is what the simulator assumes, so it is read
        return f"{quant}; drop --comm-quant"
    for dest, reason in why.items():
        if getattr(args, dest) not in (None, False):
            return f"{reason}; drop --{dest.replace('_', '-')}"
    if str(args.optimizer).lower() != "adamw":
        return f"--time simulates AdamW's step; drop --optimizer {args.optimizer} (the memory planner sizes any optimizer)"
    if args.device == "cpu":
        return ("--time simulates the devices of --hw; for this CPU host pass --hw FILE from --calibrate and drop "
                "--device cpu")
    if args.vocab_size is not None and args.model in SHAPES:
        return f"--vocab-size resizes zeroshard's GPT presets; {args.model} keeps its own vocabulary: drop --vocab-size"
    for one, other in (("world", "sweep"), ("shard_size", "shard_sizes"), ("batch", "micro_batch")):
        if getattr(args, one) is not None and getattr(args, other) is not None:
            flag, flag2 = "--" + one.replace("_", "-"), "--" + other.replace("_", "-")
            return f"give {flag} or {flag2}, not both ({flag2} wins, so {flag} would be ignored)"
    return None


def run(args: argparse.Namespace) -> int:
    from zeroshard.tools.planner import plan
    from zeroshard.tools.planner.recommend import recommend

    unread = unread_flag(args) or plan_pipeline.unread_flag(args)
    if unread is not None:
        return fail("plan", unread)
    if plan_pipeline.wants_pipeline(args):
        return plan_pipeline.run(args)  # per-stage memory and the bubble, or (--time) the schedule's replay
    if args.time or args.calibrate:  # the step-time simulator (zeroshard.tools.sim) instead of the memory tables
        from zeroshard.cli.plan_time import print_time

        try:
            return print_time(args)
        except ValueError as e:
            return fail("plan", str(e))
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
    except ValueError as e:
        return fail("plan", str(e))
    except Exception as e:  # a failed measurement rank arrives as WorkerError
        from zeroshard.trainer.launch import WorkerError

        if isinstance(e, WorkerError):
            return fail("plan", one_line(e))
        raise
    if args.json:
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
        print(json.dumps(out, indent=1), flush=True)
        return 0
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
    return 0


def _measure(p, args: argparse.Namespace):
    from zeroshard.tools.planner.measure import measure

    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    target = None if args.params is not None or is_preset(args.model) else _target(args)
    return measure(p, stages, target=target, timed_steps=MEASURE_TIMED_STEPS)


def add_parser(sub: Any) -> None:
    from zeroshard.cli.plan_time import add_arguments as add_time_arguments
    from zeroshard.tools.sim.workload import SHAPES

    p = sub.add_parser("plan", help="per-rank memory of every stage, a recommendation, and a measured check",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", metavar="MODEL", help="what to plan, built on the meta device: a GPT preset "
                      f"({', '.join(MODEL_NAMES)}), a save_pretrained folder, hf:NAME, module:Class (with "
                      f"--model-config), or a shape: {', '.join(SHAPES)}")
    what.add_argument("--model-config", metavar="JSON", help="module:Class's keyword arguments: a JSON object, "
                      "inline or a .json file")
    what.add_argument("--params", metavar="COUNT", help="a bare parameter count (7e9, 350M): the textbook table")
    run_ = p.add_argument_group("the run")
    run_.add_argument("--world", type=int, help="ranks in all: data-parallel x --tp (required unless --time --sweep)")
    run_.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: consecutive ranks each block is "
                      "split over (Megatron column/row split of zeroshard's GPT; with --time, of the Llama shapes "
                      "too; default: 1)")
    run_.add_argument("--sequence-parallel", action="store_true", help="with --tp: also split the norms' and "
                      "residual's activations along the sequence")
    add_typed_flag(run_, "ep", field_type("ep"), f"{field_help('ep')} (default: 1)")  # train's own key
    run_.add_argument("--routing-skew", type=float, help="with --ep: extra rows the busiest ep rank receives, as a "
                      "share of its balanced tokens x top_k (0: balanced, the default; 1: twice its share); sizes "
                      "its all-to-all buffers, activations and traffic")
    add_pp_flags(run_)  # --pp, --pp-schedule, --microbatches, --pp-stages-per-rank: TrainConfig's fields
    run_.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="the stage you intend (highlighted; "
                      "the one measured by --measure); every stage is planned")
    run_.add_argument("--batch", type=int, help="GLOBAL batch in sequences per step (default: one per rank)")
    run_.add_argument("--seq", type=int, help="tokens per sequence (default: the model's seq_len)")
    run_.add_argument("--accum", type=int, default=1, help="gradient-accumulation micro-steps (default: 1)")
    run_.add_argument("--mp", choices=("fp32", "bf16", "fp16"), help="compute dtype (fp32 master, fp32 reduction); "
                      "default: the model's own dtype, or bf16 params and grads for --params")
    run_.add_argument("--optimizer", default="adamw", help="torch.optim name or module:Class (default: adamw); "
                      "its state size is found by running it")
    run_.add_argument("--vocab-size", type=int, help="override the GPT's vocabulary size")
    run_.add_argument("--shard-size", type=int, help="also plan hybrid variants sharded over groups of this size")
    # The engine's knobs, from its own table: --offload adds the offload variants (with --time, every
    # layout is simulated offloaded); --checkpointing also takes op and full for the Llama shapes with --time.
    engine = p.add_argument_group("the engine's knobs (as zeroshard train takes them)")
    add_knob_flags(engine, PLAN_KNOBS)
    run_.add_argument("--comm-quant", help="quantized communication as in train: weights, grads, "
                      "grads+ef or weights,grads[+ef] (int8 + fp32 block scales on the wire; default: none)")
    run_.add_argument("--comm-quant-block", type=int, help="elements per quantization block of --comm-quant "
                      f"(default: {DEFAULT_COMM_QUANT_BLOCK})")
    run_.add_argument("--headroom", type=float, default=0.10, help="allocator headroom fraction (default: 0.10)")
    run_.add_argument("--accounting", choices=("runtime", "textbook"),
                      help="runtime (zeroshard's real buffers; default for --model) or textbook (default for --params)")
    run_.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                      help="target backend: optimizer scratch and grad-buffer lifetime differ (default: cuda)")
    net = p.add_argument_group("recommendation")
    net.add_argument("--device-mem", metavar="SIZE", help="memory per device, e.g. 80GB; turns on the recommender")
    default = PRESETS[DEFAULT_HW]
    net.add_argument("--intra-gbps", type=float, help="intra-node link, Gb/s (default: --hw's, "
                     f"{default.intra_bandwidth * 8 / 1e9:g} for {DEFAULT_HW}); prices the recommender's candidates, "
                     "so it needs --device-mem")
    net.add_argument("--inter-gbps", type=float, help="inter-node link, Gb/s (default: --hw's, "
                     f"{default.inter_bandwidth * 8 / 1e9:g} for {DEFAULT_HW}); prices the recommender's candidates, "
                     "so it needs --device-mem")
    net.add_argument("--gpus-per-node", type=int, help=f"ranks per node (default: {default.gpus_per_node}): which "
                     "collectives cross nodes")
    net.add_argument("--topology", metavar="SPEC", help="the run's hosts: HOSTSxRANKS (2x4), a run directory (its "
                     "summary.json or metrics.jsonl header), or a plan --calibrate TOML; sets --world and the ranks "
                     "per host (--gpus-per-node), and with --time the simulated node size")

    out = p.add_argument_group("output")
    out.add_argument("--measure", action="store_true", help="run one real step per stage on gloo and compare")
    out.add_argument("--plot", metavar="OUT.png", help="write a stacked per-component chart (needs matplotlib)")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_time_arguments(p)
    p.set_defaults(run=run)

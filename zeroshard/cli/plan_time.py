"""``zeroshard plan time`` (and ``plan calibrate``): predicted step time, throughput, MFU and memory per layout, or a sweep."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from zeroshard.tools.sim.hardware import DEFAULT_HW, load_hardware
from zeroshard.cli.plan_workload import DEFAULT_SEQ, _headroom, _knobs, workload  # noqa: F401
from zeroshard.tools.sim.workload import SHAPES



def run(args: argparse.Namespace) -> int:
    """`plan time`: the step replay per layout, or (with --pp) the pipeline schedule's replay."""
    from zeroshard.cli import plan_pipeline
    from zeroshard.cli.train import fail

    unread = plan_pipeline.unread_flag(args)
    if args.routing_skew is not None and (args.ep or 1) == 1:
        unread = "--routing-skew sizes the expert-parallel all-to-alls; add --ep N (N > 1) or drop --routing-skew"
    if args.vocab_size is not None and args.model in SHAPES:
        unread = f"--vocab-size resizes zeroshard's GPT presets; {args.model} keeps its own vocabulary: drop --vocab-size"
    if unread is not None:
        return fail("plan", unread)
    if plan_pipeline.wants_pipeline(args):
        return plan_pipeline.run_time(args)
    try:
        return print_time(args)
    except ValueError as e:
        return fail("plan", str(e))


def run_calibrate(args: argparse.Namespace) -> int:
    """`plan calibrate [COLLECTIVE]`."""
    from zeroshard.cli.train import fail

    whole = ("model", "sweep", "seq", "micro_batch", "vocab_size", "hw_out")
    if args.calibrate != "all" and (flags := [f for f in whole if getattr(args, f) is not None]):
        flag = "--" + flags[0].replace("_", "-")
        return fail("plan", f"{flag} is read by a whole calibration; plan calibrate {args.calibrate} fits one "
                            f"collective at --world: drop {flag}")
    try:
        return print_calibration(args)
    except ValueError as e:
        return fail("plan", str(e))


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated positive integers, e.g. 64,128,256; got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes comma-separated positive integers, e.g. 64,128,256; got {text!r}")
    return values




def run_time(args: argparse.Namespace) -> list:
    """The rows to print; raises ValueError on bad input."""
    from zeroshard.tools.sim.memory import peak_bytes
    from zeroshard.tools.sim.report import evaluate, layouts_for

    hw = load_hardware(args.hw or DEFAULT_HW)
    topology = run_topology(args)
    if topology is not None:  # the run's hosts, not the preset's node size, decide what crosses hosts
        hw = dataclasses.replace(hw, gpus_per_node=topology.ranks_per_host)
    if getattr(args, "device_mem", None):  # the device you mean to run on: fits are judged against it
        from zeroshard.tools.planner.spec import parse_bytes

        hw = dataclasses.replace(hw, name=f"{hw.name} with {args.device_mem} per GPU",
                                 hbm_bytes=float(parse_bytes(args.device_mem)))
    worlds = _ints(args.sweep, "--sweep") if args.sweep else (args.world,)
    if worlds == (None,):
        raise ValueError("give --world N, or --sweep N,N,... with plan time")
    shard_sizes = _ints(args.shard_sizes, "--shard-sizes") if args.shard_sizes else (
        (args.shard_size,) if args.shard_size else ())
    stages = (args.stage,) if args.stage is not None else (0, 1, 2, 3)
    rows = []
    for world in worlds:
        w, memory = workload(args, world)
        # --mp fp32 (as zeroshard train runs by default, and as a CPU calibration measured): fp32
        # params on the wire; otherwise the bf16 the simulator assumes for GPU runs.
        param_bytes = 4 if getattr(args, "mp", None) == "fp32" else 2
        knobs = {k: v for k, v in _knobs(args).items() if k != "checkpointing"}  # the workload's
        layouts = layouts_for(world, stages, shard_sizes, param_bytes=param_bytes, tp=getattr(args, "tp", 1) or 1,
                              cp=getattr(args, "cp", None) or 1, cp_attention=getattr(args, "cp_attention", None) or "ring",
                              ep=getattr(args, "ep", None) or 1, **knobs)
        rows += evaluate(w, hw, layouts, memory or (lambda layout: peak_bytes(w, layout, headroom=_headroom(args))))
    return [w, hw, rows, topology]


DEFAULT_HW_OUT = Path("~/.cache/zeroshard/local.toml")


def calibrate_to_toml(args: argparse.Namespace) -> int:
    """``plan calibrate``: every collective and --model's units at each world size, stored as TOML."""
    from zeroshard.trainer.config import TrainConfig
    from zeroshard.models import GPTConfig
    from zeroshard.tools.sim.calibrate import calibrate_hardware
    from zeroshard.tools.sim.measured import to_toml

    model = args.model or "small"
    worlds = _ints(args.sweep, "--sweep") if args.sweep else ((args.world,) if args.world else (2, 4))
    if model in GPTConfig.names():
        vocab = args.vocab_size or TrainConfig().vocab_size
        seq = args.seq or GPTConfig.named(model).seq_len
    else:  # timed under the name and vocabulary --time reads off the model's config (sim/hf_shape.py)
        vocab, seq = _calibrated_hf(args, model)
    out = Path(args.hw_out).expanduser() if args.hw_out else DEFAULT_HW_OUT.expanduser()
    hw, raw = calibrate_hardware(worlds, model, vocab, args.micro_batch or 1, seq, name=out.stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(hw, f"zeroshard plan calibrate: {model}, vocab {vocab}, micro-batch "
                               f"{args.micro_batch or 1} x seq {seq}, worlds {', '.join(map(str, worlds))}\n"
                               "measured on this host with gloo; use it with zeroshard plan time --hw FILE")
                   + calibrated_topology(max(worlds)))
    if args.json:
        print(json.dumps({"hardware": str(out), "points": raw}, indent=1))
        return 0
    for m in hw.links:
        print(f"{m.op:15s} over {m.group} of {m.world} ranks: alpha {m.alpha_s * 1e6:8.1f} us/step, bus bandwidth "
              f"{m.bandwidth / 1e9:6.3f} GB/s")

    def slowest(fwd: float | None, bwd: float | None) -> str:
        return f" (slowest rank {fwd * 1e3:.2f} / {bwd * 1e3:.2f})" if fwd is not None and bwd is not None else ""

    for c in hw.compute:
        print(f"{model} world {c.world}: block fwd {c.block_forward_s * 1e3:.2f} ms, bwd {c.block_backward_s * 1e3:.2f} "
              f"ms{slowest(c.block_forward_slowest_s, c.block_backward_slowest_s)}; root fwd "
              f"{c.root_forward_s * 1e3:.2f} ms, bwd {c.root_backward_s * 1e3:.2f} ms"
              + (f" (both, slowest rank's whole step less mean blocks {c.root_slowest_s * 1e3:.2f})"
                 if c.root_slowest_s is not None else "") + "; AdamW "
              f"{c.optimizer_s_per_param * 1e9:.2f} ns/param; contention all_gather {c.contention_all_gather:.2f}, "
              f"reduce_scatter {c.contention_reduce_scatter:.2f}, all_reduce {c.contention_all_reduce:.2f}")
    for k in hw.concurrency:
        print(f"world {k.world}, shard groups of {k.group}: collectives in flight together take {k.two:.2f} (two) "
              f"and {k.three:.2f} (three) times their serial time")
    print(f"hardware written to {out}")
    return 0


CALIBRATE_SEQ = 64
"""--calibrate's sequence for a Hugging Face model when --seq is not given (capped at its positions):
per-unit times scale with tokens in the replay (``_measured_durations``)."""


def _calibrated_hf(args: argparse.Namespace, model: str) -> tuple[int, int]:
    """(vocab, seq) to time a folder's or hf: model's units at: the vocabulary its config gives,
    which is what ``plan time`` matches the timings by."""
    from zeroshard.trainer import adapter
    from zeroshard.trainer.targets import build_target, is_module_spec

    if is_module_spec(model):
        raise ValueError(f"plan calibrate times a transformer's units for plan time, which reads their shape from a "
                         f"Hugging Face config; {model} has none: give a preset, a save_pretrained folder or hf:NAME")
    built = build_target(model, vocab_size=getattr(args, "vocab_size", None), seq_len=args.seq or CALIBRATE_SEQ)
    positions = adapter.max_positions(built)
    seq = args.seq or min(CALIBRATE_SEQ, positions or CALIBRATE_SEQ)
    if positions is not None and seq > positions:
        raise ValueError(f"--seq {seq} is longer than the {positions} positions of {model}; pass --seq {positions} or less")
    return int(getattr(built, "config").vocab_size), seq


def calibrated_topology(world: int) -> str:
    """The ``[topology]`` table of what the calibration ran on: ``world`` gloo ranks on this host,
    with this host's name, processor and interface as zs.init's topology gather reports them."""
    import torch

    from zeroshard.comm.host_probe import local_facts
    from zeroshard.comm.names import Dim
    from zeroshard.comm.topology import Topology
    from zeroshard.tools.planner.topology_source import to_toml_table

    mine = local_facts(0, torch.device("cpu"))
    topology = Topology(tuple(dataclasses.replace(mine, rank=r, local_rank=r) for r in range(world)))
    return to_toml_table(topology.describe({Dim.SHARD: world}), f"zeroshard plan calibrate on {world} gloo ranks")


def run_topology(args: argparse.Namespace):
    """--topology's, else the [topology] a --hw TOML recorded, else None (the --hw preset's nodes);
    --world, when not given, is its ranks."""
    from zeroshard.tools.planner.topology_source import from_toml, parse

    topology = None
    if getattr(args, "topology", None):
        topology = parse(args.topology)
    elif args.hw and args.hw.endswith(".toml") and Path(args.hw).is_file():
        topology = from_toml(Path(args.hw))  # None when the file recorded no [topology]
    if topology is None:
        return None
    if args.world is None and not getattr(args, "sweep", None):
        args.world = topology.world
    elif args.world is not None and args.world != topology.world and args.topology:
        raise ValueError(f"--world {args.world} is not the {topology.world} ranks of --topology ({topology.text}); "
                         "drop --world or make them agree")
    return topology


def print_calibration(args: argparse.Namespace) -> int:
    from zeroshard.tools.sim.calibrate import calibrate

    if args.calibrate == "all":
        return calibrate_to_toml(args)
    if not args.world or args.world < 2:
        raise ValueError(f"plan calibrate {args.calibrate} needs --world N with N >= 2 local gloo ranks")
    result = calibrate(args.world, args.calibrate)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for nbytes, seconds in result["points"]:
        print(f"{args.calibrate} {nbytes / 1e6:10.3f} MB on {args.world} ranks: {seconds * 1e6:10.1f} us")
    print(f"fit: alpha {result['alpha_s'] * 1e6:.1f} us per ring step, bus bandwidth "
          f"{result['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s")
    print(f"as --hw TOML: base = \"{DEFAULT_HW}\"\nintra_latency = {result['alpha_s']:.3g}\n"
          f"intra_bandwidth = {result['bandwidth_bytes_per_s']:.3g}")
    return 0


def print_time(args: argparse.Namespace) -> int:
    from rich.console import Console

    from zeroshard.tools.sim.report import sweep_plot, time_table

    w, hw, rows, topology = run_time(args)
    chart = sweep_plot(rows, args.plot, w, hw) if args.plot else None
    if args.json:
        print(json.dumps({"hardware": hw.name, "workload": {"model": w.shape.name, "micro_batch": w.micro_batch,
                                                            "seq": w.seq, "checkpointing": w.checkpointing},
                          "topology": topology.to_dict() if topology else None,
                          "rows": [r.to_dict() for r in rows], **({"plot": str(chart)} if chart else {})}, indent=1))
        return 0
    console = Console(width=200)
    if topology is not None:
        console.print(f"topology: {topology.text}", highlight=False)
    console.print(time_table(rows, w, hw))
    if chart:
        console.print(f"chart written to {chart}")
    return 0

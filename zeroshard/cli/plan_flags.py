"""`zeroshard plan`'s subcommands (``HELP``) and the flags each one reads.

Each subcommand's parser holds only the flags it reads, so argparse itself refuses the others
(``unread_hint`` names the subcommands that do read one). The spellings from before the
subcommands still work: ``plan --time``, ``plan --calibrate [OP]``, ``plan --measure`` and a bare
``plan ...`` are read as ``plan time``, ``plan calibrate [OP]``, ``plan measure`` and ``plan memory``.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

SUBCOMMANDS = ("memory", "time", "calibrate", "measure")
ALIASES = (("--calibrate", "calibrate"), ("--time", "time"), ("--measure", "measure"))
"""The old mode flags, in the order the old `plan` let them win over each other."""
CALIBRATE_OPS = ("all", "all_gather", "reduce_scatter", "all_reduce")
DEFAULT_COMM_QUANT_BLOCK = 256
"""zs.plan's (and TrainConfig's) quantization block when --comm-quant-block is not given."""


def subcommand_argv(words: Sequence[str]) -> list[str]:
    """``words`` with an old `plan` spelling turned into its subcommand (the mode flag dropped, and
    --calibrate's collective kept as the subcommand's argument); any other command line as given."""
    words = list(words)
    if words[:1] != ["plan"] or len(words) < 2 or words[1] in (*SUBCOMMANDS, "-h", "--help"):
        return words
    rest = words[1:]
    for flag, name in ALIASES:
        at = next((i for i, w in enumerate(rest) if w == flag or w.startswith(flag + "=")), None)
        if at is None:
            continue
        word = rest.pop(at)
        op = [word.split("=", 1)[1]] if "=" in word else []
        if flag == "--calibrate" and not op and at < len(rest) and rest[at] in CALIBRATE_OPS:
            op = [rest.pop(at)]
        return ["plan", name, *op, *rest]
    return ["plan", "memory", *rest]


def unread_hint(parser: argparse.ArgumentParser, mode: str, extra: Sequence[str]) -> str:
    """One line for a flag ``plan <mode>`` does not read, naming the subcommands that do read it."""
    flag = next((w.split("=", 1)[0] for w in extra if w.startswith("--")), extra[0])
    if flag in dict(ALIASES):
        return f"{flag} is `plan {dict(ALIASES)[flag]}`, a subcommand of its own: run it or plan {mode}, not both"
    # argparse lists subcommands and their options only in its private tables.
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    plan = commands.choices["plan"]
    modes = next(a for a in plan._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    readers = [f"plan {n}" for n, p in modes.choices.items() if flag in p._option_string_actions]  # noqa: SLF001
    where = f"it is read by {', '.join(readers)}" if readers else "no plan subcommand reads it"
    return f"plan {mode} does not read {flag} ({where}); drop {flag}"


def _what(p: argparse.ArgumentParser, mode: str) -> None:
    from zeroshard.trainer.config import MODEL_NAMES
    from zeroshard.tools.sim.workload import SHAPES

    g = p.add_argument_group("what to plan" + (" (one of)" if mode in ("memory", "measure") else ""))
    g.add_argument("--model", metavar="MODEL", help="a GPT preset " f"({', '.join(MODEL_NAMES)}), a Llama shape "
                   f"({', '.join(SHAPES)}), a save_pretrained folder, hf:NAME"
                   + (", or module:Class (with --model-config)" if mode != "time" else ""))
    if mode in ("memory", "measure"):
        g.add_argument("--model-config", metavar="JSON", help="module:Class's keyword arguments: a JSON object, "
                       "inline or a .json file")
        g.add_argument("--params", metavar="COUNT", help="a bare parameter count (7e9, 350M): the textbook table")


def _layout(p: argparse.ArgumentParser, mode: str) -> None:
    from zeroshard.cli.plan_pipeline import add_pp_flags
    from zeroshard.cli.typed_flags import add_typed_flag
    from zeroshard.trainer.config import field_help, field_type

    g = p.add_argument_group("the run")
    worlds = g.add_mutually_exclusive_group() if mode == "time" else g
    worlds.add_argument("--world", type=int, help="ranks in all: pp x data-parallel x --tp")
    if mode == "time":
        worlds.add_argument("--sweep", metavar="N,N,...", help="world sizes to sweep instead of --world")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: consecutive ranks each block is "
                   "split over (Megatron column/row split; default: 1)")
    if mode != "time":
        g.add_argument("--sequence-parallel", action="store_true", help="with --tp: also split the norms' and "
                       "residual's activations along the sequence")
    add_typed_flag(g, "ep", field_type("ep"), f"{field_help('ep')} (default: 1)")  # train's own key
    add_typed_flag(g, "cp", field_type("cp"), f"{field_help('cp')} (default: 1)")
    add_typed_flag(g, "cp_attention", field_type("cp_attention"), f"{field_help('cp_attention')} (default: ring)")
    g.add_argument("--routing-skew", type=float, help="with --ep: extra rows the busiest ep rank receives, as a "
                   "share of its balanced tokens x top_k (0: balanced, the default; 1: twice its share)")
    add_pp_flags(g)  # --pp, --pp-schedule, --microbatches, --pp-stages-per-rank: TrainConfig's fields
    g.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="the stage you intend (highlighted"
                   + ("; the one measured" if mode == "measure" else "") + "); every stage is planned")
    batches = g.add_mutually_exclusive_group() if mode == "time" else g
    batches.add_argument("--batch", type=int, help="GLOBAL batch in sequences per step (default: one per rank)")
    if mode == "time":
        batches.add_argument("--micro-batch", type=int, help="sequences per rank per step (default: --batch / "
                             "world, or 1)")
    g.add_argument("--seq", type=int, help="tokens per sequence (default: the model's seq_len, 8192 for a shape)")
    g.add_argument("--accum", type=int, default=1, help="gradient-accumulation micro-steps (default: 1)")
    if mode != "time":  # train's own key: clipping's float64 chunk is in the step only when it clips
        add_typed_flag(g, "clip", field_type("clip"), f"{field_help('clip')} (default: train's)")
    g.add_argument("--mp", choices=("fp32", "bf16", "fp16"), help="compute dtype (fp32 master, fp32 reduction); "
                   "default: the model's own dtype, or bf16 params and grads for --params")
    g.add_argument("--vocab-size", type=int, help="override the GPT's vocabulary size")
    shards = g.add_mutually_exclusive_group() if mode == "time" else g
    shards.add_argument("--shard-size", type=int, help="also plan hybrid variants sharded over groups of this size")
    if mode == "time":
        shards.add_argument("--shard-sizes", metavar="S,S,...", help="hybrid shard-group sizes to include")


def _engine(p: argparse.ArgumentParser, mode: str) -> None:
    from zeroshard.cli.typed_flags import add_knob_flags
    from zeroshard.tools.planner.spec import PLANNED_KNOBS
    from zeroshard.tools.sim.step import SIMULATED_KNOBS

    g = p.add_argument_group("the engine's knobs (as zeroshard train takes them)")
    add_knob_flags(g, SIMULATED_KNOBS if mode == "time" else PLANNED_KNOBS)
    if mode != "time":
        g.add_argument("--optimizer", default="adamw", help="torch.optim name or module:Class (default: adamw); "
                       "its state size is found by running it")
        g.add_argument("--comm-quant", help="quantized communication as in train: weights, grads, grads+ef or "
                       "weights,grads[+ef] (int8 + fp32 block scales on the wire; default: none)")
        g.add_argument("--comm-quant-block", type=int, help="elements per quantization block of --comm-quant "
                       f"(default: {DEFAULT_COMM_QUANT_BLOCK})")
        g.add_argument("--accounting", choices=("runtime", "textbook"), help="runtime (zeroshard's real buffers; "
                       "default for --model) or textbook (default for --params)")
        g.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="target backend: optimizer "
                       "scratch and grad-buffer lifetime differ (default: cuda)")
    g.add_argument("--headroom", type=float, default=0.10, help="allocator headroom fraction (default: 0.10)")


def _hardware(p: argparse.ArgumentParser, mode: str) -> None:
    from zeroshard.tools.sim.hardware import DEFAULT_HW, PRESETS

    g = p.add_argument_group("hardware" + (" and the recommender" if mode != "time" else ""))
    g.add_argument("--device-mem", metavar="SIZE", help="memory per device, e.g. 80GB: "
                   + ("turns on the recommender" if mode != "time" else "fits are judged against it"))
    g.add_argument("--hw", help=f"hardware preset ({', '.join(PRESETS)}) or a .toml file from plan calibrate "
                   f"(default: {DEFAULT_HW})" + ("; prices the recommender's candidates" if mode != "time" else ""))
    if mode != "time":
        default = PRESETS[DEFAULT_HW]
        for side, bandwidth in (("intra", default.intra_bandwidth), ("inter", default.inter_bandwidth)):
            g.add_argument(f"--{side}-gbps", type=float, help=f"{side}-node link, Gb/s (default: --hw's, "
                           f"{bandwidth * 8 / 1e9:g} for {DEFAULT_HW}); prices the recommender's candidates")
        g.add_argument("--gpus-per-node", type=int, help=f"ranks per node (default: --hw's, {default.gpus_per_node}):"
                       " which collectives cross nodes")
    g.add_argument("--topology", metavar="SPEC", help="the run's hosts: HOSTSxRANKS (2x4), a run directory (its "
                   "summary.json or metrics.jsonl header), or a plan calibrate TOML; sets --world and the ranks per "
                   "host")


def _output(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--plot", metavar="OUT.png", help="write a chart (needs matplotlib)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("calibrate", nargs="?", default="all", choices=CALIBRATE_OPS, metavar="COLLECTIVE",
                   help="all (default): fit every collective the step uses and time --model's units at --world, or "
                        "each of --sweep (default 2,4), and write a hardware TOML for --hw; or one of all_gather, "
                        "reduce_scatter, all_reduce: fit only that one at --world and print it")
    p.add_argument("--model", metavar="MODEL", help="whose units to time (default: small)")
    p.add_argument("--world", type=int, help="local gloo ranks")
    p.add_argument("--sweep", metavar="N,N,...", help="world sizes to time, instead of --world")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's)")
    p.add_argument("--micro-batch", type=int, help="sequences per rank (default: 1)")
    p.add_argument("--vocab-size", type=int, help="override the GPT's vocabulary size")
    p.add_argument("--hw-out", metavar="FILE.toml", help="where the hardware TOML goes "
                   "(default: ~/.cache/zeroshard/local.toml)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


HELP = {"memory": "per-rank memory of every stage and a recommendation (the default)",
        "time": "one step simulated: time, tokens/s/GPU, MFU, exposed communication, memory",
        "calibrate": "time this host's collectives and units on gloo ranks, for plan time --hw",
        "measure": "the memory plan against one real step per stage, on gloo ranks"}


def add_subcommands(plan: argparse.ArgumentParser, runs: dict[str, Any]) -> None:
    """``plan memory|time|calibrate|measure``, each with its flags and its ``run``."""
    sub = plan.add_subparsers(dest="plan_mode", required=True, metavar="SUBCOMMAND")
    for mode in SUBCOMMANDS:
        # No abbreviations: a flag another subcommand reads must be refused here, not taken as a
        # prefix of one of this one's (--hw as --hw-out).
        p = sub.add_parser(mode, help=HELP[mode], description=HELP[mode], allow_abbrev=False)
        if mode == "calibrate":
            _calibrate(p)
        else:
            for add in (_what, _layout, _engine, _hardware):
                add(p, mode)
            _output(p)
        p.set_defaults(run=runs[mode], measure=mode == "measure", time=mode == "time",
                       **({"calibrate": None} if mode != "calibrate" else {}))

"""`zeroshard tune`: choose stage, prefetch, reshard, bucket size and checkpointing by useful tokens/s.

  zeroshard tune --model small --nproc 2 --batch 8 --seq-len 128 --device-mem 2GB
  zeroshard tune --config run.toml --stages 2,3 --prefetch 1,2 --checkpointing none,sqrt --out tuned.toml
  zeroshard tune --model tiny-moe --nproc 4 --ep-degrees 1,2,4 --stages 2,3
  zeroshard train --config tuned.toml

The planner first drops every candidate whose predicted per-rank memory exceeds --device-mem; the
rest train a few real steps each on --nproc spawned ranks, interleaved (A B C ... A B C ...). The
fastest is written as a TOML config: the workload flags and --config file, plus the winning knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from zeroshard.cli.train import add_config_flags, check_before_launch, config_from_args, fail, one_line
from zeroshard.trainer.config import field_names
from zeroshard.trainer.targets import is_module_spec
from zeroshard.tools.tune.grid import DEFAULT_AXES

WORKLOAD_FLAGS = ("model", "nproc", "tp", "batch", "seq_len", "mp", "accum", "vocab_size", "data", "seed", "lr",
                  "weight_decay", "clip", "accumulation", "pp", "pp_schedule", "microbatches", "pp_stages_per_rank",
                  "ep", "cp", "cp_attention")
"""TrainConfig fields tune takes as flags: what shapes a step's cost. Others come from --config. `tp` is
fixed for the search (every candidate runs at it), not searched: it decides which model fits at all.
`ep` and `cp` are fixed too, or searched by --ep-degrees and --cp-degrees."""


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _knobs(r: dict) -> str:
    pipe = "".join([f", {r['pp_schedule']}" if r.get("pp_schedule") else "",
                    f", {r['microbatches']} microbatches" if r.get("microbatches") else "",
                    f", ep {r['ep']}" if r.get("ep") else "", f", cp {r['cp']}" if r.get("cp") else ""])
    if r["stage"] == 3:
        return f"prefetch {r['prefetch']}, {'reshard' if r['reshard_after_forward'] else 'no reshard'}{pipe}"
    return f"bucket {r['bucket_mb']:g} MB{pipe}"


def ranking_table(ranked: list[dict], title: str) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD,
              caption="step: median over every timed step; spread: their interquartile range / median. MB = 10^6 "
                      "bytes per rank; meas: peak live tensors over one step; pred: the planner's allocated peak / "
                      "with allocator headroom (what --device-mem is held to)")
    for col in ("#", "stage", "knobs", "ckpt", "tokens/s", "step", "spread", "x best", "meas MB", "pred MB"):
        t.add_column(col, justify="left" if col in ("knobs", "ckpt") else "right", no_wrap=True)
    for r in ranked:
        if r["status"] == "pruned":
            continue
        head = [str(r["stage"]), _knobs(r), r["checkpointing"]]
        pred = f"{_mb(r['predicted_allocated_bytes'])} / {_mb(r['predicted_total_bytes'])}"
        if r["status"] == "failed":
            t.add_row("[red]x", *head, "[red]failed", "-", "-", "-", "-", pred)
            continue
        t.add_row(str(r["rank"]), *head, f"{r['tokens_per_s']:,.0f}", f"{r['median_step_s'] * 1e3:.1f} ms",
                  f"{r['spread']:.0%}", f"{r['vs_best']:.2f}", _mb(r["measured_peak_bytes"]), pred,
                  style="bold" if r["rank"] == 1 else None)
    return t


def _base_config(args: argparse.Namespace):
    from zeroshard.trainer.launch import running_under_torchrun

    if running_under_torchrun():
        raise ValueError("tune spawns its own --nproc ranks; run it directly, not under torchrun")
    if args.model is not None and is_module_spec(args.model):
        # Not planning alone: tune trains each candidate with train's own step and writes a train config.
        raise ValueError(f"tune ranks candidates by training them as zeroshard train does, and train builds presets, "
                         f"hf:NAME and save_pretrained folders, not module:Class ({args.model}); plan it with "
                         f"zeroshard plan memory --model {args.model} --model-config JSON --world N --device-mem SIZE (and "
                         "plan measure for one real step per stage), or tune its save_pretrained folder")
    base = config_from_args(args)
    if base.engine.offload.kind != "none" or base.shard_size is not None:
        raise ValueError("tune does not search offload or hybrid sharding yet; remove offload/shard_size from "
                         "the config, tune, then add them back")
    check_before_launch(base)
    return base


def _all_fit(kept: list, predictions: dict, base: Any, budget: int | None, cuda: bool) -> bool:
    """Whether every candidate can stay built across rounds: within the device budget (each rank has
    its own GPU), or within half the free host memory that local CPU ranks share."""
    import torch

    from zeroshard.tools.tune.measure import fits_resident, host_available_bytes

    limit = (budget or torch.cuda.mem_get_info()[1]) if cuda else host_available_bytes() // 2
    return fits_resident([predictions[c] for c in kept], world=base.nproc, limit=limit, shared_host=not cuda)


def _checkpointing_axis(args: argparse.Namespace, base: Any) -> str:
    """The checkpointing axis. Under the zero-bubble schedule the runtime refuses checkpointing, so
    the default axis is none there (an explicit one is refused by the planner's own check)."""
    from zeroshard.parallel.pipeline.schedules import schedule_spec

    if base.pp == 1:
        for flag, value in (("--pp-schedules", args.pp_schedules), ("--microbatch-counts", args.microbatch_counts)):
            if value is not None:
                raise ValueError(f"{flag} is searched under a pipeline; add --pp N (N >= 2) or drop {flag}")
        return args.grid_checkpointing
    if args.grid_comm_quant != "none":
        raise ValueError("quantized communication is not composed with pp > 1 (docs/pipeline.md); drop --comm-quant")
    split = args.pp_schedules is None and schedule_spec(base.pp_schedule).split_backward
    return "none" if split and args.grid_checkpointing == DEFAULT_AXES["checkpointing"] else args.grid_checkpointing


def _ep_axis(args: argparse.Namespace, base: Any) -> str | None:
    """--ep-degrees, each degree checked as `zeroshard train` checks its --ep before launch (the
    ranks it divides, a model with MoE layers whose experts it divides): a degree train would refuse
    is refused here in one line, naming it."""
    from zeroshard.tools.tune.grid import parse_axes

    if args.ep_degrees is None:
        return None
    if args.ep is not None:
        raise ValueError("--ep fixes the expert-parallel degree and --ep-degrees searches it; give one of them")
    degrees = parse_axes(**DEFAULT_AXES, ep_degrees=args.ep_degrees).ep
    for ep in degrees:
        try:
            check_before_launch(base.replace(ep=ep))
        except ValueError as e:
            raise ValueError(f"--ep-degrees {args.ep_degrees}: {one_line(e)} (drop {ep} from --ep-degrees)") from None
    return args.ep_degrees


def _cp_axis(args: argparse.Namespace, base: Any) -> str | None:
    """--cp-degrees, each checked as `zeroshard train` checks its --cp before launch (the ranks it
    divides, a sequence its chunks divide)."""
    from zeroshard.tools.tune.grid import parse_axes

    if args.cp_degrees is None:
        return None
    if args.cp is not None:
        raise ValueError("--cp fixes the context-parallel degree and --cp-degrees searches it; give one of them")
    for cp in parse_axes(**DEFAULT_AXES, cp_degrees=args.cp_degrees).cp:
        try:
            check_before_launch(base.replace(cp=cp))
        except ValueError as e:
            raise ValueError(f"--cp-degrees {args.cp_degrees}: {one_line(e)} (drop {cp} from --cp-degrees)") from None
    return args.cp_degrees


def _grid(args: argparse.Namespace) -> tuple[Any, Any, int | None, Any]:
    """(the base config, the grid's axes, the per-rank byte budget, the measurement spec), each checked
    before any planning: a bad flag fails here."""
    from zeroshard.tools.planner.spec import parse_bytes
    from zeroshard.tools.tune.grid import parse_axes
    from zeroshard.tools.tune.measure import MeasureSpec

    base = _base_config(args)
    axes = parse_axes(stages=args.stages, prefetch=args.grid_prefetch, bucket_mb=args.grid_bucket_mb,
                      checkpointing=_checkpointing_axis(args, base), reshard=args.reshard,
                      comm_quant=args.grid_comm_quant, pp_schedules=args.pp_schedules,
                      microbatches=args.microbatch_counts, ep_degrees=_ep_axis(args, base),
                      cp_degrees=_cp_axis(args, base))
    budget = parse_bytes(args.device_mem) if args.device_mem else None
    # Built now so that a bad --steps/--rounds/--warmup fails before any planning.
    spec = MeasureSpec(base=base, candidates=(), steps=args.tune_steps, rounds=args.rounds, warmup=args.tune_warmup)
    return base, axes, budget, spec


def _show_ranking(console: Any, ranked: list[dict], base: Any, *, as_json: bool) -> None:
    """The ranked rows: one JSON line each (--json), or the table; then each failed candidate's error."""
    if as_json:
        for row in ranked:
            print(json.dumps(row), flush=True)
    else:
        ranks = f"{base.nproc} ranks" + (f" (tp {base.tp})" if base.tp > 1 else "") + (
            f" in pp {base.pp}" if base.pp > 1 else "") + (f", ep {base.ep}" if base.ep > 1 else "")
        console.print(ranking_table(ranked, f"zeroshard tune: {base.model}, {ranks}, global batch "
                                            f"{base.batch} x {base.seq_len}, {base.mp}; useful tokens/s"))
    for r in ranked:
        if r["status"] == "failed":
            console.print(f"[red]failed[/red] {r['candidate']}: {r['error']}", highlight=False, soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from zeroshard.trainer.launch import WorkerError
    from zeroshard.tools.tune import choose, tomlfile
    from zeroshard.tools.tune.grid import candidates
    from zeroshard.tools.tune.measure import measure
    from zeroshard.tools.tune.prune import mb, predict, prune

    console = Console(stderr=args.json)  # --json keeps stdout to the rows
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log keeps whole table rows, not 80-column wraps
    try:
        base, axes, budget, spec = _grid(args)
    except ValueError as e:
        return fail("tune", str(e))

    import torch

    cuda = torch.cuda.is_available()
    cands = candidates(axes)
    try:
        predictions = predict(cands, base, device="cuda" if cuda else "cpu")
    except ValueError as e:
        return fail("tune", str(e))
    kept, pruned = prune(cands, predictions, budget)
    for p in pruned:
        console.print(f"pruned {p.candidate.name}: {p.reason}", highlight=False, soft_wrap=True)
    if not kept:
        assert budget is not None  # without a budget nothing is pruned
        smallest = min(pruned, key=lambda p: p.prediction.total)
        return fail("tune", f"no candidate fits {mb(budget)} per rank: the smallest, {smallest.candidate.name}, "
                            f"is predicted at {mb(smallest.prediction.total)}; widen the grid (--stages 3, "
                            f"--checkpointing sqrt), lower --batch or --seq-len, or raise --device-mem")
    resident = args.resident if args.resident is not None else _all_fit(kept, predictions, base, budget, cuda)
    how = "all built at once" if resident else "each rebuilt in its turn (memory)"
    console.print(f"measuring {len(kept)} candidate(s) on {base.nproc} ranks: {args.rounds} interleaved rounds of "
                  f"{args.tune_steps} timed step(s), after {args.tune_warmup} warm-up step(s); {how}",
                  highlight=False, soft_wrap=True)
    spec = dataclasses.replace(spec, candidates=tuple(kept), resident=resident)
    try:
        rows = measure(spec)
    except WorkerError as e:
        return fail("tune", f"measurement failed: {one_line(e)}")
    ranked = choose.rank(rows, kept, predictions, pruned)
    ok = [r for r in ranked if r["status"] == "ok"]
    if ok:
        winner = ok[0]
        winner["winner"] = True
        path = tomlfile.write(args.out, choose.tuned_values(base, winner),
                              header=choose.header(winner, ranked, base, budget))
    _show_ranking(console, ranked, base, as_json=args.json)
    if not ok:
        return fail("tune", "every candidate failed; nothing written")
    if choose.close_call(ranked):
        console.print("note: the runner-up is within the winner's step-time spread; more --rounds would "
                      "separate them", highlight=False, soft_wrap=True)
    console.print(f"winner: {winner['candidate']} -> {path}; run it with: zeroshard train --config {path}",
                  highlight=False, soft_wrap=True)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="choose stage/prefetch/buckets/checkpointing by measured tokens/s within a "
                                    "memory budget; writes a train config",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, skip=tuple(n for n in field_names() if n not in WORKLOAD_FLAGS))
    grid = p.add_argument_group("grid (comma-separated values; prefetch and reshard vary at stage 3 only, "
                                "bucket-mb at stages 0-2 only)")
    grid.add_argument("--stages", metavar="LIST", default=DEFAULT_AXES["stages"], help="default: %(default)s")
    grid.add_argument("--prefetch", dest="grid_prefetch", metavar="LIST", default=DEFAULT_AXES["prefetch"],
                      help="units all-gathered ahead (default: %(default)s)")
    grid.add_argument("--bucket-mb", dest="grid_bucket_mb", metavar="LIST", default=DEFAULT_AXES["bucket_mb"],
                      help="gradient bucket sizes in MB (default: %(default)s)")
    grid.add_argument("--checkpointing", dest="grid_checkpointing", metavar="LIST",
                      default=DEFAULT_AXES["checkpointing"], help="none, all, sqrt, every:K (default: %(default)s)")
    grid.add_argument("--reshard", metavar="LIST", default=DEFAULT_AXES["reshard"],
                      help="reshard_after_forward values, true/false (default: %(default)s)")
    grid.add_argument("--comm-quant", dest="grid_comm_quant", metavar="LIST", default=DEFAULT_AXES["comm_quant"],
                      help="quantized communication settings, '/' joining parts of one: none, weights, grads, "
                           "grads+ef, weights/grads (kept only at stages that accept them; default: %(default)s)")
    grid.add_argument("--pp-schedules", metavar="LIST",
                      help="under --pp, torch's schedules to search, e.g. 1f1b,gpipe (default: --pp-schedule's)")
    grid.add_argument("--microbatch-counts", metavar="LIST",
                      help="under --pp, microbatches per schedule run to search, e.g. 2,4 (default: --microbatches')")
    grid.add_argument("--ep-degrees", metavar="LIST",
                      help="for an MoE model, expert-parallel degrees to search, e.g. 1,2,4 (each one train's --ep "
                           "accepts; default: --ep's)")
    grid.add_argument("--cp-degrees", metavar="LIST",
                      help="context-parallel degrees to search, e.g. 1,2,4 (each one train's --cp accepts; default: "
                           "--cp's)")
    m = p.add_argument_group("measurement")
    m.add_argument("--device-mem", metavar="SIZE",
                   help="per-rank memory budget (2GB, 512MB, 24GiB); the planner prunes what would not fit")
    m.add_argument("--steps", dest="tune_steps", metavar="N", type=int, default=3,
                   help="timed steps per candidate in each round (default: %(default)s)")
    m.add_argument("--rounds", metavar="N", type=int, default=3,
                   help="interleaved rounds, A B C ... repeated (default: %(default)s)")
    m.add_argument("--warmup", dest="tune_warmup", metavar="N", type=int, default=2,
                   help="untimed steps after each build (default: %(default)s)")
    m.add_argument("--resident", action=argparse.BooleanOptionalAction, default=None,
                   help="keep every candidate built across rounds (default: when the predicted memory of all of "
                        "them fits); --no-resident rebuilds each in its turn")
    p.add_argument("--out", default="tuned.toml", help="where the winning config goes (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON row per candidate on stdout")
    p.set_defaults(run=run)

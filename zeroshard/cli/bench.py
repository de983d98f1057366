"""`zeroshard bench`: our stages against torch DDP and FSDP2 on the same work, interleaved."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("run", "median step", "tokens/s", "x floor", "vs FSDP2", "vs torch DDP", "peak MiB/rank",
                "comm MB/step"):
        t.add_column(col, justify="right")
    for r in rows:
        comm = "-" if r["comm_bytes_per_step"] is None else f"{r['comm_bytes_per_step'] / 1e6:.1f}"
        t.add_row(r["name"], f"{r['median_step_s'] * 1e3:.0f} ms", f"{r['tokens_per_s']:,.0f}",
                  f"{r['x_floor']:.2f}", f"{r['vs_fsdp2']:.2f}", f"{r['vs_torch_ddp']:.2f}",
                  f"{r['peak_bytes_per_rank'] / 2**20:.0f}", comm)
    return t


def host_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("kind", "us/step", "us/unit", "calls/step", "share of step"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["kind"], f"{r['us_per_step']:.0f}", f"{r['us_per_unit']:.1f}", f"{r['calls_per_step']:.0f}",
                  f"{r['share']:.1%}")
    return t


def run(args: argparse.Namespace) -> int:
    from zeroshard.tools.benchmark import BenchSpec, run_bench, run_host_breakdown

    spec = BenchSpec(model=args.model, world=args.world, batch=args.batch, seq=args.seq, dtype=args.dtype,
                     rounds=args.rounds, steps_per_round=args.steps_per_round, layers=args.layers, width=args.width,
                     only=tuple(k for k in args.only.split(",") if k) if args.only else (),
                     host_breakdown=args.host_breakdown)
    shape = "".join(f", {n} {v}" for n, v in (("layers", spec.layers), ("width", spec.width)) if v)
    title = f"{spec.model}{shape}, world {spec.world}, B={spec.batch}/rank, T={spec.seq}, {spec.dtype}, AdamW, 1 thread/rank"
    if spec.host_breakdown:
        for name, rows in run_host_breakdown(spec).items():
            if args.json:
                print(json.dumps({"run": name, "rows": rows}))
            else:
                Console().print(host_table(rows, f"{name}: host time by kind (mean over ranks), {title}"))
        return 0
    rows = run_bench(spec)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        Console().print(table(rows, title))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare our stages with torch DDP and FSDP2 (tokens/s, peak memory)",
                       description=__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=None, help="blocks, replacing the preset's (e.g. 32 with "
                   "--width 64: a thin, deep model where per-unit overheads dominate)")
    p.add_argument("--width", type=int, default=None, help="embedding width, replacing the preset's")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C ... repeated)")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated runs to keep (floor, ddp and fsdp2 always run): "
                   "stage0,stage1,stage2,stage3,fsdp2-noreshard")
    p.add_argument("--host-breakdown", action="store_true", help="instead of the comparison: the runtime's host "
                   "time per kind of work (hooks, reductions, optimizer, param copies), per step and per unit, for "
                   "each of our stages (--only picks them)")
    p.add_argument("--json", action="store_true", help="one JSON row per run")
    p.set_defaults(run=run)

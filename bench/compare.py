"""Regenerate bench/RESULTS.md: `zeroshard bench` at world 2 and 4, fp32 and bf16.

    .venv/bin/python bench/compare.py [--rounds 5] [--out bench/RESULTS.md]

Never edit RESULTS.md by hand; run this on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import platform
import sys

from rich.console import Console

from zeroshard.tools.benchmark import BenchSpec, run_bench
from zeroshard.cli.bench import table


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def targets(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """The issue's targets, read off one table: (target, measured, met)."""
    by = {r["name"]: r for r in rows}
    s0, s2, s3 = by["zeroshard stage 0"], by["zeroshard stage 2"], by["zeroshard stage 3"]
    ddp, fsdp2 = by["torch DDP"], by["FSDP2"]
    return [
        ("ZeRO-3 step <= 1.10x floor", f"{s3['x_floor']:.2f}x", s3["x_floor"] <= 1.10),
        ("ZeRO-3 tokens/s >= 1.15x FSDP2", f"{s3['vs_fsdp2']:.2f}x", s3["vs_fsdp2"] >= 1.15),
        ("stage 0 tokens/s >= torch DDP", f"{s0['tokens_per_s']:,.0f} vs {ddp['tokens_per_s']:,.0f}",
         s0["tokens_per_s"] >= ddp["tokens_per_s"]),
        ("ZeRO-2 step <= 1.08x floor", f"{s2['x_floor']:.2f}x", s2["x_floor"] <= 1.08),
        ("ZeRO-3 peak <= FSDP2 peak", f"{s3['peak_bytes_per_rank'] / 2**20:.1f} vs "
         f"{fsdp2['peak_bytes_per_rank'] / 2**20:.1f} MiB", s3["peak_bytes_per_rank"] <= fsdp2["peak_bytes_per_rank"]),
    ]


def targets_text(rows: list[dict]) -> str:
    return "\n".join(f"- {'met   ' if ok else 'MISSED'} {name}: {value}" for name, value, ok in targets(rows)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--out", default="bench/RESULTS.md")
    args = parser.parse_args()
    sections = []
    for dtype in args.dtypes.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            spec = BenchSpec(world=world, dtype=dtype, rounds=args.rounds)
            rows = run_bench(spec)
            buffer = io.StringIO()
            Console(file=buffer, width=140, color_system=None).print(
                table(rows, f"small, world {world}, B=4/rank, T=128, {dtype}, AdamW, 1 thread/rank"))
            sections.append(buffer.getvalue() + "\n" + targets_text(rows))
            print(sections[-1], flush=True)
    header = (f"# Benchmark results\n\nGenerated {datetime.datetime.now():%Y-%m-%d %H:%M} by\n"
              f"`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`\n\n"
              f"Machine: {os.cpu_count()} CPUs ({cpu_model()}), torch {__import__('torch').__version__}, gloo.\n"
              "Rows alternate within each table (A B C ... repeated); x floor = median step time over the\n"
              "single-process step on the same per-rank micro-batch; peak = MemTracker total live bytes.\n\n")
    with open(args.out, "w") as handle:
        handle.write(header + "\n".join(f"```\n{s}```\n" for s in sections))


if __name__ == "__main__":
    main()

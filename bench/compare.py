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

from zeroshard.benchmark import BenchSpec, run_bench
from zeroshard.cli.bench import table


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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
            sections.append(buffer.getvalue())
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

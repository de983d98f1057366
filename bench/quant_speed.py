"""Speed of quantized communication: stage 3 with qwZ+qgZ vs stage 3 fp32 comm vs FSDP2 vs the floor.

    .venv/bin/python bench/quant_speed.py [--worlds 2,4] [--rounds 3] [--append bench/RESULTS.md]

`zeroshard bench`'s interleaved rounds (zeroshard/benchmark; torch DDP runs too, as it always
does), `small`, B=4/rank, T=128, fp32, 1 thread per rank. Targets: stage 3 with quantized comm
<= 1.04x the floor at world 2, and >= 1.3x FSDP2's tokens/s. Also measures, in one process, what
the int8 codec costs per step (quantize + dequantize of every element stage 3 sends and
receives), since on CPU it runs on the same cores as the compute it is meant to speed up.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import statistics
import sys
import time

import torch
from rich.console import Console

from zeroshard.benchmark import BenchSpec, run_bench
from zeroshard.cli.bench import table
from zeroshard.comm.quant import dequantize, quantize
from zeroshard.models import GPT, GPTConfig

QUANT = "zeroshard stage 3 qwZ+qgZ"


def codec_seconds(world: int, model: str = "small", block: int = 256, repeats: int = 21) -> tuple[float, int]:
    """Single-thread CPU seconds per step of the int8 codec at stage 3 (process time, so other jobs on a
    shared machine do not inflate it), and the element count it is for.

    Per rank and step: forward and backward gathers quantize the own shard (2 P/N) and dequantize
    every shard (2 P); the grad reduction quantizes the whole local grad (P) and dequantizes N
    pieces of one shard (P). The root unit and small groups stay fp32, so this is an upper bound.
    """
    torch.set_num_threads(1)
    params = sum(p.numel() for p in GPT(GPTConfig.named(model)).parameters())
    flat = torch.randn(1 << 20)
    q, s = quantize(flat, block)
    times_q, times_d = [], []
    for _ in range(repeats):
        start = time.process_time()
        quantize(flat, block)
        times_q.append(time.process_time() - start)
        start = time.process_time()
        dequantize(q, s, flat.numel())
        times_d.append(time.process_time() - start)
    per_q, per_d = statistics.median(times_q) / flat.numel(), statistics.median(times_d) / flat.numel()
    return params * ((2 / world + 1) * per_q + 3 * per_d), params


def targets(rows: list[dict], world: int) -> list[tuple[str, str, bool]]:
    by = {r["name"]: r for r in rows}
    quant = by[QUANT]
    out = [("quantized stage 3 tokens/s >= 1.3x FSDP2", f"{quant['vs_fsdp2']:.2f}x", quant["vs_fsdp2"] >= 1.3)]
    if world == 2:
        out.insert(0, ("quantized stage 3 step <= 1.04x floor", f"{quant['x_floor']:.2f}x", quant["x_floor"] <= 1.04))
    return out


def section(world: int, rounds: int) -> str:
    rows = run_bench(BenchSpec(world=world, rounds=rounds, only=("stage3", "stage3-quant")))
    buffer = io.StringIO()
    Console(file=buffer, width=140, color_system=None).print(
        table(rows, f"small, world {world}, B=4/rank, T=128, fp32, AdamW, 1 thread/rank, {rounds} rounds"))
    by = {r["name"]: r for r in rows}
    codec, params = codec_seconds(world)
    lines = [f"- {'met   ' if ok else 'MISSED'} {name}: {value}" for name, value, ok in targets(rows, world)]
    saved = by["zeroshard stage 3"]["median_step_s"] - by[QUANT]["median_step_s"]
    lines.append(f"- int8 codec, one thread, CPU time: {codec * 1e3:.0f} ms/step for {params / 1e6:.1f}M params "
                 f"(upper bound); step time saved by quantizing vs stage 3 fp32 comm: {saved * 1e3:+.0f} ms; "
                 f"wire {by[QUANT]['comm_bytes_per_step'] / 1e6:.1f} vs "
                 f"{by['zeroshard stage 3']['comm_bytes_per_step'] / 1e6:.1f} MB/step")
    return buffer.getvalue() + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", default=None, help="append the tables to this markdown file (bench/RESULTS.md)")
    parser.add_argument("--note", default="", help="conditions to record with the rows (e.g. 'machine busy')")
    args = parser.parse_args(argv)
    sections = []
    for world in (int(w) for w in args.worlds.split(",")):
        sections.append(section(world, args.rounds))
        print(sections[-1], flush=True)
    if args.append:
        header = (f"\n## Quantized communication (qwZ+qgZ)\n\nGenerated {datetime.datetime.now():%Y-%m-%d %H:%M} by\n"
                  f"`{' '.join([os.path.relpath(sys.executable), *sys.argv])}`\n\n"
                  f"Machine: {os.cpu_count()} CPUs, torch {torch.__version__}, gloo. {args.note}\n\n")
        with open(args.append, "a") as handle:
            handle.write(header + "\n".join(f"```\n{s}```\n" for s in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())

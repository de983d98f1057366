"""Speed of quantized communication: stage 3 with qwZ+qgZ vs stage 3 fp32 comm vs FSDP2 vs the floor.

    .venv/bin/python bench/quant_speed.py [--worlds 2,4] [--rounds 3] [--codec-only] [--append bench/RESULTS.md]

`zeroshard bench`'s interleaved rounds (zeroshard/benchmark; torch DDP runs too, as it always
does), `small`, B=4/rank, T=128, fp32, 1 thread per rank. Targets: stage 3 with quantized comm
<= 1.04x the floor at world 2, and >= 1.3x FSDP2's tokens/s. First measures, in one process, what
the int8 codec costs per element and per step (quantize + dequantize of every element stage 3
sends and receives), eager and as compiled (zeroshard/comm/quant_kernel.py), since on CPU it runs
on the same cores as the compute it is meant to speed up; ``--codec-only`` stops there.
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

from zeroshard.tools.benchmark import BenchSpec, run_bench
from zeroshard.cli.bench import table
from zeroshard.comm.quant import dequantize, num_blocks, quantize, quantize_eager
from zeroshard.comm.quant_kernel import codec_name
from zeroshard.models import GPT, GPTConfig

QUANT = "zeroshard stage 3 qwZ+qgZ"


def _median_ns(fn, numel: int, repeats: int) -> float:
    """Median single-thread CPU time of ``fn()`` per element, in ns (process time: other jobs on a shared
    machine do not inflate it)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) / numel * 1e9


def codec_costs(block: int = 256, numel: int = 1 << 22, repeats: int = 11) -> dict:
    """ns/element of quantize, eager vs the compiled kernel, and of dequantize; the first compiled call's
    wall time (compile, or a load from inductor's cache); whether both quantizers gave the same bits."""
    torch.set_num_threads(1)
    flat = torch.randn(numel)
    blocks = num_blocks(numel, block)
    q_eager, s_eager = torch.empty(blocks * block, dtype=torch.int8), torch.empty(blocks)
    start = time.perf_counter()
    q, s = quantize(flat, block)  # compiles here when it can
    first_call = time.perf_counter() - start
    other = flat[:numel // 3 + 5]
    start = time.perf_counter()
    quantize(other, block)  # another group size: dynamic shapes, so no recompile (a fraction of a second)
    other_size = time.perf_counter() - start
    quantize_eager(flat, block, q_eager, s_eager)
    return {
        "codec": codec_name(),
        "first_call_s": first_call,
        "other_size_s": other_size,
        "bitwise_equal": bool(torch.equal(q, q_eager) and torch.equal(s, s_eager)),
        "quantize_eager_ns": _median_ns(lambda: quantize_eager(flat, block, q_eager, s_eager), numel, repeats),
        "quantize_ns": _median_ns(lambda: quantize(flat, block, out=q, scales_out=s), numel, repeats),
        "dequantize_ns": _median_ns(lambda: dequantize(q, s, numel), numel, repeats),
    }


def codec_ms_per_step(costs: dict, world: int, model: str = "small", quantize_key: str = "quantize_ns") -> float:
    """Single-thread CPU ms per step of the int8 codec at stage 3 for ``model`` (an upper bound).

    Per rank and step: forward and backward gathers quantize the own shard (2 P/N) and dequantize
    every shard (2 P); the grad reduction quantizes the whole local grad (P) and dequantizes N
    pieces of one shard (P). The root unit and small groups stay fp32."""
    params = sum(p.numel() for p in GPT(GPTConfig.named(model)).parameters())
    return params * ((2 / world + 1) * costs[quantize_key] + 3 * costs["dequantize_ns"]) / 1e6


def codec_report(costs: dict, worlds: list[int]) -> str:
    per_step = ", ".join(f"world {w}: {codec_ms_per_step(costs, w, quantize_key='quantize_eager_ns'):.0f} eager -> "
                         f"{codec_ms_per_step(costs, w):.0f} ms/step" for w in worlds)
    return (f"int8 codec, one thread, B=256, 4M fp32 elements: quantize eager {costs['quantize_eager_ns']:.2f} ns/elem, "
            f"as run {costs['quantize_ns']:.2f} ns/elem ({costs['codec']}; first call {costs['first_call_s']:.1f} s, "
            f"then another size {costs['other_size_s'] * 1e3:.0f} ms; "
            f"bitwise equal to eager: {costs['bitwise_equal']}); dequantize {costs['dequantize_ns']:.2f} ns/elem. "
            f"Codec CPU time for small, upper bound: {per_step}\n")


def targets(rows: list[dict], world: int) -> list[tuple[str, str, bool]]:
    by = {r["name"]: r for r in rows}
    quant = by[QUANT]
    out = [("quantized stage 3 tokens/s >= 1.3x FSDP2", f"{quant['vs_fsdp2']:.2f}x", quant["vs_fsdp2"] >= 1.3)]
    if world == 2:
        out.insert(0, ("quantized stage 3 step <= 1.04x floor", f"{quant['x_floor']:.2f}x", quant["x_floor"] <= 1.04))
    return out


def section(world: int, rounds: int, costs: dict) -> str:
    load_before = os.getloadavg()[0]
    rows = run_bench(BenchSpec(world=world, rounds=rounds, only=("stage3", "stage3-quant")))
    load = f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    buffer = io.StringIO()
    Console(file=buffer, width=140, color_system=None).print(
        table(rows, f"small, world {world}, B=4/rank, T=128, fp32, AdamW, 1 thread/rank, {rounds} rounds"))
    by = {r["name"]: r for r in rows}
    codec = codec_ms_per_step(costs, world)
    lines = [f"- {'met   ' if ok else 'MISSED'} {name}: {value}" for name, value, ok in targets(rows, world)]
    saved = by["zeroshard stage 3"]["median_step_s"] - by[QUANT]["median_step_s"]
    lines.append(f"- int8 codec ({costs['codec']}), one thread, CPU time: {codec:.0f} ms/step "
                 f"(upper bound); step time saved by quantizing vs stage 3 fp32 comm: {saved * 1e3:+.0f} ms; "
                 f"wire {by[QUANT]['comm_bytes_per_step'] / 1e6:.1f} vs "
                 f"{by['zeroshard stage 3']['comm_bytes_per_step'] / 1e6:.1f} MB/step")
    lines.append(f"- quantized vs fp32 stage 3 in the same rounds: "
                 f"{by[QUANT]['median_step_s'] / by['zeroshard stage 3']['median_step_s']:.3f}x step time; {load}")
    return buffer.getvalue() + "\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec-only", action="store_true", help="only the codec micro-bench (eager vs compiled)")
    parser.add_argument("--append", default=None, help="append the tables to this markdown file (bench/RESULTS.md)")
    parser.add_argument("--note", default="", help="conditions to record with the rows (e.g. 'machine busy')")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    costs = codec_costs()
    sections = [codec_report(costs, worlds)]
    print(sections[-1], flush=True)
    for world in [] if args.codec_only else worlds:
        sections.append(section(world, args.rounds, costs))
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

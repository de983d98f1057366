"""Interleaved speed/memory comparison of our stages with torch DDP and FSDP2 (`zeroshard bench`)."""

from zeroshard.tools.benchmark.compare import BenchSpec, run_bench, run_host_breakdown

__all__ = ["BenchSpec", "run_bench", "run_host_breakdown"]

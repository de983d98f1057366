"""Interleaved speed/memory comparison of our stages with torch DDP and FSDP2 (`zeroshard bench`)."""

from zeroshard.tools.benchmark.compare import BenchSpec, run_bench

__all__ = ["BenchSpec", "run_bench"]

"""Context parallelism: one sequence split over the cp ranks, attention exact over the whole of it.

See docs/context_parallel.md. ``zs.init(cp=N)`` builds the cp dim (ZeRO then shards over
data-parallel x cp ranks); ``apply_context_parallel(model, mesh, scheme)`` makes the model's
attention ring or Ulysses (before ``zs.shard``); the trainer's step gives each rank its tokens of the
same samples (``ContextParallel.split``).
"""

from zeroshard.parallel.cp.apply import (HF_ATTENTION, ContextParallel, apply_context_parallel, context_of,
                                          share_context)
from zeroshard.parallel.cp.attention import check_heads, ring_attention, ulysses_attention
from zeroshard.parallel.cp.layout import CP_SCHEMES, check_seq, positions, split

__all__ = ["CP_SCHEMES", "HF_ATTENTION", "ContextParallel", "apply_context_parallel", "check_heads", "check_seq",
           "context_of", "positions", "ring_attention", "share_context", "split", "ulysses_attention"]

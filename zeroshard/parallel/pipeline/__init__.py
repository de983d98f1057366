"""Pipeline parallelism with ZeRO inside every stage, on torch.distributed.pipelining (docs/pipeline.md)."""

from zeroshard.parallel.pipeline.runtime import Pipeline
from zeroshard.parallel.pipeline.schedules import SCHEDULES

__all__ = ["Pipeline", "SCHEDULES"]

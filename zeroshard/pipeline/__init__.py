"""Pipeline parallelism with ZeRO inside every stage, on torch.distributed.pipelining (docs/pipeline.md)."""

from zeroshard.pipeline.runtime import Pipeline
from zeroshard.pipeline.schedules import SCHEDULES

__all__ = ["Pipeline", "SCHEDULES"]

"""Offload of fp32 masters and optimizer state: to host memory (``cpu``) or to files (``disk``)."""

from zeroshard.runtime.offload.policy import OffloadPolicy
from zeroshard.runtime.offload.store import DiskStore, HostStore, make_store

__all__ = ["DiskStore", "HostStore", "OffloadPolicy", "make_store"]

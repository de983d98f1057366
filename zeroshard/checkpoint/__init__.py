"""Verified sharded checkpoints: complete training state, atomic, checksummed, loadable at any world
size and stage, and exportable offline. See docs/checkpoints.md."""

from zeroshard.checkpoint.async_save import PendingSave
from zeroshard.checkpoint.discover import Choice, choose, complete_checkpoints
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.export import ExportStats, export, reshard
from zeroshard.checkpoint.load import Loaded, load
from zeroshard.checkpoint.repair import repair
from zeroshard.checkpoint.save import save
from zeroshard.checkpoint.verify import problems, resolve, verify

__all__ = [
    "CheckpointError", "Choice", "ExportStats", "Loaded", "PendingSave", "choose", "complete_checkpoints", "export",
    "load", "problems", "repair", "reshard", "resolve", "save", "verify",
]

"""Pretrained Hugging Face folders in and out: load a ``save_pretrained`` folder straight into
shards (zeroshard/checkpoint/hf/pretrained.py) and write one back (zeroshard/checkpoint/hf/export.py)."""

from zeroshard.checkpoint.hf.errors import PretrainedError
from zeroshard.checkpoint.hf.export import export_checkpoint, export_pretrained
from zeroshard.checkpoint.hf.pretrained import build_pretrained, is_pretrained_folder, load_pretrained

__all__ = ["PretrainedError", "build_pretrained", "export_checkpoint", "export_pretrained", "is_pretrained_folder",
           "load_pretrained"]

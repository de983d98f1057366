"""torch.distributed.checkpoint (DCP) in and out: move a run between FSDP2 and zeroshard.

``import_dcp`` turns a DCP directory (as FSDP2 users write it with ``dcp.save``) into a zeroshard
checkpoint that ``zs.load`` reads at any world size and stage; ``export_dcp`` does the reverse, for
``dcp.load`` into an FSDP2 model. Both run offline, in one process, with no process group, and use
DCP's own reader and writer (``dcp.load``/``dcp.save`` with ``no_dist=True``). docs/pretrained.md
says what moves and what does not.
"""

from zeroshard.checkpoint.dcp.exporter import ExportedDCP, export_dcp
from zeroshard.checkpoint.dcp.importer import ImportedDCP, import_dcp
from zeroshard.checkpoint.dcp.layout import DCPLayout, read_layout

__all__ = ["DCPLayout", "ExportedDCP", "ImportedDCP", "export_dcp", "import_dcp", "read_layout"]

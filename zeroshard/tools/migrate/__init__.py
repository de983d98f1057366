"""Convert other frameworks' run configs into a zeroshard TrainConfig TOML."""

from zeroshard.tools.migrate.decisions import Conversion, Decision, UnsupportedKey
from zeroshard.tools.migrate.deepspeed import from_deepspeed

__all__ = ["Conversion", "Decision", "UnsupportedKey", "from_deepspeed"]

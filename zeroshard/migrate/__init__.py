"""Convert other frameworks' run configs into a zeroshard TrainConfig TOML."""

from zeroshard.migrate.decisions import Conversion, Decision, UnsupportedKey
from zeroshard.migrate.deepspeed import from_deepspeed

__all__ = ["Conversion", "Decision", "UnsupportedKey", "from_deepspeed"]

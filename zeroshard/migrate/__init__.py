"""Convert other frameworks' run configs into a zeroshard TrainConfig TOML."""

from zeroshard.migrate.deepspeed import Conversion, UnsupportedKey, from_deepspeed

__all__ = ["Conversion", "UnsupportedKey", "from_deepspeed"]

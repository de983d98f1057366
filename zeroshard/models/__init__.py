"""Reference models used by tests, benchmarks and the CLI."""

from zeroshard.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]

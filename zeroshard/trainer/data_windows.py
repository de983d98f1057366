"""What every training dataset shares: sample ``i`` is a pure function of ``i`` (any index in
``[-n, n)``, wrapped), and a window of ``T + 1`` tokens is cut into inputs and next-token targets.
Natural text also shares its answer to the loss floor: unknown."""

from __future__ import annotations

import torch


def check_index(i: int, n: int, what: str = "samples") -> int:
    """``i`` wrapped into ``[0, n)``, or IndexError naming the dataset's size."""
    if not -n <= i < n:
        raise IndexError(f"sample index {i} out of range for a dataset of {n} {what}")
    return i % n


def next_token_pair(window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(T+1,)`` window as inputs and the targets one token ahead, each ``(T,)``."""
    return window[:-1], window[1:]


class NaturalText:
    """Mixin of text datasets: ``vocab_size`` from ``_vocab``; no known entropy floor."""

    _vocab: int

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def entropy_floor(self) -> None:
        return None  # unknown for natural text

"""Which tokens of a sequence a cp rank holds, and at which global positions.

Ring attention's causal work is triangular: with the sequence cut in ``cp`` contiguous pieces the
last rank's queries see every key and the first rank's only its own. So ring cuts the sequence in
``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` (torchtitan's and
Megatron's load-balanced layout): every rank then attends ``2 * cp + 1`` chunk pairs. Ulysses
gathers the whole sequence (for a slice of the heads) before attending, so its rank ``r`` holds the
plain contiguous piece ``r``: the all-to-all then lands the tokens in their global order.

Every rank's tokens keep their global positions (``positions``): the position embedding and the
rotary angles, and the causal and sliding-window masks, are functions of them.
"""

from __future__ import annotations

import torch

CP_SCHEMES = ("ring", "ulysses")
"""The attention schemes context parallelism runs (``--cp-attention``)."""


def pieces(scheme: str, cp: int) -> int:
    """How many equal pieces a sequence is cut into."""
    return 2 * cp if scheme == "ring" else cp


def check_seq(seq: int, *, cp: int, scheme: str) -> None:
    """One line naming the problem and the fix when ``seq`` tokens do not cut into the scheme's pieces."""
    n = pieces(scheme, cp)
    if seq % n:
        why = f"2 x cp = {n} load-balanced causal chunks" if scheme == "ring" else f"cp = {n} pieces"
        raise ValueError(f"sequence length {seq} does not divide into {why} ({scheme} attention); pick a seq_len that "
                         f"is a multiple of {n}")


def chunk_ids(scheme: str, cp: int, rank: int) -> tuple[int, ...]:
    """The global indices of the pieces rank ``rank`` holds, in the order it holds them."""
    return (rank, 2 * cp - 1 - rank) if scheme == "ring" else (rank,)


def positions(seq: int, *, cp: int, rank: int, scheme: str, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s ``seq // cp`` tokens of a ``seq``-token sequence."""
    check_seq(seq, cp=cp, scheme=scheme)
    size = seq // pieces(scheme, cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunk_ids(scheme, cp, rank)])


def split(t: torch.Tensor, *, cp: int, rank: int, scheme: str, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``t`` (whole sequences along ``dim``), contiguous."""
    seq = t.shape[dim]
    check_seq(seq, cp=cp, scheme=scheme)
    parts = t.chunk(pieces(scheme, cp), dim=dim)
    return torch.cat([parts[c] for c in chunk_ids(scheme, cp, rank)], dim=dim).contiguous()

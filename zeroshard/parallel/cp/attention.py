"""Exact causal attention over a sequence split across the cp ranks: ring and Ulysses.

Both take this rank's queries, keys and values, (B, H, t, D) and (B, Hkv, t, D) at the global
``positions`` of its tokens (zeroshard/parallel/cp/layout.py), and return (B, H, t, D): the rows of
full attention over the whole sequence that belong to this rank's queries. A sliding window is a
limit on global positions (``q - k < window``), so it needs nothing else. Backward is autograd's,
through the blockwise computation and the exchanges' own backward (zeroshard/parallel/cp/exchange.py).

[Note: ring merge] Ring attention attends this rank's query chunks to one key/value chunk at a time,
each block giving its softmax-weighted values ``o`` and the log-sum-exp ``lse`` of its scores; two
blocks merge exactly as ``lse = log(e^lse_a + e^lse_b)``, ``o = (o_a e^lse_a + o_b e^lse_b) / e^lse``
(flash attention's online softmax, done per block). Masked scores are a large negative number, not
-inf, so a row a block masks entirely gives weight 0 in the merge and no NaN in backward. Chunks
wholly in a query chunk's future (or outside its window) are skipped: with the load-balanced layout
every rank attends ``2 * cp + 1`` chunk pairs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zeroshard.comm.names import Phase

from zeroshard.parallel.cp.exchange import gather_seq, heads_to_seq, seq_to_heads
from zeroshard.parallel.cp.layout import chunk_ids, pieces

if TYPE_CHECKING:
    from zeroshard.comm.mesh import Mesh

_MASKED = -1e30


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: each of Hkv heads serves heads / Hkv query heads (transformers' repeat_kv)."""
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _allowed(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None,
             documents: torch.Tensor | None = None) -> torch.Tensor:
    """(tq, tk) True where query at qpos may attend key at kpos: causal, within the window if any;
    with ``documents`` (B, seq: each global position's packed document), (B, 1, tq, tk) and only
    inside a query's own document."""
    diff = qpos[:, None] - kpos[None, :]
    ok = diff >= 0
    ok = ok & (diff < window) if window else ok
    if documents is None:
        return ok
    return (ok & (documents[:, qpos, None] == documents[:, None, kpos]))[:, None]


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's (o, lse) in fp32: o (B, H, tq, D), lse (B, H, tq)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, tq, tk)
    s = s.masked_fill(~allowed, _MASKED)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)) * allowed  # a wholly masked row: zeros, and lse ~ -1e30
    return torch.matmul(p, v.float()), lse


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Note: ring merge]; the shift ``m`` cancels, so it is detached."""
    m = torch.maximum(lse_a, lse_b).detach()
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    den = wa + wb
    o = (o_a * wa.unsqueeze(-1) + o_b * wb.unsqueeze(-1)) / den.unsqueeze(-1)
    return o, m + torch.log(den)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Mesh, scale: float | None = None,
                   window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence: its two query chunks against
    every earlier chunk of keys and values, merged by log-sum-exp ([Note: ring merge]).

    Recomputed in backward (as flash attention recomputes its scores): the whole sequence's keys
    and values and the blocks' scores live only while one layer's attention runs, so what a layer
    keeps for backward is this rank's q, k, v and output, 1/cp of the sequence's. Backward then
    gathers the keys and values again (the ledger's recompute phase) before reduce-scattering their
    gradients, the volume a ring's backward passes around too. ``documents`` (B, seq), packed samples'
    document of each global position (every cp rank holds the whole rows'), keeps them apart."""
    calls: list[int] = []

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return _ring(q, k, v, mesh=mesh, scale=scale, window=window, documents=documents,
                     phase=Phase.FORWARD if len(calls) == 1 else Phase.RECOMPUTE)

    if not torch.is_grad_enabled():
        return run(q, k, v)
    return checkpoint(run, q, k, v, use_reentrant=False)


def _ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Mesh, scale: float | None,
          window: int | None, documents: torch.Tensor | None, phase: Phase) -> torch.Tensor:
    cp, rank = mesh.cp_size, mesh.cp_rank
    B, H, t, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    size = t // 2  # one chunk: the sequence is 2 * cp chunks
    keys, values = gather_seq(k, mesh, phase), gather_seq(v, mesh, phase)  # (B, Hkv, cp*t, D): rank j's at [j*t, (j+1)*t)
    where = {c: j * t + i * size for j in range(cp) for i, c in enumerate(chunk_ids("ring", cp, j))}
    outs = []
    for i, ci in enumerate(chunk_ids("ring", cp, rank)):
        qc = q[:, :, i * size:(i + 1) * size]
        qpos = torch.arange(ci * size, (ci + 1) * size, device=q.device)
        o: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for cj in range(pieces("ring", cp)):
            if cj > ci or (window and (ci - cj - 1) * size >= window - 1 and cj < ci):
                continue  # wholly in the future, or wholly outside the window
            kpos = torch.arange(cj * size, (cj + 1) * size, device=q.device)
            at = where[cj]
            kc = _repeat_kv(keys[:, :, at:at + size], H)
            vc = _repeat_kv(values[:, :, at:at + size], H)
            ob, lb = _block(qc, kc, vc, _allowed(qpos, kpos, window, documents), scale)
            o, lse = (ob, lb) if o is None or lse is None else _merge(o, lse, ob, lb)
        outs.append(o)
    return torch.cat(outs, dim=2).to(q.dtype)  # type: ignore[arg-type]


def check_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Ulysses splits the heads over the cp ranks: one line when they do not divide."""
    if heads % cp or kv_heads % cp:
        raise ValueError(f"ulysses attention splits the heads over cp={cp} ranks, but the model has {heads} heads and "
                         f"{kv_heads} kv heads; use a cp that divides both, or --cp-attention ring")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Mesh, scale: float | None = None,
                      window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """All-to-all to the whole sequence for H / cp heads, full causal attention, all-to-all back.
    The tokens are the contiguous pieces in rank order, so the gathered sequence is in global order
    (and ``documents``, packed samples' document of each global position, masks it as it is)."""
    cp = mesh.cp_size
    check_heads(q.shape[1], k.shape[1], cp)
    qh, kh, vh = seq_to_heads(q, mesh), seq_to_heads(k, mesh), seq_to_heads(v, mesh)  # (B, h, T, D)
    kh, vh = _repeat_kv(kh, qh.shape[1]), _repeat_kv(vh, qh.shape[1])
    if window or documents is not None:
        pos = torch.arange(qh.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_allowed(pos, pos, window, documents), scale=scale)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return heads_to_seq(out, mesh)

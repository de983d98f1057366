"""Blockwise int8 quantization for communication (ZeRO++'s qwZ): fewer bytes on the wire.

A flat 1-D tensor is cut into blocks of ``block_size`` elements (the last one zero-padded); each
block is sent as int8 values plus one fp32 scale, ``absmax / 127`` (symmetric, no zero point). So
an element's round-trip error is at most half a step, ``absmax / 127 / 2`` of its block, and the
wire carries ``block_size + 4`` bytes per block instead of ``4 * block_size`` (fp32).

Quantization is applied only to copies in flight: fp32 masters stay exact on their owner.
"""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.comm import collectives
from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.names import Group
from zeroshard.comm.quant_kernel import compiled_quantize, quantize_blocks_into

SPEC_PARTS = ("weights", "grads", "grads+ef")
SPEC_HELP = "'none', 'weights', 'grads', 'grads+ef' or 'weights,grads' / 'weights,grads+ef'"
SCALE_DTYPE = torch.float32
WIRE_DTYPE = torch.int8


def check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0 \
            or block_size & (block_size - 1):
        raise ValueError(f"quantization block_size must be a positive power of two (e.g. 256), got {block_size!r}")
    return block_size


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def wire_bytes(numel: int, block_size: int) -> int:
    """Bytes one quantized copy of ``numel`` elements occupies: int8 payload (padded) plus fp32 scales."""
    blocks = num_blocks(numel, block_size)
    return blocks * block_size * WIRE_DTYPE.itemsize + blocks * SCALE_DTYPE.itemsize


CHUNK_ELEMENTS = 1 << 16
"""Elements quantized per pass: a cache-sized fp32 scratch, reused. One whole-buffer temporary per
call would page-fault in fresh memory every step, which on a CPU that also computes costs more than
the arithmetic."""


def quantize(flat: torch.Tensor, block_size: int, *, out: torch.Tensor | None = None,
             scales_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` (1-D, any float dtype) -> (int8 values padded to whole blocks, one fp32 scale per block).

    Large inputs go through the fused compiled kernel (``quant_kernel``; bitwise the same values),
    the rest and the padded last block through the eager chunked loop."""
    check_block_size(block_size)
    if flat.dim() != 1:
        raise ValueError(f"quantize takes a flat 1-D tensor, got shape {tuple(flat.shape)}")
    numel, blocks = flat.numel(), num_blocks(flat.numel(), block_size)
    out = torch.empty(blocks * block_size, dtype=WIRE_DTYPE, device=flat.device) if out is None else out
    scales_out = torch.empty(blocks, dtype=SCALE_DTYPE, device=flat.device) if scales_out is None else scales_out
    whole = numel // block_size
    # Detached: same memory, but not views of the whole buffers. Otherwise the compiled kernel guards on
    # the sizes of the tensors they view, and the first call's coincidences cost a recompile.
    if not whole or not compiled_quantize(flat[:whole * block_size].view(whole, block_size).detach(),
                                          out[:whole * block_size].view(whole, block_size).detach(),
                                          scales_out[:whole].detach()):
        whole = 0
    if whole < blocks:
        quantize_eager(flat[whole * block_size:], block_size, out[whole * block_size:], scales_out[whole:])
    return out, scales_out


def quantize_eager(flat: torch.Tensor, block_size: int, out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """The eager codec: ``quant_kernel.quantize_blocks_into`` itself (the compiled kernel's ops, so the
    same bits), a cache-sized chunk at a time; a partial last block is padded with zeros."""
    numel, blocks = flat.numel(), num_blocks(flat.numel(), block_size)
    per = max(1, CHUNK_ELEMENTS // block_size)  # blocks per pass
    for first in range(0, blocks, per):
        last = min(blocks, first + per)
        lo, hi = first * block_size, min(last * block_size, numel)
        chunk = flat[lo:hi]
        if hi - lo < (last - first) * block_size:
            chunk = torch.cat([chunk, chunk.new_zeros((last - first) * block_size - (hi - lo))])
        quantize_blocks_into(chunk.reshape(-1, block_size), out[lo:last * block_size].view(-1, block_size),
                             scales_out[first:last])


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, *, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Inverse of ``quantize``: the first ``numel`` values, in ``dtype``."""
    blocks = scales.numel()
    if q.numel() != blocks * (q.numel() // max(blocks, 1)) or q.numel() < numel:
        raise ValueError(f"{q.numel()} quantized values do not split into {blocks} blocks covering {numel}")
    out = torch.empty(numel, dtype=dtype, device=q.device)
    dequantize_into(out, q, scales)
    return out


def dequantize_into(target: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    """``target`` (1-D, contiguous) = the first ``target.numel()`` dequantized values, in its dtype.

    For an fp32 target: convert int8 into it, then scale in place (two passes at memory speed, no
    temporary; a mixed int8 x fp32 multiply takes torch's slow casting path, ~10x slower on CPU).
    Other dtypes go through one fp32 temporary. Same bits either way."""
    block = q.numel() // scales.numel()
    numel = target.numel()
    whole = numel // block
    if whole:
        values, per_block = q[:whole * block].view(whole, block), scales[:whole].unsqueeze(1)
        view = target[:whole * block].view(whole, block)
        if target.dtype == SCALE_DTYPE:
            view.copy_(values).mul_(per_block)
        else:
            view.copy_(values.to(SCALE_DTYPE).mul_(per_block))
    if whole * block < numel:  # a partial last block
        target[whole * block:].copy_(q[whole * block:numel].to(SCALE_DTYPE) * scales[whole])


@dataclasses.dataclass(frozen=True)
class CommQuant:
    """Which communication is sent quantized. ``weights`` is qwZ: stage 3's weight all-gather as int8
    plus per-block scales. Groups under ``min_numel`` elements, and (for weights) the root unit unless
    ``quantize_root``, stay in the compute dtype: their bytes are few and often sensitive
    (embeddings, norms). ``grads`` is qgZ: stages 2-3 reduce grads as int8 pieces through an
    all-to-all and sum them in fp32 on the owner (``QuantizedReduce``)."""

    weights: bool = False
    grads: bool = False
    block_size: int = 256
    min_numel: int = 1 << 14
    quantize_root: bool = False
    error_feedback: bool = False
    """qgZ only: carry each rank's rounding error of its local grad into its next reduction
    (``ErrorFeedback``), at one persistent fp32 value per quantized grad element."""

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        if self.min_numel < 0:
            raise ValueError(f"CommQuant min_numel must be >= 0, got {self.min_numel}")
        if self.error_feedback and not self.grads:
            raise ValueError("CommQuant(error_feedback=True) corrects quantized grads; it needs grads=True "
                             "(comm_quant 'grads+ef')")

    @classmethod
    def parse(cls, spec: str | None, block_size: int = 256) -> CommQuant:
        """'none', 'weights', 'grads', 'grads+ef' (grads with error feedback), or weights with either,
        comma-separated (the CLI/TOML form)."""
        parts = {p.strip() for p in (spec or "none").split(",") if p.strip()} - {"none"}
        if parts - set(SPEC_PARTS) or {"grads", "grads+ef"} <= parts:
            raise ValueError(f"comm_quant={spec!r} is invalid; use {SPEC_HELP}")
        return cls(weights="weights" in parts, grads=bool(parts & {"grads", "grads+ef"}), block_size=block_size,
                   error_feedback="grads+ef" in parts)

    @property
    def enabled(self) -> bool:
        return self.weights or self.grads

    def problem_with(self, policy) -> str | None:
        """Why this setting cannot run under ``policy`` (a ``StagePolicy``), or None when it can.

        Weights are quantized on their way to compute, so only a stage that all-gathers them each
        step has a wire to quantize; grads are quantized into their owner's shard, so only a stage
        whose full grads are transient (reduced once, then freed) can take their rounding."""
        if self.weights and not policy.shard_params:
            return (f"quantized weights (comm=CommQuant(weights=True)) need stage 3, where weights are all-gathered "
                    f"each step; stage {policy.stage} keeps them whole. Use stage=3 or weights=False")
        if self.grads and not policy.transient_grads:
            reduction = "all-reduces" if not policy.shard_optimizer else "keeps full grads"
            return (f"quantized grads need stage 2 or 3, where grads are transient and reduced once into the owner's "
                    f"shard; stage {policy.stage} {reduction}. Use stage>=2 or grads=False")
        return None

    def check_stage(self, policy) -> None:
        """Raise ``problem_with(policy)`` as a ValueError, if there is one."""
        problem = self.problem_with(policy)
        if problem is not None:
            raise ValueError(problem)

    def quantizes_grads(self, numel: int) -> bool:
        """Grads are averaged over ranks, so their rounding error shrinks: only the size threshold applies
        (at stages 0-2 a reduction bucket may hold the root together with blocks)."""
        return self.grads and numel >= self.min_numel

    def quantizes(self, numel: int, is_root: bool) -> bool:
        """Whether a weight group of ``numel`` elements is all-gathered quantized."""
        return self.weights and numel >= self.min_numel and (self.quantize_root or not is_root)


class _WirePair:
    """Two collectives in flight together (int8 values and their fp32 scales), finished as one."""

    _pending: list | None

    @property
    def record(self):
        return self._pending[0].record if self._pending else None

    def is_done(self) -> bool:
        return self._pending is None or all(p is None or p.is_done() for p in self._pending)

    def _wait_wire(self) -> bool:
        """Wait for both; False if they were already finished (``wait`` ran before)."""
        if self._pending is None:
            return False
        for pending in self._pending:
            if pending is not None:
                pending.wait()
        return True


class QuantizedGather(_WirePair):
    """Two all-gathers in flight (int8 values, fp32 scales); ``wait`` dequantizes into ``full``.

    Every rank, the owner included, takes the dequantized values, so all ranks compute with the
    same weights (as an unquantized gather guarantees)."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, *, shards: int, block_size: int,
                 unit: str, phase: str, mesh: Mesh | None = None) -> None:
        self.full, self.shards, self.shard_numel = full, shards, shard.numel()
        blocks = num_blocks(self.shard_numel, block_size)
        self.q = torch.empty(shards * blocks * block_size, dtype=WIRE_DTYPE, device=full.device)
        self.scales = torch.empty(shards * blocks, dtype=SCALE_DTYPE, device=full.device)
        mesh = mesh or get_mesh()
        rank = mesh.shard_rank
        q_own = self.q.view(shards, -1)[rank]
        s_own = self.scales.view(shards, -1)[rank]
        quantize(shard.detach().to(full.device).view(-1), block_size, out=q_own, scales_out=s_own)
        self._pending = [collectives.all_gather(buf, own, group=Group.SHARD, unit=unit, phase=phase, async_op=True,
                                                mesh=mesh)
                         for buf, own in ((self.q, q_own), (self.scales, s_own))]

    def wait(self) -> None:
        if not self._wait_wire():
            return
        q, scales = self.q.view(self.shards, -1), self.scales.view(self.shards, -1)
        target = self.full.view(self.shards, self.shard_numel)
        with torch.no_grad():
            for rank in range(self.shards):
                dequantize_into(target[rank], q[rank], scales[rank])
        # Free the wire buffers now, not when this object goes away.
        self._pending, self.q, self.scales = None, torch.empty(0), torch.empty(0)



class ErrorFeedback:
    """qgZ's error feedback: this rank's rounding error of its local grad, added to its next one.

    Sending ``q(g)`` loses ``e = g - q(g)``; without feedback the losses of successive steps add
    up, and when they are correlated (a grad that changes slowly, small values under a large
    block absmax) they bias the update. With feedback a rank sends ``q(g + e_prev)`` and keeps the
    new error, so the sum over steps of what it sent differs from the sum of its true grads by the
    last error alone. One fp32 value per element of the group's padded flat grad, for the whole
    run; not checkpointed (a resumed run starts from zero error, one step's rounding).
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    @staticmethod
    def bytes_for(numel: int) -> int:
        """Persistent bytes of the residual of a flat grad of ``numel`` elements."""
        return numel * SCALE_DTYPE.itemsize

    def corrected(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` plus the carried error, in fp32, held in the residual buffer itself."""
        flat = grad.detach().reshape(-1)
        if self.residual is None or self.residual.numel() != flat.numel():
            self.residual = flat.to(SCALE_DTYPE, copy=True)
        else:
            self.residual.add_(flat)
        return self.residual

    def keep_error(self, pieces: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        """After ``pieces`` (a view of the residual) were quantized to ``q``/``scales``: keep what was lost."""
        for i in range(pieces.shape[0]):
            pieces[i].sub_(dequantize(q[i], scales[i], pieces.shape[1]))
        # An overflowed grad (fp16 loss scaling skips this step) must not poison later ones: its
        # error is dropped. Decided on the device (a mask, not an ``if``): no host sync per group.
        pieces.masked_fill_(torch.isfinite(scales).all().logical_not(), 0.0)


class QuantizedReduce(_WirePair):
    """qgZ's reduction: the sum over the group of ``input`` (1-D, group size x ``output``), of which this
    rank keeps its slice in ``output`` (fp32 accumulation), with every piece sent as int8 + scales.

    A reduce-scatter cannot add int8 values on the wire, so each rank quantizes the piece every
    other rank owns, an all-to-all delivers them, and ``wait`` dequantizes and sums in fp32 on the
    owner. The error per element is at most the sum over senders of each one's half-step there.
    With ``feedback`` this rank sends its grad plus its previous rounding error (``ErrorFeedback``).
    """

    def __init__(self, output: torch.Tensor, input: torch.Tensor, block_size: int, *, group: str = Group.SHARD,
                 unit: str = "", phase: str = "", feedback: ErrorFeedback | None = None,
                 mesh: Mesh | None = None) -> None:
        size = collectives.group_size(group, mesh)
        self.output, self.per = output, output.numel()
        if input.numel() != self.per * size:
            raise ValueError(f"quantized reduce input has {input.numel()} elements; it must be exactly "
                             f"group size {size} x output's {self.per}")
        blocks = num_blocks(self.per, block_size)
        q_send = torch.empty(size, blocks * block_size, dtype=WIRE_DTYPE, device=input.device)
        s_send = torch.empty(size, blocks, dtype=SCALE_DTYPE, device=input.device)
        pieces = (input.detach() if feedback is None else feedback.corrected(input)).view(size, self.per)
        for owner in range(size):
            quantize(pieces[owner], block_size, out=q_send[owner], scales_out=s_send[owner])
        if feedback is not None:
            feedback.keep_error(pieces, q_send, s_send)
        self.q, self.scales = torch.empty_like(q_send), torch.empty_like(s_send)
        self._sent: tuple[torch.Tensor, ...] = (q_send, s_send)  # gloo reads them asynchronously
        self._pending = [
            collectives.all_to_all(recv.view(-1), sent.view(-1), group=group, unit=unit, phase=phase, async_op=True,
                                   mesh=mesh)
            for recv, sent in ((self.q, q_send), (self.scales, s_send))]

    def wait(self) -> None:
        if not self._wait_wire():
            return
        # Sum in fp32, senders in rank order: the first lands in place, the rest through one scratch.
        total = self.output if self.output.dtype == SCALE_DTYPE and self.output.is_contiguous() \
            else torch.empty(self.per, dtype=SCALE_DTYPE, device=self.output.device)
        with torch.no_grad():
            dequantize_into(total, self.q[0], self.scales[0])
            scratch = torch.empty_like(total) if self.q.shape[0] > 1 else total
            for sender in range(1, self.q.shape[0]):
                dequantize_into(scratch, self.q[sender], self.scales[sender])
                total += scratch
            if total is not self.output:
                self.output.copy_(total)
        self._pending, self._sent = None, ()


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, block_size: int, *, group: str = Group.SHARD,
                             unit: str = "", phase: str = "", feedback: ErrorFeedback | None = None,
                             mesh: Mesh | None = None) -> None:
    """Blocking ``QuantizedReduce``."""
    QuantizedReduce(output, input, block_size, group=group, unit=unit, phase=phase, feedback=feedback,
                    mesh=mesh).wait()

"""torch's ``PipelineStage``, with every send and receive it posts stamped into the ledger.

torch does the transport (``batch_isend_irecv`` on the pp group); zeroshard only observes: each
``P2POp`` a schedule asks the stage for is recorded, when it is built, as a ``send`` or ``recv`` on
group ``pp`` with its bytes, the phase (forward: activations, backward: their grads) and, as the
record's unit, the stage and microbatch (``stage1.mb3``). Byte counts, the doctor and the desync
fingerprint then cover the pipeline's traffic like any collective.

Zero-bubble schedules split each microbatch's backward into an input half (I: grads to the stage's
inputs, sent upstream at once) and a weight half (W, run later to fill the bubble). torch computes
both with ``torch.autograd.grad``, which runs none of the accumulate-grad hooks the engine gathers,
frees and reduces from (the first stage's W is a plain backward and does run them), so the stage
drives its engine around each half: stage 3 gathers the stage's blocks before each half and frees
them after it, and after W the engine takes the grads torch assigned to ``param.grad``.

Each microbatch's forward, backward and weight half is bracketed by ``compute_begin`` /
``compute_end`` events on the stage's engine (zeroshard/runtime/events.py): the profiler's per-stage
compute and bubble come from them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.distributed.pipelining import PipelineStage

from zeroshard.comm import collectives
from zeroshard.comm.names import Group, Phase
from zeroshard.runtime import get_engine
from zeroshard.runtime.events import EventKind


class LedgeredStage(PipelineStage):
    """A ``PipelineStage`` over ``mesh``'s pp group whose sends and receives reach ``mesh.ledger``."""

    def __init__(self, submodule, stage_index: int, num_stages: int, *, mesh, input_args, output_args) -> None:
        super().__init__(submodule, stage_index, num_stages, mesh.device, input_args=input_args,
                         output_args=output_args, group=mesh.group(Group.PP))
        self._zs_mesh = mesh

    @contextlib.contextmanager
    def _computing(self, phase: str, chunk: int) -> Iterator[None]:
        events = get_engine(self.submod).events
        unit = f"stage{self.stage_index}.mb{chunk}"
        events.emit(EventKind.COMPUTE_BEGIN, unit, phase, 0)
        yield
        events.emit(EventKind.COMPUTE_END, unit, phase, 0)

    def _record(self, ops, op: str, phase: Phase, chunk: int):
        for p2p in ops:
            t = p2p.tensor
            collectives.record_observed(op, numel=t.numel(), dtype=t.dtype, elem_size=t.element_size(), group=Group.PP,
                                        unit=f"stage{self.stage_index}.mb{chunk}", phase=phase, mesh=self._zs_mesh)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._record(super().get_fwd_send_ops(fwd_chunk_id), "send", Phase.FORWARD, fwd_chunk_id)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        return self._record(super().get_fwd_recv_ops(fwd_chunk_id), "recv", Phase.FORWARD, fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._record(super().get_bwd_send_ops(bwd_chunk_id), "send", Phase.BACKWARD, bwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        return self._record(super().get_bwd_recv_ops(bwd_chunk_id), "recv", Phase.BACKWARD, bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        with self._computing("forward", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        split = not full_backward and not self.is_first  # the first stage's I is empty: its W is the whole backward
        with self._computing("backward", bwd_chunk_id):
            if split:
                get_engine(self.submod).gather_for_split_backward()
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if split:
                get_engine(self.submod).input_backward_done()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        engine = get_engine(self.submod)
        with self._computing("backward_weight", bwd_chunk_id):
            if not self.is_first:
                engine.gather_for_split_backward()
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            engine.take_assigned_grads()

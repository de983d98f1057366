"""The only module that calls ``torch.distributed`` collectives.

Every call is stamped into the rank's :class:`~zeroshard.comm.ledger.Ledger` with the unit and
phase it served, so byte counts, profiles and desync reports all come from one place. Groups are
named by their role on the mesh ("world", "shard", "replicate", "tp", and "dp" = replicate × shard)
rather than passed as handles, so the ledger can say which one a collective ran on.

Every call takes the ``mesh`` whose group it runs on, and is recorded in that mesh's ledger. An
engine passes its own mesh; ``mesh=None`` means the default one that ``zs.init`` built, for the
training loop's and the tools' collectives.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zeroshard.comm.ledger import CollectiveRecord, Ledger, process_ledger
from zeroshard.comm.mesh import Mesh, get_mesh
from zeroshard.comm.names import Group, Phase

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class DeviceContractError(RuntimeError):
    """A collective was given a tensor that is not on its group's device (NCCL refuses CPU tensors,
    gloo's fan-out runs on the host): raised before anything is issued, naming the op and phase."""


def _check_devices(op: str, phase: str | Phase, group: str | Group, mesh: Mesh, *tensors: torch.Tensor) -> None:
    """Every tensor a collective is given must be on its group's device (``mesh.device``): the one
    place the device contract is kept, so a host tensor reaching an NCCL group fails here, by name,
    on any backend (the fake-GPU tests' included) instead of deep inside NCCL on a GPU host."""
    want = mesh.device
    for t in tensors:
        have = t.device
        if have.type != want.type or (have.index is not None and want.index is not None and have.index != want.index):
            raise DeviceContractError(
                f"{op} in phase {str(phase) or '(none)'!r} got a tensor on {have}, but group {str(group)!r} of mesh "
                f"{mesh.name!r} ({mesh.backend}) runs on {want}: move it there first (tensor.to(mesh.device))")


def get_ledger() -> Ledger:
    return process_ledger()


def _mesh(mesh: Mesh | None) -> Mesh:
    return get_mesh() if mesh is None else mesh


class Pending:
    """An issued collective; ``wait()`` blocks until it is done and closes its ledger record."""

    __slots__ = ("_work", "record", "_after", "_ledger")

    def __init__(self, work, record: CollectiveRecord, ledger: Ledger, after=None) -> None:
        self._work = work
        self.record = record
        self._ledger = ledger
        self._after = after

    def is_done(self) -> bool:
        """True once the collective finished (never blocks)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            # How long the training thread is blocked here is the collective's *exposed* time (the
            # profiler's overlap ratio); the watchdog reads wait_start to tell a hang from a prefetch.
            self.record.wait_start = started = time.perf_counter()
            clock = self._ledger.clock  # on an accelerator the wait returns at once: the device times it
            if clock is not None:
                clock.before_wait(self.record)
            self._work.wait()
            if clock is not None:
                clock.after_wait(self.record)
            self.record.waited += time.perf_counter() - started
            self._work = None
            if self._after is not None:
                self._after()
        self._ledger.wait_returned(self.record)


def group_size(name: str | Group, mesh: Mesh | None = None) -> int:
    return _mesh(mesh).group_size(name)


def record_observed(op: str, *, numel: int, dtype: torch.dtype, elem_size: int, group: str, unit: str = "",
                    phase: str = "", mesh: Mesh | None = None) -> None:
    """Stamp a collective that torch issued itself (DTensor's tensor-parallel all-reduces, seen by
    zeroshard/comm/dtensor_ledger.py) into the ledger, so byte counts cover every dim."""
    m = _mesh(mesh)
    record = m.ledger.open(group=group, op=op, numel=numel, dtype=dtype, elem_size=elem_size, unit=unit, phase=phase,
                           mesh=m.ledger_name)
    m.ledger.started(record)
    m.ledger.complete(record)


def _issue(op: str, full: torch.Tensor, group: str | Group, unit: str, phase: str | Phase, call, async_op: bool,
           mesh: Mesh, after=None, uneven: bool = False):
    ledger = mesh.ledger
    record = ledger.open(group=group, op=op, numel=full.numel(), dtype=full.dtype, elem_size=full.element_size(),
                         unit=unit, phase=phase, mesh=mesh.ledger_name, uneven=uneven)
    device_async = mesh.backend == "nccl"
    if device_async and ledger.clock is not None:
        ledger.clock.issued(record)
    work = call(mesh.group(group))
    ledger.started(record, work, device_async=device_async)
    pending = Pending(work, record, ledger, after)
    if async_op:
        return pending
    pending.wait()
    return None


def all_reduce(tensor: torch.Tensor, *, op: str = "sum", group: str | Group = Group.WORLD, unit: str = "",
               phase: str | Phase = "", async_op: bool = False, mesh: Mesh | None = None) -> Pending | None:
    """In-place all-reduce. ``op="avg"`` is sum followed by a division, which every backend supports."""
    m = _mesh(mesh)
    _check_devices("all_reduce", phase, group, m, tensor)
    size = m.group_size(group)
    reduce_op = _REDUCE_OPS["sum" if op == "avg" else op]
    after = (lambda: tensor.div_(size)) if op == "avg" else None
    if size == 1:
        call = lambda pg: None  # noqa: E731  (the tensor already is the result)
    else:
        call = lambda pg: dist.all_reduce(tensor, op=reduce_op, group=pg, async_op=True)  # noqa: E731
    if not async_op:
        _issue("all_reduce", tensor, group, unit, phase, call, False, m)
        if after is not None:
            after()
        return None
    return _issue("all_reduce", tensor, group, unit, phase, call, True, m, after)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group: str | Group = Group.WORLD, unit: str = "",
                   phase: str | Phase = "", async_op: bool = False, mesh: Mesh | None = None) -> Pending | None:
    """Sum-reduce ``input`` across the group; this rank keeps its contiguous 1/size slice in ``output``.

    ``input`` is scratch: its contents are undefined afterwards (on gloo the slices other ranks own
    end up holding partial sums).
    """
    m = _mesh(mesh)
    _check_devices("reduce_scatter", phase, group, m, output, input)
    size = m.group_size(group)
    if input.numel() != output.numel() * size:
        raise ValueError(f"reduce_scatter input has {input.numel()} elements; it must be exactly group size "
                         f"{size} x output's {output.numel()}")
    if size == 1:
        return _issue("reduce_scatter", input, group, unit, phase, _local_copy(output, input), async_op, m)
    if _fans_out(size, m):
        return _issue("reduce_scatter", input, group, unit, phase, _fan_out_reduce(output, input, size), async_op, m)
    call = lambda pg: _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=pg, async_op=True)  # noqa: E731
    return _issue("reduce_scatter", input, group, unit, phase, call, async_op, m)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: str | Group = Group.WORLD, unit: str = "",
               phase: str | Phase = "", async_op: bool = False, mesh: Mesh | None = None) -> Pending | None:
    """Gather every rank's ``input`` into ``output`` in rank order; ``input`` may be a view of ``output``."""
    m = _mesh(mesh)
    _check_devices("all_gather", phase, group, m, output, input)
    size = m.group_size(group)
    if output.numel() != input.numel() * size:
        raise ValueError(f"all_gather output has {output.numel()} elements; it must be exactly group size "
                         f"{size} x input's {input.numel()}")
    if size == 1:
        return _issue("all_gather", output, group, unit, phase, _local_copy(output, input), async_op, m)
    if _fans_out(size, m):
        return _issue("all_gather", output, group, unit, phase, _fan_out_gather(output, input, size), async_op, m)
    call = lambda pg: _all_gather_single(output, input, group=pg, async_op=True)  # noqa: E731
    return _issue("all_gather", output, group, unit, phase, call, async_op, m)


def all_to_all(output: torch.Tensor, input: torch.Tensor, *, group: str | Group = Group.WORLD, unit: str = "",
               phase: str | Phase = "", async_op: bool = False, mesh: Mesh | None = None,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> Pending | None:
    """Slice ``i`` of ``input`` goes to group rank ``i``; slice ``j`` of ``output`` comes from rank ``j``.
    Equal 1-D slices unless ``input_splits`` / ``output_splits`` give the rows (dim 0) sent to and
    received from each rank: the uneven exchange of expert parallelism's token dispatch. Quantized
    reductions need the even one: int8 pieces cannot be summed on the wire. The ledger counts the
    input, the bytes this rank sends (its own slice included)."""
    m = _mesh(mesh)
    _check_devices("all_to_all", phase, group, m, output, input)
    size = m.group_size(group)
    if input_splits is not None or output_splits is not None:
        if input_splits is None or output_splits is None or len(input_splits) != size or \
                len(output_splits) != size or sum(input_splits) != input.shape[0] or \
                sum(output_splits) != output.shape[0]:
            raise ValueError(f"all_to_all splits {input_splits} -> {output_splits} must give one row count per rank of "
                             f"the {size}-rank group and sum to the input's {input.shape[0]} and output's "
                             f"{output.shape[0]} rows")
        # uneven: each rank sends its own rows, so the ledger's numel differs across ranks by design.
        if size == 1:
            return _issue("all_to_all", input, group, unit, phase, _local_copy(output, input), async_op, m,
                          uneven=True)
        call = lambda pg: dist.all_to_all_single(output, input, output_split_sizes=output_splits,  # noqa: E731
                                                 input_split_sizes=input_splits, group=pg, async_op=True)
        return _issue("all_to_all", input, group, unit, phase, call, async_op, m, uneven=True)
    if input.numel() != output.numel() or input.numel() % size:
        raise ValueError(f"all_to_all input ({input.numel()}) and output ({output.numel()}) must have the same "
                         f"number of elements, a multiple of group size {size}")
    if size == 1:
        return _issue("all_to_all", input, group, unit, phase, _local_copy(output, input), async_op, m)
    call = lambda pg: dist.all_to_all_single(output, input, group=pg, async_op=True)  # noqa: E731
    return _issue("all_to_all", input, group, unit, phase, call, async_op, m)


def _local_copy(output: torch.Tensor, input: torch.Tensor):
    """A one-rank group: the result is the input, so skip the transport (it would copy, and gloo's
    reduce-scatter would run on this thread)."""
    def call(pg) -> None:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    return call


# -- gloo: reduce-scatter and all-gather as one rooted collective per slice ---------------------
# gloo's own reduce-scatter runs on the caller's thread inside wait(), so it never overlaps
# compute, and both it and gloo's all-gather copy through staging buffers. One async reduce (or
# broadcast) per slice moves the same bytes per rank, runs on gloo's worker threads, and on this
# project's 2-core machine measured 1.5-2x (reduce) and 2-4x (broadcast) faster for 12-100 MB
# buffers at world 2 and 4 (docs/runtime.md, [Note: gloo fan-out]). NCCL keeps its native kernels.

def reduce_scatter_lands_in_input(group: str | Group, mesh: Mesh | None = None) -> bool:
    """True when a reduce-scatter leaves this rank's result in its own slice of the input anyway
    (gloo's per-slice reduce, a one-rank group): callers may then pass that slice as the output
    and skip allocating a second buffer while the collective runs."""
    m = _mesh(mesh)
    size = m.group_size(group)
    return size == 1 or _fans_out(size, m)


def reduce_to_owners(pieces: list[tuple[torch.Tensor, int]], *, numel: int, group: str | Group = Group.WORLD,
                     unit: str = "", phase: str | Phase = "", async_op: bool = False,
                     mesh: Mesh | None = None) -> Pending | None:
    """A reduce-scatter whose input comes in pieces instead of one flat buffer (per-param grads,
    so no flat copy of them is made): piece ``(tensor, owner)`` is summed in place onto group rank
    ``owner``; on other ranks it is scratch afterwards. Every rank passes the same pieces in the
    same order. ``numel`` is the logical input extent, for the ledger. Only where
    ``reduce_scatter_lands_in_input`` (gloo, or a one-rank group, where there is nothing to do).
    """
    m = _mesh(mesh)
    _check_devices("reduce_scatter", phase, group, m, *(t for t, _ in pieces))
    if not reduce_scatter_lands_in_input(group, m):
        raise RuntimeError("reduce_to_owners needs gloo or a one-rank group; use reduce_scatter with a flat input")
    dtype = pieces[0][0].dtype if pieces else torch.float32
    record = m.ledger.open(group=group, op="reduce_scatter", numel=numel, dtype=dtype,
                           elem_size=dtype.itemsize, unit=unit, phase=phase,
                           mesh=m.ledger_name)
    work = None
    if m.group_size(group) > 1:
        pg = m.group(group)
        work = _Works([dist.reduce(t, dst=dist.get_global_rank(pg, owner), op=dist.ReduceOp.SUM, group=pg,
                                   async_op=True) for t, owner in pieces])
    m.ledger.started(record, work, device_async=False)
    pending = Pending(work, record, m.ledger)
    if async_op:
        return pending
    pending.wait()
    return None


def _fans_out(size: int, mesh: Mesh) -> bool:
    return size > 1 and mesh.backend == "gloo"


class _Works:
    """Several async works that complete together: the interface ``Pending`` and the ledger use."""

    def __init__(self, works: list, on_done=None) -> None:
        self._works = works
        self._on_done = on_done

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        return True

    def get_future(self):
        return torch.futures.collect_all([w.get_future() for w in self._works])


def _fan_out_reduce(output: torch.Tensor, input: torch.Tensor, size: int):
    def call(pg) -> _Works:
        slices = input.chunk(size)
        works = [dist.reduce(piece, dst=dist.get_global_rank(pg, owner), op=dist.ReduceOp.SUM, group=pg,
                             async_op=True) for owner, piece in enumerate(slices)]
        mine = slices[dist.get_rank(pg)]
        return _Works(works, on_done=lambda: output.copy_(mine) if output.data_ptr() != mine.data_ptr() else None)
    return call


def _fan_out_gather(output: torch.Tensor, input: torch.Tensor, size: int):
    def call(pg) -> _Works:
        slices = output.chunk(size)
        mine = slices[dist.get_rank(pg)]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        return _Works([dist.broadcast(piece, src=dist.get_global_rank(pg, owner), group=pg, async_op=True)
                       for owner, piece in enumerate(slices)])
    return call


def broadcast(tensor: torch.Tensor, *, src: int = 0, group: str | Group = Group.WORLD, unit: str = "",
              phase: str | Phase = "", mesh: Mesh | None = None) -> None:
    """``src`` is a rank of ``group`` (the same as the global rank for "world")."""
    _check_devices("broadcast", phase, group, _mesh(mesh), tensor)
    call = lambda pg: dist.broadcast(tensor, src=dist.get_global_rank(pg, src), group=pg, async_op=True)  # noqa: E731
    _issue("broadcast", tensor, group, unit, phase, call, False, _mesh(mesh))


def barrier(*, group: str | Group = Group.WORLD, phase: str | Phase = "", mesh: Mesh | None = None) -> None:
    m = _mesh(mesh)
    marker = torch.zeros(1, device=m.device)
    # A one-element all-reduce doubles as a barrier and, unlike dist.barrier, is recorded the same
    # way on every backend.
    all_reduce(marker, group=group, phase=phase or Phase.BARRIER, mesh=m)


def all_gather_object(obj, *, group: str | Group = Group.WORLD, phase: str | Phase = "",
                      mesh: Mesh | None = None) -> list:
    """Gather a picklable Python object from every rank (small metadata only)."""
    m = _mesh(mesh)
    size = m.group_size(group)
    out: list = [None] * size
    marker = torch.zeros(1)
    record = m.ledger.open(group=group, op="all_gather_object", numel=size, dtype=marker.dtype,
                           elem_size=0, unit="", phase=phase, mesh=m.ledger_name)
    m.ledger.started(record)
    record.wait_start = time.perf_counter()  # blocking: the thread waits from the start
    dist.all_gather_object(out, obj, group=m.group(group))
    record.waited = time.perf_counter() - record.wait_start
    m.ledger.complete(record)
    return out


USER_PHASE = Phase.USER
"""Phase of a collective that code outside zeroshard issued through torch.distributed (zeroshard.observing)."""


def external(op: str, tensor: torch.Tensor | None, group: str, call, *, async_op: bool):
    """Record a torch.distributed call that code outside zeroshard made, then make it (``call()``).

    ``zeroshard.observing`` routes the user's own collectives here while it is active, so the ledger
    holds the process group's whole sequence and the doctor can name a collective only some ranks
    ran. A blocking call is waited on from the start (the watchdog sees a hang in it); an async one
    is closed by its work's completion callback when the backend has one. They go to the process
    ledger: the user's groups belong to no mesh of ours.
    """
    ledger = process_ledger()
    numel = 0 if tensor is None else tensor.numel()
    dtype = "object" if tensor is None else tensor.dtype
    elem = 0 if tensor is None else tensor.element_size()
    record = ledger.open(group=group, op=op, numel=numel, dtype=dtype, elem_size=elem, unit="", phase=USER_PHASE)
    if async_op:
        work = call()
        ledger.started(record, work)
        return work
    ledger.started(record)
    record.wait_start = started = time.perf_counter()
    result = call()  # on an exception the record stays open: the dump shows it in flight
    record.waited = time.perf_counter() - started
    ledger.complete(record)
    return result

"""Replica groups that survive the loss of one of them, on torchft (its Manager, lighthouse and
fault-tolerant process group): no transport or consensus protocol of ours.

Each replica group is its own torch.distributed world (its own torchrun job): zeroshard shards over
the group's ranks as usual. The replicate dim runs outside that world, through torchft: rank r of
every group joins a fault-tolerant gloo group of the ranks at shard position r. Each step:

- ``start_step`` joins the lighthouse's quorum of the live groups (synchronously). A group that is
  behind (a replacement just started) receives the live state of the same shard position of a healthy
  group over torchft's checkpoint transport, through the ``state_dict`` / ``load_state_dict``
  callbacks, before its step starts. It reads no checkpoint.
- ``average_`` averages tensors over the groups taking part this step (torchft's all-reduce; a
  failed peer makes it a no-op and the step is not committed). Each call is recorded in the ledger
  with group ``replicate``.
- ``commit`` asks every live group whether all of them finished the step's communication. Only
  then is the update applied.

So when a group dies, the others go on: their quorum shrinks, and the data-parallel size with it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

import torch

from zeroshard.comm import collectives
from zeroshard.comm.names import Group

REPLICA_ENV = "REPLICA_GROUP_ID"
"""Which replica group this torchrun job is (torchft's own convention)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def replica_index() -> int:
    """This job's replica group (``REPLICA_GROUP_ID``), or a one-line error when it is not set."""
    value = os.environ.get(REPLICA_ENV)
    if value is None or not value.isdigit():
        raise ValueError(f"replica_recovery runs one torchrun job per replica group: set {REPLICA_ENV}=0, 1, ... "
                         f"for each, and {LIGHTHOUSE_ENV} to the lighthouse's address (torchft_lighthouse)")
    if LIGHTHOUSE_ENV not in os.environ:
        raise ValueError(f"replica_recovery needs {LIGHTHOUSE_ENV}: the address of a running torchft lighthouse")
    return int(value)


class Replicas:
    """This rank's membership in the replica groups (one torchft Manager per rank)."""

    def __init__(self, *, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], rank: int,
                 world: int, timeout_s: float = 30.0) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.replica = replica_index()
        timeout = timedelta(seconds=timeout_s)
        host, port = self._fresh_store(rank)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, state_dict=state_dict,
            load_state_dict=load_state_dict, use_async_quorum=False, replica_id=f"replica{self.replica}",
            rank=rank, world_size=world, store_addr=host, store_port=port, timeout=timeout, quorum_timeout=timeout,
            init_sync=False)  # every group builds the same weights from the same seed

    def _fresh_store(self, rank: int) -> tuple[str, int]:
        """A store of this attempt's own for the Manager's keys. torchrun's store outlives a restart,
        and a restarted rank could read the address the killed attempt's Manager wrote there."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
        port = self._store.port if self._store is not None else None
        return host, int(collectives.all_gather_object(port, phase="init")[0])

    def start_step(self) -> None:
        """Join this step's quorum; a group behind the others takes the live state first."""
        self.manager.start_quorum()

    def average_(self, tensors: list[torch.Tensor], *, phase: str) -> None:
        """Average each tensor over the groups taking part this step, in place."""
        works = []
        for t in tensors:
            collectives.record_observed("all_reduce", numel=t.numel(), dtype=t.dtype, elem_size=t.element_size(),
                                        group=Group.REPLICATE.value, phase=phase)
            works.append(self.manager.allreduce(t))
        for work in works:
            work.wait()

    def commit(self) -> bool:
        """Whether every live group finished this step's communication: apply the update only then."""
        return bool(self.manager.should_commit())

    @property
    def participants(self) -> int:
        return int(self.manager.num_participants())

    @property
    def step(self) -> int:
        """Steps committed by the quorum (torchft's count; the same on every live group)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

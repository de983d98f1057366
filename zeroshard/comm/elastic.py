"""Joining a torchrun world that may be a restart (``torchrun --max-restarts N``).

[Note: stale store keys after an elastic restart]
torchrun shares its agent's TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``), and
both the c10d (``--standalone``) and the static rendezvous keep that store, on the same port, for
the whole job. torch's ``env://`` init uses it with no per-attempt prefix, so after a restart the
store still holds the dead attempt's gloo addresses under the same keys (``default_pg/0/...``). A
restarted rank that reads them before its peer has overwritten them connects to a dead port and
fails with "Gloo connectFullMesh failed ... Connection refused": the restart then fails too, and
how often depends on which rank imports faster (here, 3 of 5 restarts of the e2e elastic test
failed that way; 6 of 6 passed with the prefix). torch up to 2.3 prefixed the store with
``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``; we restore that prefix.

Limit: the prefix assumes every node counts restarts alike, which holds when a failure fails every
node's workers (they share collectives). A node whose workers are restarted for a membership change
(not counted as a restart) would wait on the others' prefix until the process-group timeout.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def torchrun_agent_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The agent's store under a prefix unique to this restart attempt, or None when this process
    is not a torchrun worker sharing the agent's store (plain ``env://`` is fine then)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"zeroshard/attempt_{attempt}", store)


def init_process_group_from_env(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` from RANK / WORLD_SIZE / MASTER_*, safe across torchrun restarts."""
    store = torchrun_agent_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)

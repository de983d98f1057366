"""``--desync-check K``: every K steps, prove that all ranks issued the same collectives so far.

Each rank's ledger keeps a running CRC-32 of every collective's (op, numel, dtype, group, unit,
phase), in order. One all-gather of five int64 per rank compares (count, hash) across ranks. Unit
and phase are in the hash, not only op/numel/dtype/group: at stage 3 identical blocks have
identically shaped all-gathers, so a rank running its blocks in another order pairs them silently
and only the unit names tell.

Only when the hashes differ does anything else happen: the ranks gather their recent fingerprints
(a failure path, so the extra collective is fine), run the doctor's analysis on them, dump their
ledgers and raise `DesyncError` with the doctor's one-line finding. Under pp the stages issue
different calls by design (their own blocks' gathers, sends where the next stage receives), so the
hashes are compared among the ranks of one pp stage only (the row carries the rank's pp rank); the
doctor pairs the stages' sends and receives. Every rank sees the same
gathered hashes, so every rank takes the failure path together and nothing hangs.
"""

from __future__ import annotations

import torch

from zeroshard.comm import collectives
from zeroshard.observing.doctor import analyse
from zeroshard.comm.gather_rows import gather_rows
from zeroshard.comm.mesh import get_mesh

PHASE = "desync"
_MAGIC = 0x5A53  # "ZS": a stray pairing with another collective is visibly not ours
COMPARED = 2048
"""Recent records each rank sends when the hashes differ (the divergence is usually recent)."""


class DesyncError(RuntimeError):
    """Ranks issued different collectives; the message is the doctor's finding."""

    def __init__(self, message: str, report: dict) -> None:
        super().__init__(message)
        self.report = report


def check(step: int) -> int:
    """Collective: compare every rank's collective history; raise `DesyncError` if they differ.
    Returns the bytes the check moved (so a run can keep them out of its training traffic)."""
    ledger = collectives.get_ledger()
    mesh_world = collectives.group_size("world")
    # Snapshot before issuing: the check's own all-gather is not part of what it compares.
    rows, moved = gather_rows([_MAGIC, step, ledger.next_seq, ledger.hash, get_mesh().pp_rank], dtype=torch.int64,
                              group="world", phase=PHASE)
    first_of_stage = {row[4]: row for row in reversed(rows)}  # each pp rank's first row
    if all(row[2:4] == first_of_stage[row[4]][2:4] for row in rows):
        return moved
    report = compare_recent(mesh_world)
    raise DesyncError(f"desync check at step {step}: {report['summary']}", report)


def compare_recent(world: int) -> dict:
    """Gather every rank's newest fingerprints and analyse them as the doctor would."""
    ledger = collectives.get_ledger()
    records = [r.to_json() for r in ledger.snapshot()[-COMPARED:]]
    header = {"rank": get_mesh().rank, "world": world, "reason": "desync", "next_seq": ledger.next_seq,
              "in_flight": []}
    gathered = collectives.all_gather_object((header, records), phase=PHASE)
    return analyse({h["rank"]: (h, recs) for h, recs in gathered}, world)

"""The doctor under pp: which pipeline stage and microbatch a rank stopped at.

Under pp the ranks of different stages issue different calls by design (stage 0 sends activations
that stage 1 receives, each stage gathers its own blocks), so comparing every rank's k-th call with
every other's would flag a healthy run. Instead:

- ranks are grouped by the stages they hold, read from their own ledgers: every send and receive a
  stage posts is recorded with unit ``stage<s>.mb<j>`` (zeroshard/parallel/pipeline/stage.py), ``s`` being
  the posting stage. The ranks of one group must issue the same calls, compared seq by seq as
  without pp (zeroshard/observing/doctor.py);
- across groups, each send must have its receive: a forward send of stage ``s``, microbatch ``j``,
  is received by stage ``s + 1`` as its forward recv of ``j``, a backward send by stage ``s - 1``.
  The i-th rank of one group talks to the i-th rank of the next (pp is the outermost mesh dim);
- each rank's last send or receive says where in the schedule it stopped (stage, microbatch, phase).

Records are posted, not completed, when the ledger stamps them: "never sent" means the peer never
posted the send, so the receive it pairs with could not complete.
"""

from __future__ import annotations

import re
from typing import Any

P2P_OPS = frozenset({"send", "recv"})
PP_GROUP = "pp"  # zeroshard.comm.names.Group.PP (not imported: the doctor needs no torch)
_UNIT = re.compile(r"stage(\d+)\.mb(\d+)$")


def p2p_of(record: dict) -> tuple[int, int] | None:
    """(stage, microbatch) of a pipeline send or receive; None for any other record."""
    if record.get("group") != PP_GROUP or record.get("op") not in P2P_OPS:
        return None
    m = _UNIT.match(record.get("unit") or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def stage_groups(records_by_rank: dict[int, list[dict]]) -> dict[tuple[int, ...], list[int]] | None:
    """Ranks keyed by the stages their sends and receives name; None when no rank posted any (no pp).
    A rank that stopped before its first send or receive is a group of its own (key ())."""
    stages = {r: tuple(sorted({p[0] for rec in recs if (p := p2p_of(rec)) is not None}))
              for r, recs in records_by_rank.items()}
    if not any(stages.values()):
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(stages):
        groups.setdefault(stages[r], []).append(r)
    return groups


def _key(record: dict) -> tuple:
    stage, mb = p2p_of(record) or (-1, -1)
    return record.get("step"), record.get("phase"), record["op"], stage, mb


def _peer_stage(op: str, phase: str, stage: int) -> int:
    """The stage at the other end: forward flows to the next stage, backward to the previous one."""
    downstream = (op == "send") == (phase == "forward")
    return stage + 1 if downstream else stage - 1


def analyse_pp(records_by_rank: dict[int, list[dict]], groups: dict[tuple[int, ...], list[int]]) -> dict[str, Any]:
    """Each rank's stages and last send/receive, and the first send or receive without its partner."""
    holder = {s: key for key in groups for s in key}
    stopped: dict[int, dict | None] = {}
    posted: dict[int, set[tuple]] = {}
    for r, recs in records_by_rank.items():
        p2p = [rec for rec in recs if p2p_of(rec) is not None]
        stopped[r] = _where_p2p(p2p[-1]) if p2p else None
        posted[r] = {_key(rec) for rec in p2p}
    # Steps every rank still holds in full (a ledger keeps a bounded window of records).
    first_step = max((min((rec.get("step") or 0 for rec in recs), default=0) for recs in records_by_rank.values()),
                     default=0)
    unmatched = None
    for r, recs in sorted(records_by_rank.items()):
        mine = next((k for k, ranks in groups.items() if r in ranks), ())
        for rec in recs:
            p = p2p_of(rec)
            if p is None or (rec.get("step") or 0) <= first_step:
                continue
            stage, mb = p
            peer_stage = _peer_stage(rec["op"], rec.get("phase") or "", stage)
            peer_key = holder.get(peer_stage)
            if peer_key is None:
                continue
            peer = groups[peer_key][groups[mine].index(r)] if len(groups[peer_key]) == len(groups[mine]) else None
            if peer is None:
                continue
            other_op = "recv" if rec["op"] == "send" else "send"
            if (rec.get("step"), rec.get("phase"), other_op, peer_stage, mb) in posted[peer]:
                continue
            found = {"rank": r, **_where_p2p(rec), "peer": peer, "peer_stage": peer_stage}
            if unmatched is None or (found["step"], rec["seq"]) < (unmatched["step"], unmatched["seq"]):
                unmatched = {**found, "seq": rec["seq"]}
            break
    return {"stages": {r: list(k) for k, ranks in groups.items() for r in ranks}, "stopped": stopped,
            "unmatched": unmatched}


def _where_p2p(record: dict) -> dict:
    stage, mb = p2p_of(record) or (-1, -1)
    return {"op": record["op"], "stage": stage, "mb": mb, "phase": record.get("phase") or "-",
            "step": record.get("step"), "seq": record["seq"]}


def stage_text(rank: int, pp: dict) -> str:
    """"rank 2 (pp stage 1)": a rank named with the stages it holds."""
    stages = pp["stages"].get(rank) or []
    if not stages:
        return f"rank {rank} (no pp stage: it posted no send or receive)"
    return f"rank {rank} (pp stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"


def stopped_text(rank: int, pp: dict) -> str:
    """Where ``rank`` stopped in the schedule: its last send or receive."""
    last = pp["stopped"].get(rank)
    if last is None:
        return f"{stage_text(rank, pp)} stopped before its first send or receive"
    return (f"{stage_text(rank, pp)} stopped at mb {last['mb']} of {last['phase']} (step {last['step']}): its last "
            f"{'send to' if last['op'] == 'send' else 'receive from'} stage "
            f"{_peer_stage(last['op'], last['phase'], last['stage'])}")


def unmatched_text(pp: dict) -> str:
    u = pp["unmatched"]
    who, peer = stage_text(u["rank"], pp), stage_text(u["peer"], pp)
    if u["op"] == "recv":
        return (f"{who} posted its receive of mb {u['mb']} of {u['phase']} (step {u['step']}) from stage "
                f"{u['peer_stage']}, which never came: {peer} never sent it")
    return (f"{who} sent mb {u['mb']} of {u['phase']} (step {u['step']}) to stage {u['peer_stage']}, but {peer} "
            f"never posted its receive")

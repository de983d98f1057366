"""Workers for tests/distributed/test_plan_ep.py: one world of 4 measures the planned memory
(`plan --measure`'s workers) and trains tiny-moe for a few steps at each ep, recording the ledger's
ep all-to-all bytes and the routing counts behind them, and at (shard 2 x tp 2, ep 2) every
collective of the ledger by (op, group, phase). Module level so spawned ranks import it."""

from __future__ import annotations

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.parallel.experts import ep_forwards
from zeroshard.models import GPT, GPTConfig
from zeroshard.tools.planner.measure import measure_many_worker

SEED, VOCAB, SEQ, STEPS = 1234, 64, 16, 2
ROUTED = GPTConfig.named("tiny-moe", n_layer=2, vocab_size=VOCAB, seq_len=SEQ)


TP = 2
"""The tp degree of the ep-with-tp run (world 4 = shard 2 x tp 2)."""


def routed_config(ep: int, tp: int = 1) -> TrainConfig:
    return TrainConfig(model="tiny-moe", stage=3, nproc=4, ep=ep, tp=tp, batch=8, accum=2, seq_len=SEQ,
                       vocab_size=VOCAB, lr=1e-3, warmup=0, seed=SEED, num_samples=64, profile=False)


def ledger_key(record, experts) -> tuple[str, str, str]:
    """(op, group, phase) of a ledger record, an expert mesh's shard group named ``edp`` as the plan names it."""
    group = "edp" if record.mesh == experts.ledger_name and record.group == "shard" else record.group
    return record.op, group, record.phase


def routed_run(ep: int, mesh, tp: int = 1) -> dict:
    """``STEPS`` steps of tiny-moe at stage 3 on ``mesh``: per step this rank's ledger bytes of the ep
    all-to-alls, the rows it received at each MoE layer call (its routing counts), and the bytes of
    every collective by ``ledger_key``."""
    import torch

    cfg = routed_config(ep, tp)
    torch.manual_seed(SEED)
    run = step.build(cfg, mesh, model=GPT(ROUTED).train(),
                     dataset=build_dataset(seq_len=SEQ, num_samples=cfg.num_samples, vocab_size=VOCAB, seed=SEED))
    forwards = ep_forwards(run.model)
    ledger, experts = zs.ledger(), mesh.experts
    out: dict[str, list] = {"ledger_bytes": [], "received": [], "sent": [], "by_key": []}
    for _ in range(STEPS):
        marks = {name: len(f.received_rows) for name, f in forwards.items()}
        start = ledger.next_seq
        step.step(run, *collate(run.dataset, run.sampler.next_indices()))
        out["ledger_bytes"].append(sum(r.bytes for r in ledger.since(start) if r.op == "all_to_all"
                                       and r.group == "ep" and r.mesh == experts.ledger_name))
        out["received"].append([n for name, f in forwards.items() for n in f.received_rows[marks[name]:]])
        out["sent"].append([n for name, f in forwards.items() for n in f.sent_rows[marks[name]:]])
        by_key: dict[tuple[str, str, str], int] = {}
        # Every record of the step (nothing else runs meanwhile): DTensor's tp all-reduces are
        # stamped with the first mesh whose tp group matches, which may be another mesh's here.
        for r in ledger.since(start):
            key = ledger_key(r, experts)
            by_key[key] = by_key.get(key, 0) + r.bytes
        out["by_key"].append(by_key)
    return out


def suite(requests: list[dict], eps: tuple[int, ...]) -> dict:
    measured = measure_many_worker(requests)  # builds the world's default mesh
    routed = {ep: routed_run(ep, zs.new_mesh(ep=ep, name=f"routed-ep{ep}")) for ep in eps}
    with_tp = routed_run(2, zs.new_mesh(tp=TP, ep=2, name="routed-tp2ep2"), tp=TP)
    return {"measured": measured, "routed": routed, "with_tp": with_tp}

"""Workers for tests/distributed/test_schedule.py: the step schedule against the ledger, op by op.

One spawned world runs every config of its size: each builds tiny fresh (zeroshard.trainer.step.build, as
`zeroshard train` does), trains two steps and compares each step's slice of the ledger with
``engine_schedule`` (the first step with ``first_step=True``, the second with the steady state),
and its frees with the engine's FREE events. Only mismatches and per-(op, group) byte totals go
back to the parent, which checks the planner against those totals.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import EventKind, get_engine
from zeroshard.runtime.precision import parse_dtype
from zeroshard.runtime.schedule import engine_schedule
from zeroshard.runtime.schedule_events import TensorParallelSizes

SEED = 1234
SEQ = 16
BATCH = 8
SMALL_BUCKET_MB = 0.25
"""tiny's blocks are ~200 KB and its root ~80 KB of fp32: buckets of [b3, b2], [b1, b0], [root]."""


@dataclasses.dataclass(frozen=True)
class Config:
    stage: int
    accum: int = 1
    accumulation: str = "sharded"
    reshard_after_forward: bool = True
    prefetch: int = 1
    checkpointing: str = "none"
    offload: str = "none"
    comm_quant: str = "none"
    bucket_mb: float = 25.0
    clip: float = 1.0
    mp: str = "fp32"

    @property
    def name(self) -> str:
        parts = [f"s{self.stage}", f"accum{self.accum}" + (f"-{self.accumulation}" if self.accum > 1 else "")]
        if self.stage == 3:
            parts += [f"reshard={'T' if self.reshard_after_forward else 'F'}", f"prefetch{self.prefetch}"]
        else:
            parts.append(f"bucket{self.bucket_mb:g}")
        parts += [f"ckpt={self.checkpointing}", f"offload={self.offload}", f"quant={self.comm_quant}",
                  f"clip={'T' if self.clip else 'F'}"]
        if self.mp != "fp32":
            parts.append(self.mp)
        return " ".join(parts)


ACCUMS = ((1, "sharded"), (2, "sharded"), (2, "unsharded"))


CLIPS = (1.0, 0.0)


def dims(stage: int) -> list[tuple]:
    """The matrix's dims at ``stage``, where valid: reshard_after_forward, prefetch, (accum,
    accumulation), checkpointing, offload, comm_quant, bucket_mb and clip."""
    return [(True, False) if stage == 3 else (True,), (0, 1, 2) if stage == 3 else (1,), ACCUMS, ("none", "all"),
            ("none", "cpu"), ("none",) + (("grads",) if stage >= 2 else ()) + (("weights",) if stage == 3 else ()),
            (25.0,) if stage == 3 else (25.0, SMALL_BUCKET_MB), CLIPS]


def pairwise(values: list[tuple]) -> list[tuple]:
    """Rows of the product of ``values`` such that every pair of values of two dims is in one of
    them (greedy: each row the candidate that covers most pairs still missing; deterministic)."""
    missing = {(i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2)
               for a in values[i] for b in values[j]}
    candidates = list(itertools.product(*values))
    rows = []

    def pairs(row: tuple) -> set:
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}

    while missing:
        best = max(candidates, key=lambda row: len(pairs(row) & missing))
        rows.append(best)
        missing -= pairs(best)
    return rows


MODES = ("full", "pairwise", "each")


def rows(values: list[tuple], mode: str) -> list[tuple]:
    """``full``: the whole product (clipping alternating, not crossed); ``pairwise``: every pair of
    values together at least once; ``each``: every value at least once."""
    if mode == "full":
        return [(*row, CLIPS[i % 2]) for i, row in enumerate(itertools.product(*values[:-1]))]
    if mode == "pairwise":
        return pairwise(values)
    if mode == "each":
        return [tuple(v[i % len(v)] for v in values) for i in range(max(len(v) for v in values))]
    raise ValueError(f"matrix mode must be one of {MODES}, got {mode!r}")


def matrix(mode: str) -> list[Config]:
    """The configs of every stage, the dims combined as ``mode`` says (``rows``)."""
    out: list[Config] = []
    for stage in (0, 1, 2, 3):
        for reshard, prefetch, (accum, accumulation), ckpt, offload, quant, bucket, clip in rows(dims(stage), mode):
            out.append(Config(stage=stage, accum=accum, accumulation=accumulation, reshard_after_forward=reshard,
                              prefetch=prefetch, checkpointing=ckpt, offload=offload, comm_quant=quant,
                              bucket_mb=bucket, clip=clip))
    return out


EXTRAS = [
    Config(stage=3, mp="bf16", comm_quant="weights"),
    Config(stage=1, mp="bf16", bucket_mb=SMALL_BUCKET_MB, clip=0.0),
    Config(stage=2, mp="bf16", accum=2, comm_quant="grads"),
    Config(stage=3, checkpointing="every:3", prefetch=1),
    Config(stage=3, checkpointing="sqrt", prefetch=0, accum=2),
    Config(stage=3, checkpointing="every:2", prefetch=2, comm_quant="weights", clip=0.0),
]
"""Beyond the matrix: bf16 compute (2-byte gathers, fp32 reductions) and segments longer than one unit."""


def build(cfg: Config):
    model_cfg = GPTConfig.named("tiny", seq_len=SEQ)
    data = build_dataset(seq_len=SEQ, num_samples=64, seed=SEED)
    mesh = zs.get_mesh()
    train_cfg = TrainConfig(stage=cfg.stage, nproc=mesh.world, tp=mesh.tp_size, batch=BATCH, seq_len=SEQ, lr=1e-3, min_lr=1e-3,
                            warmup=0, clip=cfg.clip, seed=SEED, accum=cfg.accum, accumulation=cfg.accumulation,
                            reshard_after_forward=cfg.reshard_after_forward, prefetch=cfg.prefetch,
                            checkpointing=cfg.checkpointing, offload=cfg.offload, bucket_mb=cfg.bucket_mb, mp=cfg.mp,
                            comm_quant=cfg.comm_quant)
    torch.manual_seed(SEED)
    # The CLI's CommQuant: tiny's blocks (50K elements) and its root (21K) are over its threshold,
    # so both reduce quantized; the root's weights stay exact (it is not weight-quantized by default).
    return step.build(train_cfg, zs.get_mesh(), model=GPT(model_cfg), dataset=data)


def _first_difference(want: list, got: list) -> dict | None:
    for i, (a, b) in enumerate(itertools.zip_longest(want, got)):
        if a != b:
            return {"at": i, "schedule": want[max(0, i - 2):i + 3], "ledger": got[max(0, i - 2):i + 3],
                    "lengths": (len(want), len(got))}
    return None


def tp_sizes(cfg: Config, mesh) -> TensorParallelSizes | None:
    """The blocks' tp all-reduces: a micro-batch of this rank's sequences x tiny's width, in the compute dtype."""
    if mesh.tp_size == 1:
        return None
    gpt = GPTConfig.named("tiny", seq_len=SEQ)
    rows = BATCH // (mesh.world // mesh.tp_size * cfg.accum)
    return TensorParallelSizes(numel=rows * SEQ * gpt.n_embd, dtype=parse_dtype(cfg.mp), blocks=gpt.n_layer)


def _by_group(items: list, tp: bool) -> list:
    """The tensor-parallel group's part of a sequence (``tp``), or the rest: each is compared in order."""
    return [item for item in items if (item[1] == "tp") == tp]


def run_config(cfg: Config) -> dict:
    run = build(cfg)
    engine = get_engine(run.model)
    ledger = zs.ledger()
    out: dict = {"name": cfg.name, "config": dataclasses.asdict(cfg), "steps": []}
    for index in (1, 2):
        frees: list = []
        x, y = collate(run.dataset, run.sampler.next_indices())
        start = ledger.next_seq
        with engine.events.subscribed(lambda e: frees.append((e.unit, e.phase, e.bytes)), kinds=[EventKind.FREE]):
            step.step(run, x, y)
        # The step's metrics and the non-finite guard's own checks are not the engine's schedule.
        records = [r for r in ledger.since(start) if r.phase not in (step.METRICS_PHASE, "guard")]
        schedule = engine_schedule(engine, accum=cfg.accum, first_step=index == 1, clip=cfg.clip > 0,
                                   tp=tp_sizes(cfg, run.mesh))
        want = [(*e.key, e.bytes) for e in schedule.collectives]
        got = [(r.op, r.group, r.unit, r.phase, r.numel, r.dtype, r.bytes) for r in records]
        # At stages 0-2 the schedule orders the tp group's all-reduces among themselves only, so
        # with tp each group's sequence is compared on its own (at stage 3 the whole one, too).
        diff = _first_difference(want, got) if run.mesh.tp_size == 1 or cfg.stage == 3 else None
        diff = diff or _first_difference(_by_group(want, False), _by_group(got, False)) \
            or _first_difference(_by_group(want, True), _by_group(got, True))
        by: dict[str, int] = {}
        for r in records:
            if r.phase != "clip":  # the planner plans the engine's traffic, not the step's clipping
                by[f"{r.op}:{r.group}"] = by.get(f"{r.op}:{r.group}", 0) + r.bytes
        out["steps"].append({
            "collectives": len(got), "frees": len(frees),
            "diff": diff,
            "free_diff": _first_difference([(e.unit, e.phase, e.bytes) for e in schedule.frees], frees),
            "bytes_by": by,
        })
    return out


def schedule_suite(mode: str, extras: bool, shard_size: int | None = None, tp: int = 1) -> dict:
    """Every config of ``matrix(mode)`` (and ``EXTRAS``) on this world; returns per config the
    differences (None when the ledger and the schedule agree) and each step's bytes per (op, group)."""
    mesh = zs.init(shard_size=shard_size, tp=tp)
    started = time.perf_counter()
    results = [run_config(cfg) for cfg in matrix(mode) + (EXTRAS if extras else [])]
    return {"mesh": mesh.describe(), "results": results, "seconds": time.perf_counter() - started}

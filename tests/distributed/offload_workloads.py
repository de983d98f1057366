"""Workers for offload tests: parity, file lifecycle and resident memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime.offload import DiskStore, OffloadPolicy

from workloads import GLOBAL_BATCH, LR, SEED, sharded_run, tiny_setup


def _policy(kind: str, directory: str):
    return None if kind == "none" else OffloadPolicy(kind=kind, directory=directory if kind == "disk" else None,
                                                     slice_mb=0.25)


def parity_suite(directory: str) -> dict:
    zs.init()
    out = {"files_seen": 0}
    for stage in (0, 1, 2, 3):
        for kind in ("none", "cpu", "disk"):
            out[(stage, kind)] = sharded_run(stage, 4, GLOBAL_BATCH, offload=_policy(kind, directory))
            if kind == "disk":
                # Hold a disk-offloaded model while looking, so its store is certainly alive.
                cfg, _ = tiny_setup(GLOBAL_BATCH)
                held = zs.shard(GPT(cfg), stage=stage, offload=_policy(kind, directory))
                out["files_seen"] += sum(len(list(p.iterdir())) for p in Path(directory).iterdir())
                del held
    return out


def crash_with_files(directory: str) -> None:
    """Leave a store directory behind the way a killed process would."""
    store = DiskStore(torch.device("cpu"), directory, rank=0)
    store.allocate("master", 1024, torch.float32).fill_(7.0)
    os._exit(0)


def resident_after_steps(kind: str, directory: str, width: int = 1024, layers: int = 4) -> dict:
    """Anonymous and file-backed resident memory after three steps, with masters/state offloaded or not."""
    mesh = zs.init()
    cfg = GPTConfig.named("tiny", n_embd=width, n_head=8, n_layer=layers, seq_len=32)
    torch.manual_seed(SEED)
    model = zs.shard(GPT(cfg), stage=3, offload=_policy(kind, directory))
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    for _ in range(3):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    # Both runs hand freed heap back to the OS first, so the comparison is of live memory only.
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = lambda key: int(status[key].split()[0]) * 1024  # noqa: E731
    engine = zs.runtime.get_engine(model)
    offloaded = sum(g.shard.numel() * 4 * 3 for g in engine.trainable_groups)  # master + Adam's two moments
    return {"anon": kib("RssAnon"), "file": kib("RssFile"), "offloaded_bytes": offloaded, "world": mesh.world}

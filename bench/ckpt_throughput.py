"""Checkpoint save/load throughput (MB/s, 1 MB = 10^6 bytes) for the `medium` GPT, plus export memory.

    .venv/bin/python bench/ckpt_throughput.py                  # worlds 1 and 2, stage 3
    .venv/bin/python bench/ckpt_throughput.py --world 4 --stage 0 --dir /mnt/fast

Each world is a fresh gloo spawn. A rank builds the model, takes one optimizer step (so AdamW's
moments exist and are saved), then times:

- save: from a barrier to the commit (every rank's file written, hashed and fsynced, manifest
  written, directory renamed);
- load (cold): after evicting the files from the page cache (posix_fadvise DONTNEED), so reads
  come from the disk; includes the sha256 verification of every file read;
- load (warm): the same again with the files cached.

Throughput is checkpoint bytes (all ranks' files) over wall time. Afterwards the checkpoint is
exported to one safetensors file in this process, and the rise of its peak RSS is printed next
to the model size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.comm import collectives
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.step import one_step


def _evict(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(model_name: str, stage: int, path: str) -> dict:
    mesh = zs.init()
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named(model_name)), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-4)
    idx = torch.randint(0, model.cfg.vocab_size, (1, 8))
    one_step(model, opt, idx, idx)  # a short sequence: we only need the optimizer state to exist
    collectives.barrier(phase="bench")
    t0 = time.perf_counter()
    zs.save(path, model, opt, step=1)
    save_s = time.perf_counter() - t0
    timings = {"save_s": save_s}
    for kind in ("cold", "warm"):
        if kind == "cold" and mesh.rank == 0:
            _evict(Path(path))
        collectives.barrier(phase="bench")
        t0 = time.perf_counter()
        zs.load(path, model, opt)
        collectives.barrier(phase="bench")
        timings[f"load_{kind}_s"] = time.perf_counter() - t0
    return timings


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="zs-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg = GPTConfig.named(args.model)
    with torch.device("meta"):
        numel = GPT(cfg).num_params()
    print(f"{args.model}: {numel / 1e6:.1f}M params ({numel * 4 / 1e6:,.0f} MB fp32), AdamW, stage {args.stage}, "
          f"dir {root}")
    last = None
    for world in args.world:
        path = root / f"world{world}"
        shutil.rmtree(path, ignore_errors=True)
        t = spawn(worker, world, args=(args.model, args.stage, str(path)), timeout_s=1800)
        size = sum(f.stat().st_size for f in path.iterdir())
        worst = {k: max(r[k] for r in t) for k in t[0]}
        print(f"world {world}: checkpoint {size / 1e6:,.0f} MB in {world} rank files | "
              f"save {size / 1e6 / worst['save_s']:,.0f} MB/s ({worst['save_s']:.2f} s) | "
              f"load cold {size / 1e6 / worst['load_cold_s']:,.0f} MB/s ({worst['load_cold_s']:.2f} s) | "
              f"load warm {size / 1e6 / worst['load_warm_s']:,.0f} MB/s ({worst['load_warm_s']:.2f} s)")
        last = path
    from zeroshard.checkpoint import export

    out = root / "export.safetensors"
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark: measure the export alone
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    stats = export(last, out, overwrite=True)
    elapsed = time.perf_counter() - t0
    rise = (_status_kib("VmHWM") - before) / 1024
    print(f"export: {stats.bytes / 1e6:,.0f} MB in {elapsed:.2f} s ({stats.bytes / 1e6 / elapsed:,.0f} MB/s); peak RSS "
          f"rise {rise:,.1f} MiB vs model {numel * 4 / 2**20:,.0f} MiB (largest param "
          f"{stats.largest_param_bytes / 2**20:.1f} MiB)")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()

"""The training stall per checkpoint save, synchronous against asynchronous (``async_=True``).

    .venv/bin/python bench/async_save.py                       # small, world 2, stage 3, a save every 5 steps
    .venv/bin/python bench/async_save.py --saves 30 --dir /mnt/fast

One gloo spawn trains ``small`` (AdamW) and saves every ``--every`` steps, alternating the two
kinds save by save, so both see the same machine at the same time (interleaved: on a shared
machine only the ratio of one run means anything). Per save, on the slowest rank:

- stall: the time the training thread spends inside ``zs.save`` (sync: write, hash, commit;
  async: wait for the previous save, prepare, copy to host memory);
- interference: how much longer the ``--every`` steps after the save took than the same steps
  after a synchronous save (where nothing runs in the background), from the medians;
- cost per save: stall + interference, what the save costs training in all.

It also prints the async save's host buffer on each rank against the planner's
``Plan.checkpoint_host_bytes`` for the same model, world and optimizer, and each rank's peak RSS.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.checkpoint import async_save
from zeroshard.comm import collectives
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.step import one_step
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(model_name: str, stage: int, saves: int, every: int, batch: int, seq: int, root: str) -> dict:
    mesh = zs.init()
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named(model_name, seq_len=seq)), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-4)
    g = torch.Generator().manual_seed(mesh.rank)
    x = torch.randint(0, model.cfg.vocab_size, (batch // mesh.world, seq), generator=g)

    def timed_steps(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            one_step(model, opt, x, x)
        return time.perf_counter() - t0

    timed_steps(2)  # warm-up: allocator, optimizer state
    rows = []
    for i in range(2 * saves):
        kind = "sync" if i % 2 == 0 else "async"
        collectives.barrier(phase="bench")
        t0 = time.perf_counter()
        zs.save(Path(root) / f"step-{i:06d}", model, opt, step=i, keep_last=2, async_=kind == "async",
                log=lambda line: None)
        stall = time.perf_counter() - t0
        rows.append({"kind": kind, "stall": stall, "after": timed_steps(every)})
    last = async_save.in_flight()
    if last is not None:
        last.wait()
    collectives.barrier(phase="bench")
    per_rank = collectives.all_gather_object({"rows": rows, "host_buffer": async_save.SNAPSHOT.nbytes,
                                              "peak_rss_mib": _peak_rss_mib()})
    return {"per_rank": per_rank} if mesh.rank == 0 else {}


def main() -> None:
    args = bench_parser(__doc__, model="small", world=2, stage=3, saves=(20, "saves of each kind (default 20)"),
                        every=(5, "steps between saves (default 5)"), batch=(8, "global batch in sequences"), seq=64,
                        dir=(None, "where to write the checkpoints (default: a temporary directory)")).parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        out = spawn(worker, args.world, args=(args.model, args.stage, args.saves, args.every, args.batch, args.seq,
                                              root), timeout_s=3600)[0]
    per_rank = out["per_rank"]
    # The slowest rank decides each save (the others wait for it in the next collective).
    rows = [{k: (max(r["rows"][i][k] for r in per_rank) if k != "kind" else per_rank[0]["rows"][i][k])
             for k in ("kind", "stall", "after")} for i in range(len(per_rank[0]["rows"]))]

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["kind"] == kind)

    quiet = median("sync", "after")  # the steps after a sync save: nothing in the background
    print(f"{args.model}, world {args.world}, stage {args.stage}, batch {args.batch}x{args.seq}, a save every "
          f"{args.every} steps, {args.saves} saves of each kind, interleaved")
    print(f"{'':6} {'stall (median)':>15} {'interference':>13} {'cost per save':>14}")
    cost = {}
    for kind in ("sync", "async"):
        stall, interference = median(kind, "stall"), median(kind, "after") - quiet
        cost[kind] = stall + interference
        print(f"{kind:6} {stall * 1e3:12.1f} ms {interference * 1e3:10.1f} ms {cost[kind] * 1e3:11.1f} ms")
    print(f"stall ratio sync/async {median('sync', 'stall') / median('async', 'stall'):.1f}x; "
          f"cost ratio {cost['sync'] / cost['async']:.1f}x; {args.every} steps take {quiet * 1e3:.0f} ms")
    planned = zs.plan(GPTConfig.named(args.model, seq_len=args.seq), world=args.world, stage=args.stage,
                      device="cpu").checkpoint_host_bytes
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: async host buffer {r['host_buffer'] / 2**20:.2f} MiB (planner "
              f"{planned / 2**20:.2f} MiB), peak RSS {r['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()

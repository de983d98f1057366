"""Step time of Muon + AdamW (per-tensor owners) against AdamW alone at stage 3, and against torch DDP
running the same Muon + AdamW, interleaved in one gloo world so machine noise falls on every arm alike.

    .venv/bin/python bench/owner_optim.py --model small --nproc 2 --stage 3 --rounds 5 --steps 4

Arms, each built once and timed in turns (round-robin, ``--rounds`` times ``--steps`` steps):
  zs-adamw       zs.optimizer(AdamW): the flat path
  zs-muon+adamw  zs.muon_groups: Muon on the hidden matrices stepped whole on owners, AdamW on the rest
  ddp-muon+adamw torch.nn.parallel.DistributedDataParallel with torch.optim.Muon + AdamW (every rank
                 steps every matrix)
Prints the median step time of each arm, the owner exchange's bytes per step (ledger phase
owner_exchange) and each rank's optimizer-state bytes.
"""

from __future__ import annotations

import statistics
import time

import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.step import Each, one_step, plain_step
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def _zs_arm(cfg: GPTConfig, stage: int, muon: bool):
    torch.manual_seed(0)
    model = zs.shard(GPT(cfg), stage=stage)
    if muon:
        groups = zs.muon_groups(model, muon={"lr": 0.02})
        opt = zs.optimizer(model, torch.optim.AdamW, param_groups=groups, lr=3e-4, weight_decay=0.1)
    else:
        opt = zs.optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)

    def step(x, y):
        one_step(model, opt, x, y)  # no clipping, as in the DDP arm's plain step
    return step, opt


def _ddp_arm(cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg)
    groups = zs.muon_groups(model, muon={"lr": 0.02})
    params = dict(model.named_parameters())
    muon = torch.optim.Muon([params[n] for n in groups[0]["params"]], lr=0.02)
    adamw = torch.optim.AdamW([{"params": [params[n] for n in g["params"]], **{k: v for k, v in g.items()
                                                                               if k != "params"}}
                               for g in groups[1:]], lr=3e-4, weight_decay=0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    both = Each([muon, adamw])

    def step(x, y):
        plain_step(ddp, both, x, y)
    return step, (muon, adamw)


def _state_bytes(*optimizers) -> int:
    return sum(v.numel() * v.element_size() for opt in optimizers for s in opt.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


def worker(model_name: str, stage: int, rounds: int, steps: int, batch: int, seq: int) -> dict:
    mesh = zs.init()
    cfg = GPTConfig.named(model_name, seq_len=seq)
    arms = {"zs-adamw": _zs_arm(cfg, stage, muon=False), "zs-muon+adamw": _zs_arm(cfg, stage, muon=True),
            "ddp-muon+adamw": _ddp_arm(cfg)}
    gen = torch.Generator().manual_seed(mesh.rank)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    times: dict[str, list[float]] = {name: [] for name in arms}
    ledger = zs.ledger()
    exchange = 0
    for name, (step, _) in arms.items():  # warm-up: the first step builds state and records orders
        step(x, x)
    for _ in range(rounds):
        for name, (step, _) in arms.items():
            start_seq = ledger.next_seq
            for _ in range(steps):
                t = time.perf_counter()
                step(x, x)
                times[name].append(time.perf_counter() - t)
            if name == "zs-muon+adamw":
                exchange = sum(r.bytes for r in ledger.since(start_seq) if r.phase == "owner_exchange") // steps
    states = {name: _state_bytes(*(opt if isinstance(opt, tuple) else (opt,))) for name, (_, opt) in arms.items()}
    return {"median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()}, "exchange_bytes": exchange,
            "state_bytes": states}


def main() -> None:
    args = bench_parser(__doc__, model="small", nproc=2, stage=3, rounds=5, steps=4, batch=(4, "sequences per rank"),
                        seq=256).parse_args()
    ranks = spawn(worker, args.nproc, args=(args.model, args.stage, args.rounds, args.steps, args.batch, args.seq),
                  timeout_s=3600)
    print(f"{args.model}, world {args.nproc}, zs stage {args.stage}, {args.rounds} rounds x {args.steps} steps, "
          f"batch {args.batch} x {args.seq} per rank")
    for name in ranks[0]["median_ms"]:
        worst = max(r["median_ms"][name] for r in ranks)
        states = [r["state_bytes"][name] / 2**20 for r in ranks]
        print(f"  {name:>15}: median step {worst:8.1f} ms (slowest rank)   optimizer state per rank "
              + " ".join(f"{s:7.1f}" for s in states) + " MiB")
    print("  owner exchange per step (bytes, per rank): " + " ".join(str(r["exchange_bytes"]) for r in ranks))


if __name__ == "__main__":
    main()

"""What `zs.observe` costs a user's own training loop: the same loop with the observer on and off.

    .venv/bin/python bench/observe_overhead.py                       # small, stage 3, world 2
    .venv/bin/python bench/observe_overhead.py --batch 4 --seq-len 128 --steps 3 --rounds 2 --log tensorboard

Two gloo ranks run a plain library loop (forward, backward, clip, AdamW step) on the `small` GPT.
Rounds alternate off/on (on/off in odd rounds, so drift and warm-up hit both alike); "on" enters
`zs.observe` (watchdog, ledger ring, user-collective wrappers, step profiler, metrics.jsonl, and the
loggers given) around its steps. The first step of each round is left out (the observer's start-up
and the first step's lazy work are paid once per run, not per step). Printed: the median and the
faster-half mean step time off and on, and their ratio; on a shared CPU the off steps' spread is
printed too, as the noise floor. The time spent inside `obs.step` itself (profile, metrics line,
loggers) is printed as a direct figure that the machine's noise does not blur.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.trainer.launch import spawn
from zeroshard.models.gpt import GPT, GPTConfig
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path

VOCAB = 256


def batch(step: int, rank: int, world: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g).chunk(world)[rank]
    return tokens[:, :-1], tokens[:, 1:]


def loop_steps(model, opt, obs, first: int, steps: int, rows: int, seq: int,
               inside: list[float] | None = None) -> list[float]:
    """`steps` optimizer steps of the user's loop; each one's wall time, `obs.step` included (its own
    time also goes to `inside`)."""
    mesh = zs.get_mesh()
    times = []
    for step in range(first, first + steps):
        t0 = time.perf_counter()
        x, y = batch(step, mesh.rank, mesh.world, rows, seq)
        loss = model(x, y)
        loss.backward()
        norm = zs.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        if obs is not None:
            t1 = time.perf_counter()
            obs.step(loss=loss, tokens=rows * seq, grad_norm=norm, lr=opt.param_groups[0]["lr"])
            if inside is not None:
                inside.append(time.perf_counter() - t1)
        times.append(time.perf_counter() - t0)
    return times


def worker(model_name: str, stage: int, rows: int, seq: int, steps: int, rounds: int, log: str) -> dict:
    zs.init()
    torch.manual_seed(0)
    model = GPT(GPTConfig.named(model_name, vocab_size=VOCAB, seq_len=seq))
    zs.shard(model, stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-4)
    loop_steps(model, opt, None, 0, 1, rows, seq)  # warm-up: optimizer state, the recorded unit order
    times: dict[str, list[float]] = {"off": [], "on": [], "inside": []}
    first = 1
    with tempfile.TemporaryDirectory() as tmp:
        shared = zs.comm.collectives.all_gather_object(tmp)[0]
        for index in range(rounds):
            for mode in ("off", "on") if index % 2 == 0 else ("on", "off"):
                if mode == "on":
                    with zs.observe(Path(shared) / f"round-{index}", model=model, hang_timeout_s=600,
                                    peak_flops=1e11, log=log) as obs:
                        taken = loop_steps(model, opt, obs, first, steps, rows, seq, times["inside"])
                else:
                    taken = loop_steps(model, opt, None, first, steps, rows, seq)
                times[mode] += taken[1:]
                first += steps
    zs.shutdown()
    return times


def fast_half(values: list[float]) -> float:
    """Mean of the faster half: what a step costs when no other process preempts it."""
    ordered = sorted(values)
    return statistics.mean(ordered[:max(1, len(ordered) // 2)])


def main() -> None:
    parser = bench_parser(__doc__, model="small", stage=3, batch=(8, "global batch (rows)"), seq_len=256,
                          steps=(5, "steps per round and mode (the first is left out)"), rounds=4)
    parser.add_argument("--log", default="none", help="loggers while on: tensorboard, wandb, or none")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step of each round is left out)")
    times = spawn(worker, 2, args=(args.model, args.stage, args.batch, args.seq_len, args.steps, args.rounds,
                                   args.log), timeout_s=3600)[0]
    off, on = times["off"], times["on"]
    med_off, med_on = statistics.median(off), statistics.median(on)
    spread = (max(off) - min(off)) / med_off * 100
    print(f"{args.model} stage {args.stage}, world 2, batch {args.batch}x{args.seq_len}, log={args.log}: "
          f"{len(off)} steps off, {len(on)} on (rank 0)")
    print(f"  median step  off {med_off * 1e3:.1f} ms, on {med_on * 1e3:.1f} ms: ratio {med_on / med_off:.4f} "
          f"({(med_on / med_off - 1) * 100:+.2f}%)")
    print(f"  faster half  off {fast_half(off) * 1e3:.1f} ms, on {fast_half(on) * 1e3:.1f} ms: ratio "
          f"{fast_half(on) / fast_half(off):.4f} ({(fast_half(on) / fast_half(off) - 1) * 100:+.2f}%)")
    print(f"  noise floor: the off steps span {spread:.1f}% of their median")
    inside = statistics.median(times["inside"])
    print(f"  direct: obs.step itself takes {inside * 1e3:.2f} ms (median) = {inside / med_off * 100:.2f}% of the "
          "median off step (the per-collective ledger ring and wrapper work is not in this figure)")


if __name__ == "__main__":
    main()

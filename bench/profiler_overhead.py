"""What the step profiler, the ledger's ring file and the hang watchdog cost per training step.

    .venv/bin/python bench/profiler_overhead.py --model tiny --steps 20 --repeats 4
    .venv/bin/python bench/profiler_overhead.py --model small --batch 8 --seq-len 256 --steps 3 --repeats 2

Two gloo ranks train at stage 3, alternating blocks of steps with the instrumentation off and on
(the same model and data stream, so drift and warm-up hit both equally). Two figures:

- **A/B**: median step time on vs off. On a shared CPU this is noisy (other processes, turbo), so it
  is printed with the spread of the off blocks to show what the noise floor is;
- **direct**: the instrumentation's own time per step, measured where it runs (begin/end of the
  step profiler, the span and memory-sample hooks, and the per-collective ledger work with the
  ring mirror, timed in a loop), over the median step time. This is the figure to compare with the
  3% budget; it does not depend on the machine's noise.

The ledger's wait timestamps and completion callbacks are always on (the watchdog needs them), so
the A/B cannot see them; the direct figure counts them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.comm.ledger import Ledger
from zeroshard.observing.ring import RingMirror
from zeroshard.observing.watchdog import Diagnostics
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from zeroshard.observing.profile import step as step_profile
from zeroshard.observing.profile import timeline
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def ledger_cost_per_collective(n: int = 20000) -> tuple[float, float]:
    """Seconds per collective of the ledger's bookkeeping, without and with the ring mirror."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for mirror in (False, True):
            ledger = Ledger()
            if mirror:
                ledger.mirror = RingMirror(Path(tmp) / "r.ring", rank=0, world=1)
            start = time.perf_counter()
            for _ in range(n):
                record = ledger.open(group="shard", op="all_gather", numel=1024, dtype=torch.float32, elem_size=4,
                                     unit="blocks.1", phase="forward")
                ledger.started(record)
                record.wait_start = time.perf_counter()
                record.waited += time.perf_counter() - record.wait_start
                ledger.wait_returned(record)
            out.append((time.perf_counter() - start) / n)
            if mirror:
                ledger.mirror.close()
    return out[0], out[1]


def hook_cost(tl: timeline.Timeline, n: int = 2000) -> tuple[float, float]:
    """Seconds per profiled span (enter + exit with its two memory samples) and per memory sample,
    on the run's own timeline (its RSS probe and the engine's full-param byte count)."""
    saved = timeline.current()
    timeline.activate(tl)
    start = time.perf_counter()
    for _ in range(n):
        with timeline.phase("bench"):
            pass
    span = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        tl.sample("bench")
    sample = (time.perf_counter() - start) / n
    timeline.activate(saved)
    tl.take()
    return span, sample


def completion_callback_cost(n: int = 200) -> float:
    """Seconds to hook the ledger's completion callback onto a real gloo work (collective)."""
    import torch.distributed as dist

    t = torch.zeros(1)
    total = 0.0
    for _ in range(n):
        work = dist.all_reduce(t, async_op=True)
        start = time.perf_counter()
        work.get_future().add_done_callback(lambda fut: None)
        total += time.perf_counter() - start
        work.wait()
    return total / n


def worker(cfg: TrainConfig, steps: int, repeats: int) -> dict:
    from zeroshard.trainer.train import setup, train_step

    mesh = zs.init()
    run = setup(cfg, mesh)
    ledger = zs.ledger()
    for step in range(2):  # warm-up: lazy buffers, the optimizer state, the recorded unit order
        train_step(run, step)
    times = {"off": [], "on": []}
    direct: list[float] = []
    collectives: list[int] = []
    counts: list[tuple[int, int]] = []
    costs: list[tuple[float, float]] = []
    step = 2
    with tempfile.TemporaryDirectory() as tmp:
        shared = zs.comm.collectives.all_gather_object(tmp)[0]
        for rep in range(repeats):
            for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):  # cancel position effects
                profiler = diagnostics = None
                if mode == "on":
                    profiler = step_profile.for_run(run, shared)
                    diagnostics = Diagnostics(ledger, run_dir=shared, rank=mesh.rank, world=mesh.world,
                                              hang_timeout_s=run.cfg.hang_timeout_s).__enter__()
                    profiler.__enter__()
                for _ in range(steps):
                    ledger.step = step + 1
                    seq = ledger.next_seq
                    t0 = time.perf_counter()
                    if profiler is not None:
                        profiler.begin(step)
                    t1 = time.perf_counter()
                    train_step(run, step)
                    t2 = time.perf_counter()
                    if profiler is not None:
                        profiler.end(step)
                    t3 = time.perf_counter()
                    times[mode].append(t3 - t0)
                    if profiler is not None:
                        direct.append((t1 - t0) + (t3 - t2))
                    collectives.append(ledger.next_seq - seq)
                    if profiler is not None:
                        _, _, spans, samples = profiler.last_window
                        counts.append((len(spans), len(samples)))
                    step += 1
                if profiler is not None:
                    costs.append(hook_cost(profiler.timeline))
                    profiler.__exit__(None, None, None)
                    diagnostics.__exit__(None, None, None)
    callback = completion_callback_cost()
    zs.shutdown()
    return {"callback": callback, "times": times, "direct": direct, "collectives": statistics.median(collectives),
            "spans": statistics.median(c[0] for c in counts), "samples": statistics.median(c[1] for c in counts),
            "span_cost": statistics.median(c[0] for c in costs), "sample_cost": statistics.median(c[1] for c in costs)}


def main() -> None:
    args = bench_parser(__doc__, model="tiny", batch=8, seq_len=32, stage=3, steps=(20, "steps per block"),
                        repeats=(4, "off/on block pairs")).parse_args()
    cfg = TrainConfig(model=args.model, stage=args.stage, batch=args.batch, seq_len=args.seq_len, steps=10**6,
                      num_samples=max(256, args.batch * 4), vocab_size=256 if args.model != "tiny" else 16,
                      peak_flops=1e11)
    result = spawn(worker, 2, args=(cfg, args.steps, args.repeats), timeout_s=3600)[0]
    off, on = result["times"]["off"], result["times"]["on"]
    med_off, med_on = statistics.median(off), statistics.median(on)

    def fast_half(values: list[float]) -> float:
        """Mean of the faster half: what a step costs when no other process preempts it."""
        ordered = sorted(values)
        return statistics.mean(ordered[:max(1, len(ordered) // 2)])

    per_collective, per_collective_ring = ledger_cost_per_collective()
    span, sample = result["span_cost"], result["sample_cost"]
    spans, samples = result["spans"], result["samples"]
    direct = (statistics.median(result["direct"]) + spans * (span - 2 * sample) + samples * sample
              + result["collectives"] * (per_collective_ring + result["callback"]))
    print(f"{args.model} stage {args.stage}, world 2, batch {args.batch}x{args.seq_len}: "
          f"{len(off)} steps off, {len(on)} on; per step {result['collectives']:.0f} collectives, "
          f"{spans:.0f} spans, {samples:.0f} memory samples")
    print(f"  A/B    median step off {med_off * 1e3:.2f} ms, on {med_on * 1e3:.2f} ms "
          f"({(med_on - med_off) / med_off * 100:+.2f}%); "
          f"faster half off {fast_half(off) * 1e3:.2f}, on {fast_half(on) * 1e3:.2f} "
          f"({(fast_half(on) - fast_half(off)) / fast_half(off) * 100:+.2f}%); noise: the off steps' IQR is "
          f"{(statistics.quantiles(off, n=4)[2] - statistics.quantiles(off, n=4)[0]) / med_off * 100:.1f}% of their median")
    print(f"  parts  step profiler begin+end {statistics.median(result['direct']) * 1e6:.0f} us; span {span * 1e6:.2f} us; "
          f"memory sample {sample * 1e6:.2f} us; ledger {per_collective * 1e6:.2f} us/collective "
          f"({per_collective_ring * 1e6:.2f} with the ring mirror) + {result['callback'] * 1e6:.2f} us completion callback")
    print(f"  direct instrumentation cost {direct * 1e6:.0f} us/step = {direct / med_off * 100:.2f}% of the step "
          f"(budget 3%)")

if __name__ == "__main__":
    main()

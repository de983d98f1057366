"""Step time with each block compiled (zs.shard(compile=...)) against eager, same model and data.

    .venv/bin/python bench/compile_speed.py --model tiny --stage 3 --backend inductor --steps 5 --repeats 3
    .venv/bin/python bench/compile_speed.py --model small --batch 8 --seq-len 128 --stage 2 --backend inductor

Two gloo ranks build the run twice, eager and compiled, and train them in alternating blocks of
``--steps`` steps (eager first in even rounds, compiled first in odd ones), so drift and other
processes on a shared machine hit both alike. The first step of each is timed apart: for the
compiled run it includes compilation. Reported: median step time of each (the slowest rank's),
the ratio, the spread of the eager steps as the noise floor, and the losses of both, which must
agree (the step is zeroshard.trainer.train.train_step, the one training step).
"""

from __future__ import annotations

import statistics
import time

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path


def _timed_step(run, step: int) -> tuple[float, float]:
    """(slowest rank's seconds, mean loss) of one training step."""
    from zeroshard.trainer.step import slowest_rank
    from zeroshard.trainer.train import train_step

    t0 = time.perf_counter()
    rec = train_step(run, step)
    return slowest_rank(time.perf_counter() - t0, run.mesh.device), rec.loss


def worker(cfg: TrainConfig, steps: int, repeats: int) -> dict:
    from zeroshard.trainer.train import setup

    mesh = zs.init()
    runs = {"eager": setup(cfg, mesh), "compiled": setup(cfg.replace(compile=True), mesh)}
    first = {name: _timed_step(run, 0)[0] for name, run in runs.items()}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    step = 1
    for rep in range(repeats):
        order = ("eager", "compiled") if rep % 2 == 0 else ("compiled", "eager")
        for name in order:
            for offset in range(steps):
                dt, loss = _timed_step(runs[name], step + offset)
                times[name].append(dt)
                losses[name].append(loss)
        step += steps
    zs.shutdown()
    return {"first": first, "times": times, "losses": losses}


def main() -> None:
    args = bench_parser(__doc__, model="tiny", stage=3, batch=8, seq_len=64, backend="inductor",
                        steps=(5, "steps per block"), repeats=(3, "eager/compiled block pairs")).parse_args()
    cfg = TrainConfig(model=args.model, stage=args.stage, batch=args.batch, seq_len=args.seq_len, steps=10**6,
                      num_samples=max(256, args.batch * 4), vocab_size=16 if args.model == "tiny" else 256,
                      compile_backend=args.backend, profile=False)
    result = spawn(worker, 2, args=(cfg, args.steps, args.repeats), timeout_s=3600)[0]
    eager, compiled = result["times"]["eager"], result["times"]["compiled"]
    med_e, med_c = statistics.median(eager), statistics.median(compiled)
    q = statistics.quantiles(eager, n=4) if len(eager) >= 2 else [med_e, med_e, med_e]
    drift = max(abs(a - b) for a, b in zip(result["losses"]["eager"], result["losses"]["compiled"]))
    print(f"{args.model} stage {args.stage}, world 2, batch {args.batch}x{args.seq_len}, backend {args.backend}: "
          f"{len(eager)} eager and {len(compiled)} compiled steps in {args.repeats} interleaved rounds")
    print(f"  first step: eager {result['first']['eager'] * 1e3:.0f} ms, compiled {result['first']['compiled']:.1f} s "
          "(includes compilation)")
    print(f"  median step: eager {med_e * 1e3:.1f} ms, compiled {med_c * 1e3:.1f} ms, compiled/eager {med_c / med_e:.3f}; "
          f"noise: eager IQR {(q[2] - q[0]) / med_e * 100:.1f}% of its median")
    print(f"  max |loss compiled - eager| over the timed steps: {drift:.2e}")


if __name__ == "__main__":
    main()

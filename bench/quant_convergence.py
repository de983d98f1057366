"""Does quantized communication (qwZ + qgZ) converge like fp32 communication?

    .venv/bin/python bench/quant_convergence.py [--models tiny,small] [--out runs/quant_convergence]
        [--comm weights,grads] [--small-steps 300]

For each model, trains the same run twice through `zeroshard train`'s own worker (stage 3,
world 2, the synthetic Markov source whose entropy floor is exact): once with fp32
communication and once with `--comm-quant` (default `weights,grads`). `tiny` uses the `make demo`
settings (800 steps); `small` the same data and schedule over 300 steps. Prints, per run, the
mean loss over the last 80 steps (tiny) or last 30 (small: a tenth of the run), its gap to the
fp32 run's mean and to the entropy floor, and writes both loss curves per model into one PNG.

Passes when the quantized run's tail mean is within 0.01 nats of the fp32 run's and of the floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zeroshard.config import TrainConfig
from zeroshard.launch import spawn
from zeroshard.train import train_worker

TOLERANCE = 0.01
# `make demo`: tiny, stage 3, 2 ranks, 800 steps.
DEMO = dict(stage=3, nproc=2, batch=32, seq_len=64, lr=6e-3, min_lr=6e-4, warmup=20, log_every=80,
            profile=False)


def config(model: str, steps: int, comm: str, run_dir: Path, batch: int) -> TrainConfig:
    settings = {**DEMO, "batch": batch}
    return TrainConfig(model=model, steps=steps, comm_quant=comm, run_dir=str(run_dir), **settings)  # type: ignore[arg-type]


def run_dir(out: Path, model: str, spec: str) -> Path:
    return out / f"{model}-{spec.replace(',', '-')}"


def train(cfg: TrainConfig) -> None:
    """Train in a fresh world of `cfg.nproc` ranks; metrics.jsonl and config.json land in its run dir."""
    spawn(train_worker, cfg.nproc, args=(cfg,), timeout_s=4 * 3600)


def read_run(path: Path) -> dict:
    """Losses so far (a run still going, or cut short, is read as far as it got) and the entropy floor."""
    lines = (path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {"losses": [r["loss"] for r in records], "floor": json.loads((path / "config.json").read_text())["entropy_floor"],
            "step_s": sorted(r["step_time_s"] for r in records)[len(records) // 2] if records else float("nan")}


def tail_mean(losses: list[float], n: int) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def compare(model: str, steps: int, batch: int, comm: str, out: Path, which: str) -> dict | None:
    specs = {"fp32 comm": "none", f"comm_quant={comm}": comm}
    for name, spec in specs.items():
        if which in ("both", "fp32" if spec == "none" else "quant"):
            train(config(model, steps, spec, run_dir(out, model, spec), batch))
    if which != "both" and which != "report":
        return None
    runs = {name: read_run(run_dir(out, model, spec)) for name, spec in specs.items()}
    done = min(len(r["losses"]) for r in runs.values())  # compare at the same step if one was cut short
    for r in runs.values():
        r["losses"] = r["losses"][:done]
    tail = 80 if done >= 800 else max(1, done // 10)
    floor = runs["fp32 comm"]["floor"]
    means = {k: tail_mean(r["losses"], tail) for k, r in runs.items()}
    qmean, bmean = means[f"comm_quant={comm}"], means["fp32 comm"]
    ok = abs(qmean - bmean) <= TOLERANCE and abs(qmean - floor) <= TOLERANCE
    print(f"{model} (batch {batch}, {done} of {steps} steps done; median step "
          + ", ".join(f"{k} {r['step_s']:.2f} s" for k, r in runs.items()) + ")")
    print(f"{model}: last-{tail}-step mean fp32 comm {bmean:.4f}, quantized {qmean:.4f} "
          f"(diff {qmean - bmean:+.4f}); entropy floor {floor:.4f} (quantized gap {qmean - floor:+.4f}, "
          f"fp32 gap {bmean - floor:+.4f}); {'PASS' if ok else 'FAIL'} at {TOLERANCE} nats", flush=True)
    return {"model": model, "steps": done, "batch": batch, "tail": tail, "floor": floor, "means": means, "ok": ok,
            "losses": {k: r["losses"] for k, r in runs.items()}}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for (name, losses), style in zip(res["losses"].items(), ("-", "--")):
            ax.plot(range(1, len(losses) + 1), losses, style, lw=1, label=f"{name} (tail {res['means'][name]:.4f})")
        ax.axhline(res["floor"], color="k", lw=0.8, ls=":", label=f"entropy floor {res['floor']:.4f}")
        ax.set_yscale("log")
        ax.set_title(f"{res['model']}, stage 3, 2 ranks, {res['steps']} steps x {res['batch']} seqs of 64")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--comm", default="weights,grads", help="the --comm-quant value to compare with fp32")
    parser.add_argument("--tiny-steps", type=int, default=800)
    parser.add_argument("--small-steps", type=int, default=300)
    parser.add_argument("--small-batch", type=int, default=DEMO["batch"],
                        help="global batch for small (the demo's 32 by default; fewer sequences run faster)")
    parser.add_argument("--which", choices=("both", "fp32", "quant", "report"), default="both",
                        help="train both runs then report (default); train one (run the other in a second process "
                             "to have them go at the same pace); or only report on the run dirs as they stand")
    parser.add_argument("--out", type=Path, default=Path("runs/quant_convergence"))
    parser.add_argument("--png", type=Path, default=Path("bench/quant_convergence.png"))
    args = parser.parse_args(argv)
    steps = {"tiny": args.tiny_steps, "small": args.small_steps}
    batch = {"tiny": DEMO["batch"], "small": args.small_batch}
    found = [compare(m, steps.get(m, args.small_steps), batch.get(m, args.small_batch), args.comm, args.out,
                     args.which) for m in args.models.split(",")]
    results = [r for r in found if r is not None]
    if not results:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.png)
    print(f"wrote {args.png} and {args.out / 'results.json'}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

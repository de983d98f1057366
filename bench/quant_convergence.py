"""Does quantized communication (qwZ + qgZ, with and without error feedback) converge like fp32?

    .venv/bin/python bench/quant_convergence.py [--models tiny,small] [--out runs/quant_convergence]
        [--comm weights,grads,weights,grads+ef] [--small-steps 300] [--which all|<spec>|report]

For each model, trains the same run once per communication setting through `zeroshard train`'s
own worker (stage 3, world 2, the synthetic Markov source whose entropy floor is exact): fp32
communication, then each `--comm-quant` value (default `weights,grads` and `weights,grads+ef`).
`tiny` runs the `make demo` workload (batch 32 x 64, 800 steps, lr 6e-3, warmup 20) with one change:
the cosine decay goes to 0 instead of lr/10. With the demo's min_lr 6e-4 the loss is still falling
at step 800 and fp32 communication itself ends 0.014 nats above the floor; decaying to 0 (the
usual end of a cosine schedule) lets the same 800 steps settle. `small` runs the same data over
300 steps with its own batch / lr / warmup (flags). Prints, per run, the mean loss over the last
80 steps (a tenth of a run cut short), its gap to the fp32 run's mean and to the entropy floor,
and writes all curves per model into one PNG.

Passes when every quantized run's tail mean is within 0.01 nats of the fp32 run's and of the floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.train import train_worker

TOLERANCE = 0.01
TAIL = 80
# `make demo` (tiny, stage 3, 2 ranks, 800 steps), cosine decay to 0 (the demo stops at lr/10).
DEMO = dict(stage=3, nproc=2, batch=32, seq_len=64, lr=6e-3, min_lr=0.0, warmup=20, log_every=80,
            profile=False)


def config(model: str, steps: int, comm: str, run_dir: Path, settings: dict) -> TrainConfig:
    return TrainConfig(model=model, steps=steps, comm_quant=comm, run_dir=str(run_dir), **{**DEMO, **settings})


def run_dir(out: Path, model: str, spec: str) -> Path:
    return out / f"{model}-{spec.replace(',', '-').replace('+', '-')}"


def train(cfg: TrainConfig) -> None:
    """Train in a fresh world of `cfg.nproc` ranks; metrics.jsonl and config.json land in its run dir."""
    spawn(train_worker, cfg.nproc, args=(cfg,), timeout_s=4 * 3600)


def read_run(path: Path) -> dict:
    """Losses so far (a run still going, or cut short, is read as far as it got) and the entropy floor."""
    lines = (path / "metrics.jsonl").read_text().splitlines()
    records = [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("kind") != "header"]
    return {"losses": [r["loss"] for r in records], "floor": json.loads((path / "config.json").read_text())["entropy_floor"],
            "step_s": sorted(r["step_time_s"] for r in records)[len(records) // 2] if records else float("nan")}


def tail_mean(losses: list[float], n: int) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def compare(model: str, steps: int, settings: dict, specs: list[str], out: Path, which: str,
            hang_timeout_s: float = 600.0) -> dict | None:
    """Train (``which``: 'all', one spec, or 'report' for none), then compare each quantized run with fp32."""
    names = {spec: "fp32 comm" if spec == "none" else f"comm_quant={spec}" for spec in ["none", *specs]}
    for spec in names:
        if which in ("all", spec):
            train(config(model, steps, spec, run_dir(out, model, spec), settings | {"hang_timeout_s": hang_timeout_s}))
    if which not in ("all", "report"):
        return None
    runs = {name: read_run(run_dir(out, model, spec)) for spec, name in names.items()}
    done = min(len(r["losses"]) for r in runs.values())  # compare at the same step if one was cut short
    for r in runs.values():
        r["losses"] = r["losses"][:done]
    tail = TAIL if done >= steps else max(1, min(TAIL, done // 10))
    floor = runs["fp32 comm"]["floor"]
    means = {k: tail_mean(r["losses"], tail) for k, r in runs.items()}
    base = means["fp32 comm"]
    print(f"{model} ({settings}, {done} of {steps} steps done; median step "
          + ", ".join(f"{k} {r['step_s']:.2f} s" for k, r in runs.items()) + ")")
    print(f"{model}: entropy floor {floor:.4f}; last-{tail}-step mean fp32 comm {base:.4f} (gap {base - floor:+.4f})")
    ok = done >= steps
    for name, mean in means.items():
        if name != "fp32 comm":
            passed = abs(mean - base) <= TOLERANCE and abs(mean - floor) <= TOLERANCE
            ok &= passed
            print(f"{model}: {name} {mean:.4f} (vs fp32 {mean - base:+.4f}, vs floor {mean - floor:+.4f}): "
                  f"{'PASS' if passed else 'FAIL'} at {TOLERANCE} nats", flush=True)
    return {"model": model, "steps": done, "settings": settings, "tail": tail, "floor": floor, "means": means,
            "ok": ok, "losses": {k: r["losses"] for k, r in runs.items()}}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        for (name, losses), style in zip(res["losses"].items(), ("-", "--", ":")):
            ax.plot(range(1, len(losses) + 1), losses, style, lw=1, label=f"{name} (tail {res['means'][name]:.4f})")
        ax.axhline(res["floor"], color="k", lw=0.8, ls=":", label=f"entropy floor {res['floor']:.4f}")
        ax.axvspan(res["steps"] - res["tail"], res["steps"], color="0.9", label=f"last {res['tail']} steps")
        ax.set_yscale("log")
        # Fixed labels in nats: a log axis over 1.2-3 would label only its decade's 2 and 3.
        ax.yaxis.set_major_locator(ticker.FixedLocator([1.25, 1.5, 1.75, 2.0, 2.5, 3.0]))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.2f"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        s = res["settings"]
        ax.set_title(f"{res['model']}, stage 3, 2 ranks, {res['steps']} steps x {s['batch']} seqs of 64, "
                     f"lr {s['lr']:g}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--comm", default="weights,grads;weights,grads+ef",
                        help="';'-separated --comm-quant values to compare with fp32")
    parser.add_argument("--small-comm", default=None, help="the --comm values for small (default: --comm)")
    parser.add_argument("--tiny-steps", type=int, default=800)
    parser.add_argument("--small-steps", type=int, default=300)
    parser.add_argument("--small-batch", type=int, default=DEMO["batch"], help="global batch for small")
    parser.add_argument("--small-lr", type=float, default=DEMO["lr"], help="peak lr for small")
    parser.add_argument("--small-warmup", type=int, default=DEMO["warmup"], help="warm-up steps for small")
    parser.add_argument("--which", default="all",
                        help="'all' trains every run then reports; one spec ('none' for fp32, or a --comm value) "
                             "trains only that run (start several processes to run them side by side); "
                             "'report' only reports on the run dirs as they stand")
    parser.add_argument("--hang-timeout-s", type=float, default=600.0,
                        help="the runs' collective timeout; raise it to pause a run (SIGSTOP) for longer "
                             "than 10 minutes, e.g. while a quiet-host benchmark runs")
    parser.add_argument("--out", type=Path, default=Path("runs/quant_convergence"))
    parser.add_argument("--png", type=Path, default=Path("bench/quant_convergence.png"))
    args = parser.parse_args(argv)
    specs = {m: [c.strip() for c in (args.small_comm if m == "small" and args.small_comm else args.comm).split(";")
                 if c.strip()] for m in args.models.split(",")}
    steps = {"tiny": args.tiny_steps, "small": args.small_steps}
    settings = {"tiny": {}, "small": {"batch": args.small_batch, "lr": args.small_lr, "warmup": args.small_warmup}}
    found = [compare(m, steps.get(m, args.small_steps), {**DEMO, **settings.get(m, settings["small"])}, specs[m],
                     args.out, args.which, args.hang_timeout_s) for m in args.models.split(",")]
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

"""`train`, `plan` and `tune` on every folder of the architecture matrices, at tp 2, pp 2 and (MoE) ep 2.

The folders are the matrices' own: the dense architectures of scripts/arch_matrix.py
(tests/distributed/tp_arch_workloads.py) and the MoE families of scripts/moe_matrix.py, each small and
random, written by save_pretrained in >= 3 shards. Each command runs as a user types it, at world 4
and a few tiny steps:

    zeroshard train --model DIR --nproc 4 --steps 2 --batch 4 --seq-len 16 --tp 2      (--pp 2 --microbatches 2, --ep 2)
    zeroshard plan  --model DIR --world 4 --batch 4 --seq 16 --tp 2
    zeroshard tune  --model DIR --nproc 4 --batch 4 --seq-len 16 --tp 2 --stages 3 (one candidate, one timed step)

One line per folder, layout and command: "pass", or "refused:" with the command's one-line error (its
last line on stderr), and the seconds it took; then the passes and the rest per layout. Each folder's
commands run in one process of their own, through the CLI's entry point with the argv above (what
`zeroshard` runs), so torch, transformers and the ranks' server start once per folder, not once per
command; what the commands and their ranks print goes to the folder's log (--logs DIR keeps them).

    python scripts/cli_matrix.py [--only mistral,olmoe] [--layouts tp,pp,ep] [--commands train,plan,tune]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "distributed"), str(ROOT / "scripts")]

LAYOUTS = {"tp": ["--tp", "2"], "pp": ["--pp", "2", "--microbatches", "2"], "ep": ["--ep", "2"]}
COMMANDS = {
    "train": lambda d: ["train", "--model", d, "--nproc", "4", "--steps", "2", "--batch", "4", "--seq-len", "16"],
    "plan": lambda d: ["plan", "--model", d, "--world", "4", "--batch", "4", "--seq", "16"],
    "tune": lambda d: ["tune", "--model", d, "--nproc", "4", "--batch", "4", "--seq-len", "16", "--stages", "3",
                       "--prefetch", "1", "--checkpointing", "none", "--reshard", "true", "--steps", "1",
                       "--rounds", "1", "--warmup", "0", "--out", "tuned.toml"],
}


def folders(root: Path, only: set[str] | None) -> dict[str, tuple[Path, bool]]:
    """model_type -> (folder, is MoE)."""
    import moe_matrix
    import tp_arch_workloads as w

    dense = [n for n in w.configs() if only is None or n in only]
    out = {n: (p, False) for n, p in w.make_folders(root, tuple(dense)).items()} if dense else {}
    for family in moe_matrix.NAMED:
        if only is None or family in only:
            out[family] = (moe_matrix.make_folder(family, root), True)
    return out


def run_in_process(command: list[str], work: Path) -> str:
    """``zeroshard COMMAND`` as typed, through the CLI's own entry point in this process: "pass", or
    "refused (rc N): " and the last line it wrote to stderr (its one-line error); an exception that
    escapes the command is a "CRASH" (a traceback is never a refusal)."""
    from zeroshard.cli.main import main as zeroshard

    os.chdir(work)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = zeroshard(command)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - reported, with its traceback in the log
        traceback.print_exc()
        return f"CRASH: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        sys.stderr.write(err.getvalue())  # the log keeps everything
    if code == 0:
        return "pass"
    lines = [line.strip() for line in err.getvalue().splitlines() if line.strip()] or ["(no output)"]
    return f"refused (rc {code}): {lines[-1]}"


def folder_worker(name: str, folder: str, moe: bool, layouts: list[str], commands: list[str], runs: Path) -> None:
    """Every command on one folder, in this one process: torch, transformers and the ranks' server are
    started once per folder instead of once per command. The result lines go to stdout; what the
    commands and their ranks print goes to stderr (the folder's log)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the commands' tables and the ranks' output (the ranks' server inherits this fd)
    for layout in layouts:
        if layout == "ep" and not moe:
            continue
        for cmd in commands:
            work = runs / f"{name}-{layout}-{cmd}"
            work.mkdir(parents=True)
            started = time.monotonic()
            line = run_in_process(COMMANDS[cmd](folder) + LAYOUTS[layout], work)
            print(f"{name:14s} {layout} {cmd:5s} {line}  [{time.monotonic() - started:.0f} s]", file=results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: every folder)")
    parser.add_argument("--layouts", default="tp,pp,ep")
    parser.add_argument("--commands", default="train,plan,tune")
    parser.add_argument("--logs", default="", help="keep each folder's output here (default: dropped)")
    parser.add_argument("--folder", nargs=4, metavar=("NAME", "DIR", "MOE", "RUNS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    commands = [x for x in args.commands.split(",") if x]
    if args.folder:  # one folder's process, started below
        name, folder, moe, runs = args.folder
        folder_worker(name, folder, moe == "1", layouts, commands, Path(runs))
        return 0
    only = set(args.only.split(",")) - {""} or None
    counts: dict[str, list[int]] = {k: [0, 0] for k in layouts}  # layout -> [passed, not passed]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        logs = Path(args.logs) if args.logs else root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name, (folder, moe) in folders(root / "models", only).items():
            with open(logs / f"{name}.log", "w") as log:
                done = subprocess.run(
                    [sys.executable, __file__, "--folder", name, str(folder), str(int(moe)), str(root / "runs"),
                     "--layouts", args.layouts, "--commands", args.commands],
                    stdout=subprocess.PIPE, stderr=log, text=True, timeout=3600,
                    env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
            lines = done.stdout.splitlines()
            if done.returncode != 0:
                lines.append(f"{name:14s} -  -     CRASH: the folder's process exited with {done.returncode} "
                             f"(log {logs / name}.log)")
            for line in lines:
                print(line, flush=True)
                _, layout, _, outcome, *_ = line.split()
                if layout in counts:
                    counts[layout][outcome != "pass"] += 1
    print("per layout, passed / not: " + ", ".join(f"{k} {v[0]} / {v[1]}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

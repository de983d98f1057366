"""`train`, `plan` and `tune` on every folder of the architecture matrices, at tp 2, pp 2 and (MoE) ep 2.

The folders are the matrices' own: the dense architectures of scripts/arch_matrix.py
(tests/distributed/tp_arch_workloads.py) and the MoE families of scripts/moe_matrix.py, each small and
random, written by save_pretrained in >= 3 shards. Each command runs as a user types it, at world 4
and a few tiny steps:

    zeroshard train --model DIR --nproc 4 --steps 2 --batch 4 --seq-len 16 --tp 2      (--pp 2 --microbatches 2, --ep 2)
    zeroshard plan  --model DIR --world 4 --batch 4 --seq 16 --tp 2
    zeroshard tune  --model DIR --nproc 4 --batch 4 --seq-len 16 --tp 2 --stages 3 (one candidate, one timed step)

One line per folder, layout and command: "pass", or "refused:" with the command's one-line error (its
last line on stderr), then a count of refusals per layout.

    python scripts/cli_matrix.py [--only mistral,olmoe] [--layouts tp,pp,ep] [--commands train,plan,tune]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
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


def run(command: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", *command], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, timeout=1800)
    if done.returncode == 0:
        return "pass"
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
    return f"refused (rc {done.returncode}): {lines[-1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model_types (default: every folder)")
    parser.add_argument("--layouts", default="tp,pp,ep")
    parser.add_argument("--commands", default="train,plan,tune")
    args = parser.parse_args()
    only = set(args.only.split(",")) - {""} or None
    layouts = [x for x in args.layouts.split(",") if x]
    commands = [x for x in args.commands.split(",") if x]
    refusals: dict[str, int] = {k: 0 for k in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, (folder, moe) in folders(root / "models", only).items():
            for layout in layouts:
                if layout == "ep" and not moe:
                    continue
                for cmd in commands:
                    work = root / "runs" / f"{name}-{layout}-{cmd}"
                    work.mkdir(parents=True)
                    line = run(COMMANDS[cmd](str(folder)) + LAYOUTS[layout], work)
                    refusals[layout] += line != "pass"
                    print(f"{name:14s} {layout} {cmd:5s} {line}", flush=True)
    print("refusals per layout: " + ", ".join(f"{k} {v}" for k, v in refusals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

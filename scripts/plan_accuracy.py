"""The planner against `plan measure` on transformers folders zeroshard has no code for, with and
without a pipeline, at tp and ep: one line per layout, the plan's error against the measured peak
(ddp .. zero3; + is the plan above), per pp rank with --pp.

Each folder is built small and random (4 blocks, width 32) by save_pretrained in >= 3 shards, as the
architecture matrices build them (scripts/moe_matrix.py, tests/distributed/tp_arch_workloads.py).
Memory figures are storage accounting on gloo, so a loaded host gives the same figures.

    PYTHONPATH=$PWD python scripts/plan_accuracy.py [--only olmoe-pp,mistral-pp-tp2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "distributed")]

PP = ["--world", "4", "--pp", "2", "--microbatches", "2", "--batch", "8", "--seq", "32"]
ONE = ["--world", "2", "--batch", "4", "--seq", "32"]
LAYOUTS = {
    "mistral-pp": ("mistral", PP), "mistral-pp-tp2": ("mistral", [*PP, "--tp", "2"]),
    "gemma2-pp": ("gemma2", PP), "qwen2_moe-pp": ("qwen2_moe", PP),
    "qwen2_moe-pp-ep2": ("qwen2_moe", [*PP, "--ep", "2"]), "mixtral-pp-ep2": ("mixtral", [*PP, "--ep", "2"]),
    "olmoe-pp": ("olmoe", PP), "olmoe-pp-ep2": ("olmoe", [*PP, "--ep", "2"]),
    "olmoe": ("olmoe", ONE), "qwen2_moe": ("qwen2_moe", ONE), "mistral": ("mistral", ONE),
    "mistral-tp2": ("mistral", ["--world", "4", "--tp", "2", "--batch", "4", "--seq", "32"]),
}
"""name -> (folder, plan measure's flags)."""


def folder(family: str, root: Path) -> Path:
    if (root / family).exists():
        return root / family
    if family in ("mistral", "gemma2"):
        from tp_arch_workloads import make_folders

        return make_folders(root, (family,))[family]
    from moe_matrix import make_folder

    return make_folder(family, root)


def errors(out: dict) -> str:
    """The measurement's errors, signed (+: the plan above), per pp rank or for the one layout set."""
    rows = out["measurement"]
    sign = lambda p, m: (p - m) / m  # noqa: E731
    if "pp_rank" in rows[0]:
        parts = []
        for r in sorted({c["pp_rank"] for c in rows}):
            e = [sign(c["predicted_bytes"], c["measured_bytes"]) for c in rows if c["pp_rank"] == r]
            parts.append(f"pp rank {r}: {min(e):+.1%} .. {max(e):+.1%}")
        return ", ".join(parts)
    e = [sign(c["predicted_peak_bytes"], c["measured_total_bytes"]) for c in rows]
    return f"{min(e):+.1%} .. {max(e):+.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help=f"comma-separated layouts out of {', '.join(LAYOUTS)}")
    parser.add_argument("--keep", default="", help="write the folders here and keep them")
    args = parser.parse_args()
    chosen = {k: v for k, v in LAYOUTS.items() if not args.only or k in args.only.split(",")}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plan_accuracy_"))
    root.mkdir(parents=True, exist_ok=True)
    for name, (family, flags) in chosen.items():
        cmd = [sys.executable, "-m", "zeroshard.cli.main", "plan", "measure", "--model", str(folder(family, root)),
               *flags, "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        try:
            line = errors(json.loads("\n".join(lines)))
        except (json.JSONDecodeError, KeyError, IndexError):
            line = f"failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}"
        print(f"{name:18s} plan measure {' '.join(flags)}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

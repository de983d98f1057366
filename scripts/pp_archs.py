"""`zeroshard verify --pp 2` over transformers architectures zeroshard has no code for.

Each architecture is built small and random (4 blocks), written by transformers' own save_pretrained
in >= 3 safetensors files, and verified at world 4 (pp 2 x shard 2, stage 3 by default) against one
process: one line per architecture with the worst param and loss difference, or the one-line refusal.

    PYTHONPATH=$PWD python scripts/pp_archs.py [--stage 3] [--only gemma2,gpt2] [--keep DIR]
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
sys.path[:0] = [str(ROOT / "tests" / "distributed")]  # the architectures, as the pipeline tests build them

from pp_arch_configs import pp_arch_configs  # noqa: E402

SHARD = "20KB"


def write(name: str, config, root: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    out = root / name
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out, max_shard_size=SHARD)
    return out


def verify(folder: Path, stage: int) -> str:
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "verify", "--model", str(folder), "--nproc", "4",
           "--stage", str(stage), "--pp", "2", "--batch", "8", "--seq-len", "16", "--steps", "3", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"refused/failed (rc {done.returncode}): {tail}"
    r = json.loads(lines[-1])
    return (f"{'PASSED' if r['passed'] else 'FAILED'}  params vs one process {r['max_abs_param_diff_vs_single']:.2e}, "
            f"vs stage 0 {r['max_abs_param_diff_vs_stage0']:.2e}, loss {r['max_abs_loss_diff_vs_single']:.2e}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated architectures (default: all)")
    parser.add_argument("--keep", default="", help="write the folders here and keep them")
    args = parser.parse_args()
    chosen = pp_arch_configs()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pp_archs_"))
    failed = 0
    for name, config in chosen.items():
        folder = write(name, config, root)
        shards = len(list(folder.glob("*.safetensors")))
        line = verify(folder, args.stage)
        failed += not line.startswith("PASSED")
        print(f"{name:11s} pp 2 x shard 2, stage {args.stage}, {shards} files: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Peak memory of `ckpt import-dcp` and `ckpt export-dcp` on a DCP directory of a given size.

    .venv/bin/python bench/dcp_memory.py --tensors 48 --mib 4     # 192 MiB of fp32 params

Writes a model-only DCP directory with ``dcp.save(no_dist=True)`` (``--tensors`` square fp32 tensors of
``--mib`` MiB each, random, so none is detected as tied), then imports it and exports the result back,
each in this one process. It prints each step's time and the peak resident memory above the start,
sampled every 2 ms from /proc/self/status: anonymous memory (RssAnon, what the process holds) and
mapped file pages (RssFile, which the kernel can drop). Both should stay near one batch or one
tensor, not the checkpoint's size.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from procstatus import status_bytes  # bench/ sibling: python puts the script's folder on sys.path
from zeroshard.checkpoint.dcp import export_dcp, import_dcp

MIB = 2**20



def measured(fn: Callable[[], Any]) -> dict:
    """Run fn; peak RssAnon / RssFile above the start, and seconds."""
    gc.collect()
    base = {k: status_bytes(k) for k in ("RssAnon", "RssFile")}
    peak = dict(base)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for k in peak:
                peak[k] = max(peak[k], status_bytes(k))
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return {"seconds": seconds, **{k: peak[k] - base[k] for k in peak}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=48)
    parser.add_argument("--mib", type=int, default=4, help="MiB per tensor")
    parser.add_argument("--batch-mib", type=int, default=32, help="import's read batch")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*single process")
    side = int((args.mib * MIB // 4) ** 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        g = torch.Generator().manual_seed(0)
        state = {f"layers.{i}.weight": torch.randn(side, side, generator=g) for i in range(args.tensors)}
        total = sum(t.numel() * t.element_size() for t in state.values())
        dcp.save({"model": state}, checkpoint_id=root / "src", no_dist=True)
        del state
        print(f"DCP directory: {args.tensors} tensors of {side}x{side} fp32 = {total / MIB:.0f} MiB; "
              f"import reads {args.batch_mib} MiB per dcp.load")
        for name, fn in (("import-dcp", lambda: import_dcp(root / "src", root / "zs", batch_bytes=args.batch_mib * MIB)),
                         ("export-dcp", lambda: export_dcp(root / "zs", root / "back"))):
            r = measured(fn)
            print(f"  {name}: {r['seconds']:.1f} s, {total / MIB / r['seconds']:.0f} MiB/s; peak above start "
                  f"+{r['RssAnon'] / MIB:.1f} MiB anon, +{r['RssFile'] / MIB:.1f} MiB file-backed")


if __name__ == "__main__":
    main()

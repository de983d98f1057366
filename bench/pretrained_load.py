"""Peak per-rank memory and throughput of loading a pretrained folder straight into shards.

    .venv/bin/python bench/pretrained_load.py --world 4            # ~100M-param Llama, stage 3

Builds a random Llama-architecture model (about 100M params by default) with transformers, writes it
with ``save_pretrained(max_shard_size=...)`` into a temporary folder (several safetensors files),
then on ``--world`` ranks builds it on meta, shards it and calls ``zs.load_pretrained``. Each rank
reports what it read and held, the load's time and MB/s, and its resident memory during the load,
sampled every 2 ms from /proc/self/status and split into anonymous memory (RssAnon: what the process
really holds) and mapped file pages (RssFile: safetensors maps the files, and the pages a rank reads
stay mapped until the files are closed; the kernel can drop them). VmHWM, reset just before the load
where the kernel allows it, is the exact peak of the two together. Read those next to the rank's
shard and the largest tensor: loading should cost about a shard, never the model. (torch.profiler's
allocator events are not used: they count each safetensors file mapping at the whole file's size,
touched or not.)
The files were just written, so they are read from the page cache: MB/s is not disk speed.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import torch

import zeroshard as zs
from procstatus import status_bytes  # bench/ sibling: python puts the script's folder on sys.path
from zeroshard.trainer.launch import spawn
from zeroshard.runtime import get_engine
from flags import bench_parser  # bench/ sibling: python puts the script's folder on sys.path

MIB = 2**20



def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    """Peak RssAnon and RssFile while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.anon = self.file = 0

    def run(self) -> None:
        while not self.done.is_set():
            self.anon, self.file = max(self.anon, status_bytes("RssAnon")), max(self.file, status_bytes("RssFile"))
            time.sleep(0.002)

    def stop(self) -> None:
        self.done.set()
        self.join()
        self.anon, self.file = max(self.anon, status_bytes("RssAnon")), max(self.file, status_bytes("RssFile"))


def make_folder(root: Path, layers: int, hidden: int, vocab: int, shard_size: str) -> dict:
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(root, max_shard_size=shard_size)
    params = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    files = sorted(root.glob("*.safetensors"))
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": sum(params.values()),
            "largest": max(params.items(), key=lambda kv: kv[1]), "files": len(files),
            "largest_file": max(f.stat().st_size for f in files)}


def _rank(path: str) -> dict:
    zs.init()

    def sharded():
        model = zs.build_pretrained(path)
        return zs.shard(model, stage=3, skip_init=True)

    model = sharded()
    engine = get_engine(model)
    shard = sum(g.shard.untyped_storage().nbytes() for g in engine.groups)
    largest_slot = max(s.numel * g.shard.element_size() for g in engine.groups for s in g.layout.slots)
    zs.comm.collectives.barrier(phase="bench")
    before = {k: status_bytes(k) for k in ("VmRSS", "RssAnon", "RssFile")}
    reset = _reset_peak_rss()
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    stats = zs.load_pretrained(model, path)
    seconds = time.perf_counter() - start
    sampler.stop()
    hwm = status_bytes("VmHWM")
    return {"rank": zs.get_mesh().rank, "seconds": seconds, "read": stats["bytes_read"], "held": stats["bytes_held"],
            "shard": shard, "largest_slot": largest_slot, "before": before, "anon": sampler.anon - before["RssAnon"],
            "file": sampler.file - before["RssFile"], "hwm": hwm - before["VmRSS"] if reset else None}


def main() -> None:
    args = bench_parser(__doc__, world=4, layers=8, hidden=768, vocab=32000,
                        shard_size=("100MB", "save_pretrained's max_shard_size")).parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        t0 = time.perf_counter()
        info = make_folder(folder, args.layers, args.hidden, args.vocab, args.shard_size)
        name, size = info["largest"]
        print(f"folder: Llama {info['params'] / 1e6:.1f}M params, {info['bytes'] / MIB:.1f} MiB fp32 in {info['files']} "
              f"safetensors files (largest file {info['largest_file'] / MIB:.1f} MiB), largest tensor {name} "
              f"{size / MIB:.1f} MiB; written in {time.perf_counter() - t0:.1f} s")
        results = spawn(_rank, args.world, args=(str(folder),), timeout_s=1800)
    total = sum(r["read"] for r in results)
    wall = max(r["seconds"] for r in results)
    print(f"load_pretrained at world {args.world}, stage 3:")
    for r in results:
        hwm = "n/a" if r["hwm"] is None else f"{r['hwm'] / MIB:.1f}"
        print(f"  rank {r['rank']}: read {r['read'] / MIB:6.1f} MiB, holds {r['held'] / MIB:6.1f} MiB "
              f"(shard {r['shard'] / MIB:6.1f} MiB) in {r['seconds']:5.2f} s = {r['read'] / MIB / r['seconds']:6.1f} MiB/s; "
              f"RSS {r['before']['VmRSS'] / MIB:.1f} MiB before; peak during load +{r['anon'] / MIB:.1f} MiB anon, "
              f"+{r['file'] / MIB:.1f} MiB file-backed, +{hwm} MiB VmHWM")
    print(f"  all ranks: {total / MIB:.1f} MiB read of {info['bytes'] / MIB:.1f} MiB in {wall:.2f} s = "
          f"{total / MIB / wall:.1f} MiB/s aggregate; largest param slot {results[0]['largest_slot'] / MIB:.1f} MiB")


if __name__ == "__main__":
    main()

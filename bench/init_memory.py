"""Peak per-rank tensor bytes while building and sharding a GPT, with and without meta init.

    .venv/bin/python bench/init_memory.py --model medium --world 4 --stage 3
    .venv/bin/python bench/init_memory.py --llama 768 --world 4 --stage 3

``--llama WIDTH`` instead builds a transformers ``LlamaForCausalLM`` of that width (12 layers, 32k
vocabulary, untied head) as written, through constructor replay (``zs.shard(build)``) and plainly.

Each rank reports the peak tensor storage allocated during build + zs.shard (allocator events via
torch.profiler), its shard bytes and the largest single param: meta init should sit at
shards + largest param, a plain build at the whole model or more.
"""

from __future__ import annotations

import argparse
import time

import torch

import zeroshard as zs
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig
from zeroshard.observing.profile.alloc import peak_allocated
from zeroshard.runtime import get_engine


def _llama(width: int):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=12,
                         num_attention_heads=width // 64, num_key_value_heads=width // 256, tie_word_embeddings=False)
    return lambda: tf.AutoModelForCausalLM.from_config(cfg)


def _rank(model_name: str, stage: int, meta: bool, llama: int = 0) -> dict:
    zs.init()
    make = _llama(llama) if llama else None  # imports transformers outside the measured region

    def build():
        torch.manual_seed(0)
        if make is not None:
            return zs.shard(make, stage=stage) if meta else zs.shard(make(), stage=stage)
        cfg = GPTConfig.named(model_name)
        if meta:
            with zs.meta_init():
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        return zs.shard(model, stage=stage)

    start = time.perf_counter()
    peak, model = peak_allocated(build)
    seconds = time.perf_counter() - start
    engine = get_engine(model)
    return {
        "peak": peak,
        "seconds": seconds,
        "shard": sum(g.shard.untyped_storage().nbytes() for g in engine.groups),
        "largest": max(s.numel for g in engine.groups for s in g.layout.slots) * 4,
        "model": sum(g.layout.param_numel for g in engine.groups) * 4,
        "path": engine.init_stats["path"],
        "held": engine.init_stats.get("held_whole_bytes", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="medium")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--llama", type=int, default=0, metavar="WIDTH", help="a transformers Llama of this width")
    args = parser.parse_args()
    mib = 2**20
    print(f"{f'llama width {args.llama}' if args.llama else args.model} at world {args.world}, stage {args.stage}")
    for meta in (True, False):
        results = spawn(_rank, args.world, args=(args.model, args.stage, meta, args.llama), timeout_s=1800)
        r = max(results, key=lambda x: x["peak"])
        print(f"  init={r['path']:<11} peak/rank {r['peak'] / mib:8.1f} MiB   shards {r['shard'] / mib:7.1f} MiB"
              f"   largest param {r['largest'] / mib:5.1f} MiB   model {r['model'] / mib:7.1f} MiB"
              f"   held whole {r['held'] / mib:.1f} MiB   build+shard {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()

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

VOCAB = 96
SHARD = "20KB"


def configs() -> dict:
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        "gemma2": tf.Gemma2Config(**common, head_dim=8, sliding_window=4, final_logit_softcapping=3.0),
        "mistral": tf.MistralConfig(**common, sliding_window=4),
        "phi3": tf.Phi3Config(**common),
        "olmo2": tf.Olmo2Config(**common),
        "qwen3": tf.Qwen3Config(**common, head_dim=8),
        "cohere": tf.CohereConfig(**common, logit_scale=0.5),
        "granite": tf.GraniteConfig(**common, embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5),
        "starcoder2": tf.Starcoder2Config(**common),
        "gpt2": tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=1,
                              eos_token_id=2),
        "falcon": tf.FalconConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
                                  new_decoder_architecture=False, parallel_attn=True, bos_token_id=1, eos_token_id=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**{**common, "intermediate_size": 32}, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
        "olmoe": tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2),
    }


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
    chosen = configs()
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

"""Expert parallelism over every MoE family transformers declares an ep plan for: one line each.

For each family: a small random model written by ``save_pretrained`` in >= 3 shards, 4 blocks, 4
experts, top 2, then ``zeroshard verify --model DIR --nproc 4 --stage 3 --ep 2`` (3 steps) against
one process. A line says PASS or FAIL with the max param and loss differences (pass: params
<= 1e-5, loss <= 1e-6), REFUSED with verify's one-line refusal, ERROR with the exception a run
ended on, or NOT BUILT when the family's config or model cannot be built small.

    python scripts/moe_matrix.py                  # the named families (NAMED)
    python scripts/moe_matrix.py --all            # every causal-LM family with base_model_ep_plan
    python scripts/moe_matrix.py olmoe gpt_oss --extra "--pp 2 --microbatches 2"

tests/distributed/test_moe_families.py builds its folders with ``make_folder`` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NAMED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "qwen3_next", "glm4_moe",
         "ernie4_5_moe", "dots1", "hunyuan_v1_moe", "deepseek_v2", "granitemoe", "phimoe", "minimax")
PARAM_TOL, LOSS_TOL = 1e-5, 1e-6
SHARD_BYTES = "20KB"
SMALL: dict[str, Any] = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts_per_tok=2,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, moe_k=2, n_shared_experts=1,
    shared_expert_intermediate_size=16, moe_num_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, sliding_window=8,
    decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, moe_layer_start_index=1, first_k_dense=1,
    pad_token_id=None, bos_token_id=None, eos_token_id=None)
"""Small values for the config keys MoE families use; a key a config lacks is left out."""
PER_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"] * 2),
}


def small_config(family: str) -> Any:
    """The family's config class at a small size: SMALL's keys it has, then its PER_FAMILY values."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(family)
    keys = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    values = {k: v for k, v in SMALL.items() if k in keys}
    if "kv_lora_rank" in keys:  # latent attention (MLA): one key/value head per query head
        values.update(num_key_value_heads=values["num_attention_heads"], head_dim=4)
    values.update(PER_FAMILY.get(family, {}))
    if "layer_types" in keys and "layer_types" not in values:
        values["layer_types"] = None  # recomputed for 4 blocks by the config
    return AutoConfig.for_model(family, **values)


def make_folder(family: str, root: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A random ``family`` model at a small size, written by save_pretrained in >= 3 shards."""
    import torch
    import transformers as tf

    config = small_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # the small model must run as one process before ep is worth asking about
        model(input_ids=torch.randint(0, SMALL["vocab_size"], (2, 16)), use_cache=False)
    out = root / family
    model.save_pretrained(out, max_shard_size=SHARD_BYTES)
    files = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())
    if len(files) < 3:
        raise RuntimeError(f"{family}: {len(files)} safetensors files, want >= 3")
    return out


def ep_families() -> list[str]:
    """Every model type with a causal-LM class whose config declares base_model_ep_plan."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            if AutoConfig.for_model(family).base_model_ep_plan:
                out.append(family)
        except Exception:  # a config that needs arguments or extras: not one we can build small
            continue
    return out


def verify(folder: Path, extra: list[str]) -> str:
    """One line: the verify run's verdict with its max differences, or its one-line error."""
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "verify", "--model", str(folder), "--nproc", "4", "--stage", "3",
           "--ep", "2", "--steps", "3", "--batch", "8", "--seq-len", "16", "--json", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = [line.strip() for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        refused = [line for line in tail if line.startswith("zeroshard verify: error:")]
        if refused:  # the CLI's one-line refusal, before any rank started
            return "REFUSED: " + refused[-1].removeprefix("zeroshard verify: error:").strip()[:300]
        errors = [line for line in tail if "Error" in line]  # a crash: the exception's last line
        return "ERROR: " + (errors[-1] if errors else tail[-1] if tail else f"exit {run.returncode}")[:300]
    result = json.loads(lines[-1])
    params, loss = result["max_abs_param_diff_vs_single"], result["max_abs_loss_diff_vs_single"]
    ok = params <= PARAM_TOL and loss <= LOSS_TOL and not result["mismatched_param_names"]
    return f"{'PASS' if ok else 'FAIL'}  params {params:.1e}  loss {loss:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"model types (default: {', '.join(NAMED)})")
    parser.add_argument("--all", action="store_true", help="every causal-LM family declaring base_model_ep_plan")
    parser.add_argument("--extra", default="", help="more verify flags, e.g. '--pp 2 --microbatches 2'")
    args = parser.parse_args()
    families = ep_families() if args.all else (args.families or list(NAMED))
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            try:
                folder = make_folder(family, Path(tmp))
            except Exception as e:  # noqa: BLE001 - one line per family, whatever failed
                print(f"{family:16s} NOT BUILT: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                      flush=True)
                continue
            print(f"{family:16s} {verify(folder, args.extra.split())}", flush=True)


if __name__ == "__main__":
    main()

"""Six DeepSpeed configs written the way people write them, through `zeroshard config
from-deepspeed` and then `zeroshard train --config`.

Each converts with its decision table (every key, what it became, where the value came from), or
is refused with the key named, and converts with `--drop KEY` once the user accepts to lose it.
The conversions run in this process (fast); the train runs are separate processes of two or four
gloo ranks, so the default suite trains the HF-Trainer one and ZEROSHARD_DS_TRAIN=1 trains all six.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from test_cli import read_metrics, run_cli, run_main

from zeroshard.trainer.config import load_toml

# The Hugging Face Trainer's ZeRO-3 template with params and optimizer offloaded to the CPU:
# "auto" in every field the Trainer fills from its arguments.
HF_ZERO3_OFFLOAD = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

# ZeRO-2 with AutoTP over 4 ranks: the batch keys count data-parallel ranks (world / 4).
ZERO2_AUTOTP4 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7,
                          "contiguous_gradients": True},
    "tensor_parallel": {"autotp_size": 4},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
}

# ZeRO-2 with the optimizer on the CPU and ZenFlow's top-k updates on top of it.
ZERO2_OFFLOAD_ZENFLOW = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "zenflow": {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
                    "full_warm_up_rounds": 0, "overlap_step": True},
    },
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": True}},
    "gradient_clipping": 1.0,
}

# ZeRO-1 with AutoEP (an MoE model's experts spread over 2 ranks), its model found by a preset.
ZERO1_EXPERT_PARALLEL = {
    "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "use_grouped_mm": True,
                        "top_k": "auto", "load_balance_coeff": None},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 3, "warmup_num_steps": 1,
                                                       "warmup_type": "linear", "cos_min_ratio": 0.1}},
}

# ZeRO++: quantized weight all-gathers and gradient reductions at stage 3, prefetching switched off.
ZERO3_QUANTIZED = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                          "zero_hpz_partition_size": 1, "reduce_bucket_size": 1e7, "stage3_prefetch_bucket_size": 0,
                          "contiguous_gradients": True, "overlap_comm": True, "stage3_max_live_parameters": 1e8},
    "gradient_clipping": 1.0, "fp16": {"enabled": False},
}


# ZeRO-3 written with DeepSpeed's field names rather than their stage3_ aliases, and its
# WarmupDecayLR: warm-up, then linear decay to warmup_min_lr at the last step.
ZERO3_FIELD_NAMES_DECAY = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True, "prefetch_bucket_size": 5e7,
                          "param_persistence_threshold": 1e5, "max_live_parameters": 1e9,
                          "use_multi_rank_bucket_allreduce": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 1, "total_num_steps": 3,
                                                      "warmup_type": "linear"}},
}


def zero3_nvme_fp16(nvme: str) -> dict:
    """ZeRO-3 with params and optimizer on NVMe, fp16 with dynamic loss scaling, and the logging blocks."""
    return {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                 "hysteresis": 1, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4, "pipeline_read": False,
                                  "pipeline_write": False},
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 5, "buffer_size": 1e8,
                              "max_in_cpu": 1e9},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
        "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "ds"},
        "csv_monitor": {"enabled": False}, "comms_logger": {"enabled": True, "verbose": False},
        "flops_profiler": {"enabled": False}, "wall_clock_breakdown": True, "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 3, "warmup_num_steps": 1,
                                                           "warmup_type": "linear"}},
    }


SMALL_RUN = ["--steps", "3", "--seq-len", "16", "--num-samples", "64"]
"""zeroshard flags that no DeepSpeed key sets: a short run on a tiny model, written into the TOML."""

# name: (config, converter args, the key a plain conversion refuses (None: it converts), TOML keys it must hold)
SHAPES: dict[str, tuple] = {
    "hf_zero3_offload": (HF_ZERO3_OFFLOAD, ["--world", "2", "--batch", "8", "--lr", "3e-4", "--warmup", "1"], None,
                         dict(stage=3, nproc=2, batch=8, accum=1, offload="cpu", lr=3e-4, lr_schedule="WarmupLR",
                              warmup_min_lr=0.0, warmup=1, warmup_shape="log", clip=1.0, mp="fp32")),
    "zero2_autotp4": (ZERO2_AUTOTP4, ["--world", "4"], None,
                      dict(stage=2, nproc=4, tp=4, batch=2, accum=1, mp="bf16", lr=1e-3, weight_decay=0.0)),
    "zero2_offload_zenflow": (ZERO2_OFFLOAD_ZENFLOW, [], "zero_optimization.zenflow",
                              dict(stage=2, nproc=2, batch=8, accum=2, offload="cpu", lr=1e-3, weight_decay=0.01)),
    "zero1_expert_parallel": (ZERO1_EXPERT_PARALLEL, ["--world", "2", "--model", "tiny-moe"], None,
                              dict(stage=1, nproc=2, ep=2, model="tiny-moe", batch=16, accum=1, steps=3, warmup=1,
                                   lr=2e-3, lr_schedule="WarmupCosineLR", min_lr=2e-3 * 0.1, log_every=1)),
    "zero3_field_names_decay": (ZERO3_FIELD_NAMES_DECAY, ["--world", "2"], None,
                                dict(stage=3, nproc=2, batch=8, accum=2, lr=1e-3, lr_schedule="WarmupDecayLR",
                                     warmup_min_lr=1e-5, warmup=1, steps=3, warmup_shape="linear")),
    "zero3_quantized": (ZERO3_QUANTIZED, ["--world", "2"], None,
                        dict(stage=3, nproc=2, batch=8, comm_quant="weights,grads", prefetch=0, clip=1.0)),
    "zero3_nvme_fp16": (None, [], None, dict(stage=3, nproc=2, batch=8, accum=2, offload="disk", mp="fp16", lr=5e-4,
                                             steps=3, log_every=1)),
}


def _write(tmp_path: Path, name: str) -> tuple[Path, list[str]]:
    ds, args, _, _ = SHAPES[name]
    ds = zero3_nvme_fp16(str(tmp_path / "nvme")) if ds is None else ds
    src = tmp_path / f"{name}.json"
    src.write_text(json.dumps(ds, indent=1))
    return src, args


def convert(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> Path:
    """The conversion as a user runs it (after the --drop its refusal asks for); returns the TOML."""
    src, args = _write(tmp_path, name)
    _, _, refused, _ = SHAPES[name]
    out = tmp_path / f"{name}.toml"
    drop = ["--drop", refused] if refused else []
    done = run_main(["config", "from-deepspeed", str(src), *args, *SMALL_RUN, *drop, "--out", str(out)], capsys)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_converts_with_its_table_or_is_refused_by_name(name, tmp_path, capsys):
    src, args = _write(tmp_path, name)
    ds = json.loads(src.read_text())
    _, _, refused, expected = SHAPES[name]
    if refused:
        plain = run_main(["config", "from-deepspeed", str(src), *args, *SMALL_RUN], capsys)
        print(plain.stderr)
        assert plain.returncode == 1 and plain.stdout == ""
        assert f"DeepSpeed key {refused}=" in plain.stderr and f"--drop {refused}" in plain.stderr, plain.stderr
        assert len(plain.stderr.strip().splitlines()) == 1, "a refusal is one line"
    toml = convert(tmp_path, name, capsys)
    values = load_toml(toml)
    assert {k: values.get(k) for k in expected} == expected
    text = toml.read_text()
    table = [ln[2:] for ln in text.splitlines() if ln.startswith("# ")][1:]
    print("\n".join(table))
    # Every top-level key and every zero_optimization key of the JSON has its row.
    keys = {ln.split()[0] for ln in table[1:]}
    assert set(ds) - {"zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "tensor_parallel",
                      "expert_parallel"} <= keys | \
        ({refused} if refused else set())
    zero = {f"zero_optimization.{k}" for k in ds.get("zero_optimization", {})} - {"zero_optimization.offload_optimizer",
                                                                                  "zero_optimization.offload_param"}
    assert zero <= keys, sorted(zero - keys)
    if refused:
        assert any(ln.startswith(refused) and "--drop" in ln for ln in table), "the dropped key has a row saying so"


def test_hf_auto_rows_say_where_each_value_came_from(tmp_path, capsys):
    lines = [ln[2:] for ln in convert(tmp_path, "hf_zero3_offload", capsys).read_text().splitlines() if ln.startswith("# ")]
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert "batch = 8" in rows["train_batch_size"] and "auto: --batch" in rows["train_batch_size"]
    assert "clip = 1.0" in rows["gradient_clipping"] and "auto: zeroshard's default" in rows["gradient_clipping"]
    assert "lr = 0.0003" in rows["optimizer.params.lr"] and "auto: --lr" in rows["optimizer.params.lr"]
    assert "offload = 'cpu'" in rows["zero_optimization.offload_param.device"]
    assert "ckpt export" in rows["zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    field = [ln[2:] for ln in convert(tmp_path, "zero3_field_names_decay", capsys).read_text().splitlines()
             if ln.startswith("# ")]
    assert any(ln.startswith("zero_optimization.gather_16bit_weights_on_model_save") and "ckpt export" in ln
               for ln in field), "the field behind the alias reads the same"
    assert "warmup_shape = 'log'" in rows["scheduler.params.warmup_type"] and "DeepSpeed" in rows["scheduler.params.warmup_type"]


TRAIN_ALL = os.environ.get("ZEROSHARD_DS_TRAIN") == "1"


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "hf_zero3_offload" or TRAIN_ALL else [
    pytest.mark.skip(reason="a train run of two or four gloo ranks each: set ZEROSHARD_DS_TRAIN=1")]) for n in SHAPES])
def test_converted_config_trains(name, tmp_path, capsys):
    toml = convert(tmp_path, name, capsys)
    run_dir = tmp_path / "run"
    done = run_cli(["train", "--config", str(toml), "--run-dir", str(run_dir), "--no-profile", "--peak-flops", "1e12"])
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records)
    ran = json.loads((run_dir / "config.json").read_text())["train"]  # the TrainConfig the ranks ran
    for key, value in load_toml(toml).items():
        assert ran[key] == value, f"{name}: train ran {key}={ran[key]!r}, the TOML says {value!r}"
    from zeroshard.trainer.config import config_from_sources
    from zeroshard.trainer.step import lr_at

    cfg = config_from_sources(toml, {})
    assert [r["lr"] for r in records] == pytest.approx([lr_at(cfg, s) for s in range(3)], rel=1e-12, abs=1e-15)
    print(f"{name}: losses {[round(r['loss'], 4) for r in records]}, lr {[r['lr'] for r in records]}")

"""DeepSpeed JSON configs, shaped like the ones people ship, converted to zeroshard TOML."""

from __future__ import annotations

import tomllib

import math

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.trainer.config import TrainConfig, config_from_sources, load_toml
from zeroshard.tools.migrate import UnsupportedKey, from_deepspeed
from zeroshard.tools.migrate.deepspeed import ADAMW_BETAS, ADAMW_EPS, SCALER

ROOT = Path(__file__).resolve().parents[2]

# Stage 1, bf16, the GPT-pretraining shape: global batch and micro-batch given, accumulation derived.
ZERO1_BF16 = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 50,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100,
                                                       "warmup_type": "linear", "cos_min_ratio": 0.1}},
}

# Stage 2 + CPU optimizer offload + fp16 dynamic loss scaling, as in the Hugging Face docs' zero2 example.
ZERO2_FP16_OFFLOAD = {
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
        "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 2,
}

# Stage 3 with optimizer state on NVMe and the stage-3 tuning knobs.
ZERO3_NVME = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "none"},
        "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "wall_clock_breakdown": False,
}

# The Hugging Face Trainer's zero3 template: "auto" everywhere the Trainer fills in.
ZERO3_HF_AUTO = {
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
}


def test_zero1_bf16_exact_toml():
    conv = from_deepspeed(ZERO1_BF16, world=8)
    assert conv.values == dict(stage=1, nproc=8, batch=256, steps=1000, lr=3e-4, lr_schedule="WarmupCosineLR",
                               min_lr=3e-4 * 0.1, warmup=100, warmup_shape="linear", warmup_min_lr=0.0,
                               weight_decay=0.1, clip=1.0, accum=4, bucket_mb=5e8 * 4 / 2**20, mp="bf16", log_every=50)
    text = conv.toml("ds.json")
    comments = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert comments[0] == "# Converted from the DeepSpeed config ds.json by `zeroshard config from-deepspeed`."
    assert comments[1:] == [f"# {ln}".rstrip() for ln in conv.table().splitlines()]
    assert text.splitlines()[len(comments):] == [  # the top-level keys, then each section's table
        "stage = 1", "nproc = 8", 'mp = "bf16"', "", "[data]", "batch = 256", "", "[optim]", "steps = 1000",
        "lr = 0.0003", 'lr_schedule = "WarmupCosineLR"', f"min_lr = {3e-4 * 0.1!r}", "warmup = 100",
        'warmup_shape = "linear"', "warmup_min_lr = 0.0", "weight_decay = 0.1",
        "clip = 1.0", "accum = 4", "", "[observe]", "log_every = 50", "", "[engine]",
        f"bucket_mb = {5e8 * 4 / 2**20!r}"]
    rows = {d.key: d for d in conv.decisions}
    assert rows["train_batch_size"].source == "the JSON" and rows["gradient_accumulation_steps"].became == "accum = 4"
    assert "derived" in rows["gradient_accumulation_steps"].source
    assert rows["scheduler.params.cos_min_ratio"].became == f"min_lr = {3e-4 * 0.1!r}"
    assert conv.notes == [
        "optimizer.params.weight_decay=0.1: zeroshard decays matrices and embeddings only, not biases or norm weights"]
    assert rows["scheduler.type"].became == "lr_schedule = 'WarmupCosineLR'", "DeepSpeed's own schedule, exactly"


def test_zero2_fp16_loss_scaling_with_cpu_offload():
    conv = from_deepspeed(ZERO2_FP16_OFFLOAD, world=4)
    assert conv.values == dict(stage=2, nproc=4, batch=2 * 4 * 4, clip=1.0, accum=4, offload="cpu",
                               bucket_mb=2e8 * 4 / 2**20, mp="fp16")
    # Our scaler's schedule is fixed: each differing DeepSpeed knob is named, with our value.
    scaler_notes = [n for n in conv.notes if n.startswith("fp16.")]
    assert [n.split("=")[0] for n in scaler_notes] == ["fp16.loss_scale_window", "fp16.hysteresis",
                                                       "fp16.min_loss_scale"]
    assert "loss_scale_window=2000" in scaler_notes[0]
    assert any(n.startswith("zero_optimization.overlap_comm=True") for n in conv.notes)


def test_zero3_nvme_optimizer_offload_becomes_disk():
    conv = from_deepspeed(ZERO3_NVME)  # all three batch keys given: the world (8) follows from them
    assert conv.values == dict(stage=3, nproc=8, batch=64, clip=0.0, accum=2, offload="disk",
                               offload_dir="/local_nvme", mp="bf16")
    noted = {n.split("=")[0] for n in conv.notes}
    assert {"zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
            "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.sub_group_size"} <= noted


def test_hf_auto_template_resolves_batch_and_keeps_default_buckets():
    conv = from_deepspeed(ZERO3_HF_AUTO, world=2)
    assert conv.values == dict(stage=3, nproc=2, batch=4 * 2 * 2, clip=1.0, accum=2, bucket_mb=25.0, mp="bf16")
    rows = {d.key: d for d in conv.decisions}
    assert rows["train_batch_size"].given == "auto" and "derived" in rows["train_batch_size"].source
    assert rows["zero_optimization.reduce_bucket_size"].source == "auto: zeroshard's default"


def test_auto_takes_the_flag_or_zeroshards_default_as_the_hf_trainer_fills_it():
    every = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
             "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
             "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                       "eps": "auto"}}}
    defaults = TrainConfig().to_dict()
    plain = from_deepspeed(every, world=2)
    assert plain.values == {"nproc": 2, **{k: defaults[k] for k in ("stage", "batch", "lr", "weight_decay", "clip",
                                                                      "accum", "bucket_mb", "mp")}}
    assert all(d.source == "auto: zeroshard's default" for d in plain.decisions if d.given == "auto"
               and d.became != "-" and not d.key.startswith("train_micro"))
    flags = dict(batch=32, accum=2, lr=3e-4, weight_decay=0.0, clip=0.5, stage=2, bucket_mb=8.0, mp="bf16")
    filled = from_deepspeed(every, world=4, flags=flags)
    assert filled.values == {"nproc": 4, **flags}
    rows = {d.key: d for d in filled.decisions}
    assert rows["gradient_clipping"].source == "auto: --clip" and rows["bf16.enabled"].became == "mp = 'bf16'"
    assert "= 4" in rows["train_micro_batch_size_per_gpu"].why, "32 / (4 ranks x 2 micro-steps)"


def test_a_flag_must_agree_with_a_value_the_json_writes():
    with pytest.raises(UnsupportedKey, match="gradient_clipping=1.0 but --clip 0.5"):
        from_deepspeed(ZERO1_BF16, world=8, flags={"clip": 0.5})
    with pytest.raises(UnsupportedKey, match="train_batch_size=256 but --batch 64"):
        from_deepspeed(ZERO1_BF16, world=8, flags={"batch": 64})
    with pytest.raises(UnsupportedKey, match="computes in bf16 but --mp fp16"):
        from_deepspeed(ZERO1_BF16, world=8, flags={"mp": "fp16"})
    # A flag that agrees, or that no key sets, is written as given.
    conv = from_deepspeed(ZERO1_BF16, world=8, flags={"clip": 1.0, "model": "small", "seq_len": 32})
    assert (conv.values["clip"], conv.values["model"], conv.values["seq_len"]) == (1.0, "small", 32)
    assert {d.source for d in conv.decisions if d.became.startswith(("model", "seq_len"))} == {"--model", "--seq-len"}


def test_drop_removes_a_refused_key_on_the_users_word():
    ds = {**ZERO1_BF16, "sequence_parallel_size": 2}
    with pytest.raises(UnsupportedKey, match="--drop sequence_parallel_size converts without it"):
        from_deepspeed(ds, world=8)
    conv = from_deepspeed(ds, world=8, drop=("sequence_parallel_size",))
    assert conv.values == from_deepspeed(ZERO1_BF16, world=8).values
    assert any(d.key == "sequence_parallel_size" and d.source == "--drop" and d.noted for d in conv.decisions)
    with pytest.raises(UnsupportedKey, match="--drop zero_optimization.nope: the DeepSpeed config has no key"):
        from_deepspeed(ZERO1_BF16, world=8, drop=("zero_optimization.nope",))


def test_warmup_lr_is_deepspeeds_own_schedule():
    ds = {**ZERO1_BF16, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 7,
                                                                      "warmup_type": "linear"}}}
    conv = from_deepspeed(ds, world=8)
    assert (conv.values["lr"], conv.values["lr_schedule"], conv.values["warmup"]) == (3e-4, "WarmupLR", 7)
    from zeroshard.trainer.step import lr_at

    cfg = config_from_sources(None, {**conv.values, "steps": 20})
    assert [lr_at(cfg, s) for s in range(7, 20)] == [3e-4] * 13, "constant after warm-up, as WarmupLR holds it"
    assert [lr_at(cfg, s) for s in range(3)] == pytest.approx([0.0, 3e-4 / 7, 2 * 3e-4 / 7]), "DeepSpeed's s / warmup"
    # Without warmup_type DeepSpeed warms up logarithmically, as HF Trainer configs leave it.
    log = {**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-4, "warmup_num_steps": 7}}}
    conv = from_deepspeed(log, world=8)
    assert conv.values["warmup_shape"] == "log" and conv.values["warmup"] == 7
    cfg = config_from_sources(None, {**conv.values, "steps": 20})
    climb = [lr_at(cfg, s) for s in range(8)]
    assert climb[1] == pytest.approx(3e-4 * math.log(2) / math.log(7)) and climb[7] == pytest.approx(3e-4)
    assert climb[2] - climb[1] > climb[6] - climb[5] > 0, "a log climb is steepest first"
    with pytest.raises(UnsupportedKey, match="warmup_type='cubic' is unsupported: WarmupLR warms up log or linear"):
        from_deepspeed({**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}}, world=8)
    decay = {**ds, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-4, "warmup_min_lr": 1e-5,
                                                                     "warmup_num_steps": 4, "total_num_steps": 12}}}
    conv = from_deepspeed(decay, world=8)
    assert {k: conv.values[k] for k in ("lr_schedule", "warmup_min_lr", "steps")} == dict(
        lr_schedule="WarmupDecayLR", warmup_min_lr=1e-5, steps=12)
    peak = {**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}}
    with pytest.raises(UnsupportedKey, match="warmup_max_lr=0.001 .DeepSpeed default. and optimizer.params.lr"):
        from_deepspeed(peak, world=8)


def test_minimal_stage0_config_takes_deepspeed_defaults():
    conv = from_deepspeed({"train_batch_size": 32})
    # DeepSpeed clips nothing unless gradient_clipping is set; zeroshard's own default would clip at 1.0.
    assert conv.values == dict(batch=32, clip=0.0, accum=1, mp="fp32")
    assert conv.notes[-1].startswith("nproc is not written")
    # An odd global batch is fine while the world is unknown: nothing says it must split over 2 ranks.
    assert from_deepspeed({"train_batch_size": 9, "gradient_accumulation_steps": 3}).values["batch"] == 9


def test_mics_and_legacy_cpu_offload():
    conv = from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                           "zero_optimization": {"stage": 3, "mics_shard_size": 2, "cpu_offload": True}}, world=4)
    assert conv.values == dict(stage=3, nproc=4, batch=32, clip=0.0, accum=4, offload="cpu", shard_size=2, mp="fp32")


def test_every_converted_config_is_read_back_by_train_config(tmp_path):
    for i, ds in enumerate([ZERO1_BF16, ZERO2_FP16_OFFLOAD, ZERO3_NVME, ZERO3_HF_AUTO]):
        conv = from_deepspeed(ds, world=None if ds is ZERO3_NVME else 2 if ds is ZERO3_HF_AUTO else 8 if
                              ds is ZERO1_BF16 else 4)
        path = tmp_path / f"{i}.toml"
        path.write_text(conv.toml("ds.json"))
        assert load_toml(path) == conv.values
        cfg = config_from_sources(path, {})
        assert {k: cfg.to_dict()[k] for k in conv.values} == conv.values


def _with(base: dict, **zero) -> dict:
    out = json.loads(json.dumps(base))
    out["zero_optimization"].update(zero)
    return out


@pytest.mark.parametrize("ds, world, named", [
    # ZeRO++ is ZeRO-3's: at stage 2 it is not the run the JSON describes, so it is refused by name.
    (_with(ZERO2_FP16_OFFLOAD, zero_quantized_weights=True), 4, "zero_quantized_weights=true is ZeRO++"),
    (_with(ZERO2_FP16_OFFLOAD, zero_quantized_gradients=True), 4, "zero_quantized_gradients=true is ZeRO++"),
    (_with(ZERO3_NVME, zero_quantized_nontrainable_weights=True), None,
     "zero_optimization.zero_quantized_nontrainable_weights=True is unsupported"),
    (_with(ZERO3_NVME, zero_quantized_weights="yes"), None, "zero_quantized_weights='yes' must be true or false"),
    ({**ZERO3_NVME, "tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": []}}}, None,
     "tensor_parallel.partition_config"),
    ({**ZERO3_NVME, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}}, None,
     "tensor_parallel.autotp_size=2 and tensor_parallel.tp.tp_size=4 differ"),
    ({**ZERO3_NVME, "tensor_parallel": {"autotp_size": 2, "frobnicate": 1}}, None,
     "unknown DeepSpeed key 'tensor_parallel.frobnicate'"),
    ({**ZERO1_BF16, "tensor_parallel": {"autotp_size": 3}}, 8, "--world 8 is not a multiple of tensor_parallel"),
    ({**ZERO1_BF16, "sequence_parallel_size": 2}, 8, "sequence_parallel_size=2 is unsupported: DeepSpeed-Ulysses"),
    (_with(ZERO2_FP16_OFFLOAD, zero_hpz_partition_size=8), 4, "zero_optimization.zero_hpz_partition_size"),
    (_with(ZERO3_NVME, offload_param={"device": "gpu"}), None, "zero_optimization.offload_param.device='gpu'"),
    (_with(ZERO2_FP16_OFFLOAD, frobnicate_buckets=True), 4, "unknown DeepSpeed key 'zero_optimization.frobnicate_buckets'"),
    ({**ZERO1_BF16, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_type": "linear", "total_num_steps": 9,
                                                                       "cos_min_ratio": "auto"}}}, 8,
     "'scheduler.params.cos_min_ratio' is \"auto\", but no zeroshard flag fills it"),
    ({**ZERO1_BF16, "bf16": {"enabled": "yes"}}, 8, "bf16.enabled='yes' must be true, false or \"auto\""),
    (_with(ZERO2_FP16_OFFLOAD, zenflow={"topk_ratio": 0.1}), 4, "zero_optimization.zenflow={'topk_ratio': 0.1} is "
     "unsupported: ZenFlow updates only the top-k"),
    ({**ZERO1_BF16, "expert_parallel": {"enabled": True, "autoep_size": 2, "top_k": 4}}, 8,
     "expert_parallel.top_k=4 is unsupported: it overrides the model's routing"),
    (_with(ZERO3_NVME, offload_param={"device": "cpu"}), None, "offload to different places"),
    ({**ZERO2_FP16_OFFLOAD, "fp16": {"enabled": True, "loss_scale": 128}}, 4, "fp16.loss_scale=128"),
    (_with(ZERO1_BF16, allgather_bucket_size=2e8), 8, "allgather_bucket_size=200000000.0 differ"),
    ({**ZERO1_BF16, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, 8, "optimizer.type='Lamb'"),
    ({**ZERO1_BF16, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}}, 8, "optimizer.params.betas"),
    ({**ZERO1_BF16, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, 8,
     "scheduler.params.total_num_steps is missing"),
    ({**ZERO1_BF16, "scheduler": {"type": "OneCycle", "params": {}}}, 8, "scheduler.type='OneCycle' is unsupported"),
    (_with(ZERO1_BF16, stage3_prefetch_bucket_size=0, prefetch_bucket_size=0), 8,
     "zero_optimization.stage3_prefetch_bucket_size and zero_optimization.prefetch_bucket_size are the same setting"),
    ({**ZERO1_BF16, "tensorboard_extra": 1}, 8, "unknown DeepSpeed key 'tensorboard_extra'"),
    ({**ZERO1_BF16, "sparse_attention": True}, 8, "sparse_attention=True is unsupported"),
    ({**ZERO1_BF16, "optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, 8, "optimizer.type='Adam'"),
    ({**ZERO1_BF16, "bfloat16": {"enabled": True}}, 8, "bf16 and bfloat16"),
    ({**ZERO1_BF16, "activation_checkpointing": {"partition_activations": True}}, 8,
     "activation_checkpointing={'partition_activations': True} is unsupported"),
    (ZERO2_FP16_OFFLOAD, None, "pass --world N"),
    (ZERO1_BF16, 3, "train_batch_size=256 is not a multiple"),
    ({**ZERO3_NVME, "train_batch_size": 60}, 8, "train_batch_size=60 != train_micro_batch_size_per_gpu=4"),
])
def test_unsupported_or_unknown_key_is_named(ds, world, named):
    with pytest.raises(UnsupportedKey) as info:
        from_deepspeed(ds, world=world)
    assert named in str(info.value)
    assert "\n" not in str(info.value)


def test_zero_plus_plus_quantized_comm_maps_to_comm_quant():
    """qwZ and qgZ are zeroshard's comm_quant weights and grads (int8 blocks, fp32 scales, exact masters)."""
    both = from_deepspeed(_with(ZERO3_NVME, zero_quantized_weights=True, zero_quantized_gradients=True))
    assert both.values == {**from_deepspeed(ZERO3_NVME).values, "comm_quant": "weights,grads"}
    assert any(n.startswith("zero_optimization.zero_quantized_gradients=True: int8 blocks") and "int4" in n
               for n in both.notes)
    assert from_deepspeed(_with(ZERO3_NVME, zero_quantized_weights=True)).values["comm_quant"] == "weights"
    assert from_deepspeed(_with(ZERO3_NVME, zero_quantized_gradients=True)).values["comm_quant"] == "grads"
    cfg = config_from_sources(None, both.values)  # what train runs: qwZ + qgZ on the stage-3 run
    assert (cfg.stage, cfg.comm_quant) == (3, "weights,grads")


def test_autotp_size_maps_to_tp_and_the_batch_counts_data_parallel_ranks():
    """DeepSpeed's train_batch_size = micro x accumulation x data-parallel ranks (world / tp), as
    zeroshard's global batch is: 8 ranks at autotp 2 are 4 data-parallel ranks of 4 x 2 sequences."""
    ds = {**ZERO1_BF16, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True, "preset_model": "llama"}}
    conv = from_deepspeed(ds, world=8)
    assert (conv.values["tp"], conv.values["nproc"], conv.values["batch"], conv.values["accum"]) == (2, 8, 32, 2)
    assert {n.split("=")[0] for n in conv.notes} >= {"tensor_parallel.tp_overlap_comm", "tensor_parallel.preset_model"}
    # All three batch keys given: the data-parallel ranks follow from them, the world is tp times that.
    alone = from_deepspeed({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                            "tensor_parallel": {"tp": {"tp_size": 4}}})
    assert (alone.values["tp"], alone.values["nproc"]) == (4, 16)
    # autotp 0 or 1 is no tensor parallelism: nothing written.
    assert "tp" not in from_deepspeed({**ZERO1_BF16, "tensor_parallel": {"autotp_size": 1}}, world=8).values
    cfg = config_from_sources(None, conv.values)
    assert (cfg.tp, cfg.nproc // cfg.tp) == (2, 4)


def test_param_offload_maps_to_the_one_offload_target():
    """offload_param moves the 16-bit param shards to the host in DeepSpeed; zeroshard offloads the fp32
    masters and optimizer state instead (the same values trained), so both map to offload."""
    both = _with(ZERO3_NVME, offload_param={"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5})
    conv = from_deepspeed(both)
    assert conv.values == from_deepspeed(ZERO3_NVME).values
    row = next(d for d in conv.decisions if d.key == "zero_optimization.offload_param.device")
    assert row.became == "offload = 'disk'" and row.noted and "compute-dtype param shard stays" in row.why
    cpu = from_deepspeed({"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert cpu.values["offload"] == "cpu"
    assert "stage 3 only" in next(d.why for d in cpu.decisions if d.key.endswith("offload_param.device"))


def test_switched_off_features_are_accepted():
    ds = _with(ZERO2_FP16_OFFLOAD, zero_quantized_weights=False, zero_quantized_gradients=False,
               zero_quantized_nontrainable_weights=False, zero_hpz_partition_size=1)
    ds["tensor_parallel"] = {"autotp_size": 0}
    assert from_deepspeed(ds, world=4).values == from_deepspeed(ZERO2_FP16_OFFLOAD, world=4).values


def test_constants_match_the_runtime():
    import zeroshard.trainer.train as train
    from zeroshard.runtime.scaler import ShardedGradScaler

    assert ADAMW_BETAS == train.BETAS and ADAMW_EPS == 1e-8
    defaults = ShardedGradScaler.__init__.__kwdefaults__
    assert 2 ** SCALER["initial_scale_power"] == defaults["init_scale"]
    assert SCALER["loss_scale_window"] == defaults["growth_interval"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "config", "from-deepspeed", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command in this process (the `main` the console script calls): an interpreter start
    less, seconds on a loaded machine. test_cli_writes_toml_that_train_reads runs it as a subprocess."""
    from zeroshard.cli.main import main

    capsys.readouterr()
    rc = main(["config", "from-deepspeed", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def test_cli_writes_toml_that_train_reads(tmp_path, capsys):
    src = tmp_path / "ds_config.json"
    src.write_text(json.dumps(ZERO2_FP16_OFFLOAD))
    out = tmp_path / "run.toml"
    done = _cli(str(src), "--world", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "fp16.hysteresis" in done.stderr and f"zeroshard train --config {out}" in done.stderr
    assert config_from_sources(out, {}).stage == 2
    assert load_toml(out) == from_deepspeed(ZERO2_FP16_OFFLOAD, world=4).values
    printed = _main(capsys, str(src), "--world", "4")
    assert printed.returncode == 0 and printed.stdout == out.read_text()


def test_cli_refuses_by_name_and_strict_refuses_notes(tmp_path, capsys):
    src = tmp_path / "ds_config.json"
    src.write_text(json.dumps(_with(ZERO2_FP16_OFFLOAD, zero_quantized_nontrainable_weights=True)))
    done = _main(capsys, str(src), "--world", "4")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("zeroshard config: error: DeepSpeed key "
                                  "zero_optimization.zero_quantized_nontrainable_weights=True")
    src.write_text(json.dumps(ZERO2_FP16_OFFLOAD))
    strict = _main(capsys, str(src), "--world", "4", "--strict")
    assert strict.returncode == 1 and "--strict: fp16.loss_scale_window=1000" in strict.stderr
    missing = _main(capsys, str(tmp_path / "nope.json"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_per_tensor_optimizer_types_map_to_zeroshards_owners():
    muon = from_deepspeed({**ZERO1_BF16, "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.9,
                                                                                   "weight_decay": 0.05}}}, world=8)
    assert muon.values["optimizer"] == {"name": "muon", "momentum": 0.9}
    assert muon.values["lr"] == 0.02 and muon.values["weight_decay"] == 0.05
    assert 'optimizer = {name = "muon", momentum = 0.9}' in muon.toml("ds.json").splitlines()
    assert tomllib.loads(muon.toml("ds.json"))["optim"]["optimizer"] == {"name": "muon", "momentum": 0.9}  # train reads it
    ada = from_deepspeed({**ZERO1_BF16, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}}, world=8)
    assert ada.values["optimizer"] == "adafactor" and ada.values["lr"] == 1e-3
    with pytest.raises(UnsupportedKey, match="unknown DeepSpeed key|unsupported"):
        from_deepspeed({**ZERO1_BF16, "optimizer": {"type": "Muon", "params": {"bogus": 1}}}, world=8)
    with pytest.raises(UnsupportedKey, match="per_tensor = true"):
        from_deepspeed({**ZERO1_BF16, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, world=8)

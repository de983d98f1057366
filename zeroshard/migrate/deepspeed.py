"""A DeepSpeed JSON config -> the TrainConfig keys `zeroshard train --config` reads.

Every key is accounted for: it is mapped to a TrainConfig key, accepted with a note saying what
zeroshard does instead (a tuning knob whose job our runtime does its own way, never one that
changes the numbers), or refused with an `UnsupportedKey` that names it. An unknown key is refused
too: silently dropping a setting would train a different run from the one the user asked for.

Keys left out of the JSON take DeepSpeed's defaults, not ours, where the two differ in numerics
(DeepSpeed clips no gradients unless `gradient_clipping` is set, so `clip = 0.0` is written).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from zeroshard.config import TrainConfig, field_names
from zeroshard.tune import tomlfile

ADAMW_BETAS = (0.9, 0.95)
"""The AdamW betas `zeroshard train` uses (zeroshard/train.py BETAS; kept equal by a unit test)."""
ADAMW_EPS = 1e-8
SCALER = dict(initial_scale_power=16, loss_scale_window=2000, hysteresis=1, min_loss_scale=None)
"""zs.ShardedGradScaler's fixed schedule in DeepSpeed's words: 2**16 to start, x2 after 2000 clean
steps, x0.5 at every overflow (no hysteresis), no floor."""

_MISSING = object()


class UnsupportedKey(ValueError):
    """A DeepSpeed key that zeroshard cannot honour; the message names it and says what to do."""


@dataclass
class Conversion:
    values: dict[str, Any]
    """TrainConfig keys, in TrainConfig's field order."""
    notes: list[str] = field(default_factory=list)
    """One line per DeepSpeed key accepted without a TrainConfig key of its own, saying why."""

    def toml(self, source: str) -> str:
        header = [f"Converted from the DeepSpeed config {source} by `zeroshard config from-deepspeed`."]
        header += [f"note: {n}" for n in self.notes]
        return tomlfile.dumps(self.values, header="\n".join(header))


class _Section:
    """One JSON object whose keys are taken one at a time; what is left at the end is unknown."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise UnsupportedKey(f"DeepSpeed key {path!r} must be a JSON object, got {data!r}")
        self.data, self.path = dict(data), path
        self.taken: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def take(self, key: str, default: Any = None) -> Any:
        self.taken.add(key)
        return self.data.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.data

    def concrete(self, key: str, default: Any = None) -> Any:
        """A value that changes the numbers: "auto" is refused, since only the HF Trainer resolves it."""
        value = self.take(key, default)
        if value == "auto":
            raise UnsupportedKey(f"DeepSpeed key {self.name(key)!r} is \"auto\", which only the Hugging Face "
                                 "Trainer can resolve (from its own arguments); write the value in the JSON")
        return value

    def section(self, key: str) -> _Section | None:
        value = self.take(key)
        return None if value is None else _Section(value, self.name(key))

    def finish(self) -> None:
        for key in self.data:
            if key not in self.taken:
                raise UnsupportedKey(f"unknown DeepSpeed key {self.name(key)!r}: zeroshard does not know what it "
                                     "would change, so it refuses to drop it; remove it from the JSON if it is unused")


def _refuse(section: _Section, key: str, why: str, *, off: tuple = (None, False, 0)) -> None:
    """A feature zeroshard lacks: fine while switched off, refused by name when on."""
    value = section.take(key)
    # `True == 1` in Python: compare bools only with bools, or "feature: true" would pass as 1.
    if not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off):
        raise UnsupportedKey(f"DeepSpeed key {section.name(key)}={value!r} is unsupported: {why}")


class _Builder:
    def __init__(self, world: int | None) -> None:
        self.world = world
        self.values: dict[str, Any] = {}
        self.notes: list[str] = []

    def note(self, section: _Section, key: str, why: str) -> None:
        if section.has(key):
            self.notes.append(f"{section.name(key)}={section.take(key)!r}: {why}")


def from_deepspeed(ds: Mapping[str, Any], *, world: int | None = None) -> Conversion:
    """Convert a parsed DeepSpeed config. `world` (ranks in the run) is needed to turn a per-GPU
    micro-batch into our global batch, unless all three batch keys are given."""
    if world is not None and world < 1:
        raise ValueError(f"world={world} must be >= 1")
    root, out = _Section(ds, ""), _Builder(world)
    _tensor_parallel(root, out)  # first: with tp the batch keys count data-parallel ranks, not the world
    _batch(root, out)
    _precision(root, out)
    zero = root.section("zero_optimization")
    if zero is not None:
        _zero(zero, out)
        zero.finish()
    clip = root.concrete("gradient_clipping", 0.0)
    out.values["clip"] = float(clip)  # DeepSpeed clips nothing unless asked; ours defaults to 1.0
    _optimizer(root, out)
    _scheduler(root, out)
    _misc(root, out)
    root.finish()
    order = {name: i for i, name in enumerate(field_names())}
    values = dict(sorted(out.values.items(), key=lambda kv: order[kv[0]]))
    if "nproc" not in values:
        out.notes.append("world size unknown, so nproc is not written: give zeroshard train --nproc N "
                         "(or run it under torchrun)")
    try:
        # With the world unknown, check what does not depend on it (the smallest world a tp fits in).
        TrainConfig(**{"nproc": values.get("tp", 1), **values})
    except ValueError as e:
        raise ValueError(f"the converted config is not a valid zeroshard run: {e}") from e
    return Conversion(values, out.notes)


def _quantized_comm(zero: _Section, out: _Builder) -> None:
    """ZeRO++ qwZ and qgZ -> comm_quant: blockwise int8 with an fp32 scale per block on the wire, the
    masters (and the optimizer) exact. zeroshard's grads go as int8 where qgZ sends int4, so they
    round less; DeepSpeed's block sizes are its own, zeroshard's comm_quant_block (256) is kept."""
    on = {}
    for key, part in (("zero_quantized_weights", "weights"), ("zero_quantized_gradients", "grads")):
        value = zero.concrete(key, False)
        if not isinstance(value, bool):
            raise UnsupportedKey(f"DeepSpeed key {zero.name(key)}={value!r} must be true or false")
        if value:
            on[key] = part
    if on and out.values.get("stage") != 3:
        # ZeRO++ quantizes ZeRO-3's all-gather and reduce-scatter; a lower stage is not the run it describes.
        raise UnsupportedKey(f"DeepSpeed key zero_optimization.{next(iter(on))}=true is ZeRO++, which quantizes "
                             f"ZeRO-3's collectives, but stage is {out.values.get('stage')}; set stage 3 (zeroshard "
                             "also quantizes stage-2 grads: write comm_quant = 'grads' yourself)")
    if on:
        out.values["comm_quant"] = ",".join(on.values())
        out.notes.append(f"{' and '.join(on)}: comm_quant={out.values['comm_quant']!r}, int8 blocks with fp32 "
                         "scales on the wire" + ("; qgZ sends grads as int4, zeroshard's int8 rounds them less"
                                                 if "grads" in on.values() else ""))


def _tensor_parallel(root: _Section, out: _Builder) -> None:
    """AutoTP training (``tensor_parallel.autotp_size``) -> tp: zeroshard splits its GPT and HF Llama
    with a ready plan by the model's class (docs/tensor_parallel.md), as AutoTP's presets do."""
    section = root.section("tensor_parallel")
    if section is None:
        return
    size = section.concrete("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise UnsupportedKey(f"DeepSpeed key {section.name('autotp_size')}={size!r} must be a non-negative integer")
    nested = section.section("tp")  # the older spelling, {"tp": {"tp_size": N}}
    if nested is not None:
        old = nested.concrete("tp_size", size)
        if size and old != size:
            raise UnsupportedKey(f"DeepSpeed keys {section.name('autotp_size')}={size} and {nested.name('tp_size')}="
                                 f"{old} differ; keep one")
        size = old
        nested.finish()
    if size > 1:
        out.values["tp"] = size
    _refuse(section, "partition_config", "a custom AutoTP layer split; zeroshard splits its GPT and HF Llama by a "
            "ready plan (from Python, zs.tensor_parallel(model, plan=fn) takes your own)", off=(None, {}))
    _refuse(section, "tp_grain_size", "zeroshard splits every head and MLP column evenly over the tp ranks",
            off=(None, 1))
    out.note(section, "preset_model", "zeroshard picks the plan by the model's class (GPT or LlamaForCausalLM)")
    out.note(section, "tp_overlap_comm", "zeroshard's tp all-reduces block the next op (DTensor's); ZeRO's "
             "collectives are the ones it overlaps")
    out.note(section, "dtype", "zeroshard's tp runs in the compute dtype (mp)")
    out.note(section, "keep_module_on_host", "zeroshard splits the model where it was built (or on meta)")
    section.finish()


def _batch(root: _Section, out: _Builder) -> None:
    """DeepSpeed's train_batch_size = micro-batch x accumulation x data-parallel ranks. With tensor
    parallelism those are world / tp (a tp group shares its micro-batch), as zeroshard's global batch is."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {k: root.take(k) for k in keys}
    auto = [k for k, v in given.items() if v == "auto"]
    total, micro, accum = (None if given[k] == "auto" else given[k] for k in keys)
    tp = out.values.get("tp", 1)
    if out.world is not None and out.world % tp:
        raise UnsupportedKey(f"--world {out.world} is not a multiple of tensor_parallel.autotp_size={tp}; "
                             "give the number of ranks in all (data-parallel x tp)")
    dp = None if out.world is None else out.world // tp
    ranks = "world" if tp == 1 else "data-parallel ranks"
    if total is not None and micro is not None and accum is not None and dp is None:
        if total % (micro * accum):
            raise UnsupportedKey(f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu="
                                 f"{micro} x gradient_accumulation_steps={accum}; fix one of the three")
        dp = total // (micro * accum)
    need_world = micro is not None and (total is None or accum is None)
    if need_world and dp is None:
        raise UnsupportedKey("train_micro_batch_size_per_gpu needs the world size to give zeroshard's global "
                             "batch: pass --world N (the number of ranks)")
    if total is None and micro is None:
        raise UnsupportedKey("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu"
                             " (or both are \"auto\"); write one of them in the JSON")
    if micro is None:
        accum = accum or 1
    elif total is None:
        accum = accum or 1
        total = micro * accum * dp
    elif accum is None:
        if total % (micro * dp):
            raise UnsupportedKey(f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu="
                                 f"{micro} x {ranks} {dp}; fix the batch keys or --world")
        accum = total // (micro * dp)
    elif total != micro * accum * dp:
        raise UnsupportedKey(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                             f"gradient_accumulation_steps={accum} x {ranks} {dp}; fix the batch keys or --world")
    out.values.update(batch=total, accum=accum)
    if dp is not None:
        out.values["nproc"] = dp * tp
    for key in auto:
        out.notes.append(f"{key}='auto': derived from the other batch keys and the world size")


def _precision(root: _Section, out: _Builder) -> None:
    if root.has("bf16") and root.has("bfloat16"):
        raise UnsupportedKey("DeepSpeed keys bf16 and bfloat16 are the same setting, given twice; keep bf16")
    bf16 = root.section("bf16") or root.section("bfloat16")
    fp16 = root.section("fp16")
    on = []
    if bf16 is not None:
        if bf16.concrete("enabled", False):
            on.append("bf16")
        bf16.finish()
    if fp16 is not None:
        if fp16.concrete("enabled", False):
            on.append("fp16")
            _loss_scaling(fp16, out)
        else:
            fp16.taken.update(fp16.data)  # loss-scaling keys of a disabled fp16 change nothing
        fp16.finish()
    if len(on) == 2:
        raise UnsupportedKey("DeepSpeed keys bf16.enabled and fp16.enabled are both true; enable one")
    out.values["mp"] = on[0] if on else "fp32"
    _refuse(root, "amp", "apex AMP; use \"bf16\": {\"enabled\": true} or fp16 instead", off=(None, {"enabled": False}))
    dtypes = root.section("data_types")
    if dtypes is not None:
        _refuse(dtypes, "grad_accum_dtype", "zeroshard accumulates gradients in fp32", off=(None, "fp32"))
        dtypes.finish()
    _refuse(root, "communication_data_type", "zeroshard reduces gradients in fp32", off=(None, "fp32"))


def _loss_scaling(fp16: _Section, out: _Builder) -> None:
    """DeepSpeed's dynamic loss scaler -> zs.ShardedGradScaler, whose schedule is fixed."""
    if fp16.concrete("loss_scale", 0) != 0:
        raise UnsupportedKey(f"DeepSpeed key {fp16.name('loss_scale')}={fp16.data['loss_scale']!r} is a static loss "
                             "scale, which zeroshard lacks (fp16 uses a dynamic ShardedGradScaler); set it to 0")
    _refuse(fp16, "fp16_master_weights_and_grads", "zeroshard keeps fp32 masters and fp32 gradients")
    _refuse(fp16, "auto_cast", "zeroshard casts params (mp), not inputs")
    for key, ours in SCALER.items():
        value = fp16.concrete(key)
        if value is not None and value != ours:
            out.notes.append(f"{fp16.name(key)}={value!r}: zeroshard's fp16 loss scaler uses {key}={ours!r}; "
                             "only the steps skipped around an overflow can differ")
    fp16.take("consecutive_hysteresis")


def _zero(zero: _Section, out: _Builder) -> None:
    stage = zero.concrete("stage", 0)
    out.values["stage"] = stage
    _offload(zero, out)
    _buckets(zero, out)
    mics = zero.concrete("mics_shard_size", -1)
    if mics not in (-1, 0, None):
        out.values["shard_size"] = mics  # MiCS: shard inside groups, replicate across them
    _quantized_comm(zero, out)
    _refuse(zero, "zero_quantized_nontrainable_weights", "ZeRO++ keeps frozen weights stored quantized; zeroshard "
            "quantizes what it sends (comm_quant), never what it stores")
    _refuse(zero, "zero_hpz_partition_size", "ZeRO++ hierarchical secondary partition (hpZ); the nearest "
            "zeroshard has is hybrid sharding, shard_size, which changes what is replicated", off=(None, 0, 1))
    _refuse(zero, "zeropp_loco_param", "ZeRO++ LoCo gradient compression", off=(None, False, {}))
    _refuse(zero, "cpu_offload_params", "parameter offload (see offload_param)")
    own_way = {
        "overlap_comm": "zeroshard always overlaps reductions with backward",
        "contiguous_gradients": "zeroshard's gradients always live in contiguous flat buffers",
        "reduce_scatter": "zeroshard picks the gradient collective for each stage itself",
        "allgather_partitions": "zeroshard all-gathers its param shards",
        "round_robin_gradients": "a DeepSpeed CPU-offload copy order; zeroshard copies per unit",
        "load_from_fp32_weights": "zeroshard checkpoints always hold fp32 masters",
        "elastic_checkpoint": "zeroshard checkpoints load at any world size and stage",
        "ignore_unused_parameters": "zeroshard reduces unused params' zero gradients without error",
        "sub_group_size": "optimizer step chunking; zeroshard steps per unit (disk offload: slice_mb)",
        "stage3_prefetch_bucket_size": "zeroshard prefetches whole units (prefetch, default 1), not bytes",
        "prefetch_bucket_size": "zeroshard prefetches whole units (prefetch, default 1), not bytes",
        "stage3_max_live_parameters": "zeroshard bounds live params by prefetch and reshard_after_forward",
        "stage3_max_reuse_distance": "zeroshard bounds live params by prefetch and reshard_after_forward",
        "stage3_param_persistence_threshold": "zeroshard shards every unit's params, small ones included",
        "stage3_model_persistence_threshold": "zeroshard shards every unit's params, small ones included",
        "stage3_gather_16bit_weights_on_model_save": "zeroshard saves sharded; `zeroshard ckpt export` "
                                                     "writes whole weights",
        "stage3_gather_fp16_weights_on_model_save": "zeroshard saves sharded; `zeroshard ckpt export` "
                                                    "writes whole weights",
        "mics_hierarchical_params_gather": "zeroshard gathers within the shard group (shard_size) directly",
        "memory_efficient_linear": "zeroshard uses torch's own linear",
    }
    for key, why in own_way.items():
        out.note(zero, key, why)


def _offload(zero: _Section, out: _Builder) -> None:
    if zero.take("cpu_offload"):  # the pre-0.3.16 spelling of offload_optimizer.device = cpu
        out.values["offload"] = "cpu"
    opt = zero.section("offload_optimizer")
    if opt is not None:
        device = opt.concrete("device", "none")
        if device == "cpu":
            out.values["offload"] = "cpu"
        elif device == "nvme":
            path = opt.concrete("nvme_path")
            if not path:
                raise UnsupportedKey(f"{opt.name('device')}='nvme' needs {opt.name('nvme_path')} (zeroshard's offload_dir)")
            out.values.update(offload="disk", offload_dir=str(path))
        elif device not in ("none", None):
            raise UnsupportedKey(f"DeepSpeed key {opt.name('device')}={device!r} is unsupported; use cpu, nvme or none")
        _refuse(opt, "ratio", "partial optimizer offload (ZeRO-Offload++ twin flow) offloads everything or "
                "nothing in zeroshard", off=(None, 1, 1.0))
        out.note(opt, "pin_memory", "zeroshard pins host buffers when a GPU is present")
        for key in ("buffer_count", "fast_init", "pipeline", "pipeline_read", "pipeline_write"):
            out.note(opt, key, "a DeepSpeed offload I/O tuning knob; zeroshard's disk offload streams slice by slice")
        opt.finish()
    param = zero.section("offload_param")
    if param is not None:
        device = param.concrete("device", "none")
        if device not in ("none", None):
            raise UnsupportedKey(f"DeepSpeed key {param.name('device')}={device!r} is unsupported: zeroshard offloads "
                                 "fp32 masters and optimizer state (offload_optimizer), while each rank's share of "
                                 "the compute-dtype params stays on the device; remove offload_param")
        param.taken.update(param.data)  # the knobs of a disabled param offload change nothing
        param.finish()


def _buckets(zero: _Section, out: _Builder) -> None:
    """DeepSpeed buckets count elements; zeroshard's bucket_mb counts MiB of fp32 gradients."""
    sizes = {}
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = zero.take(key)
        if value == "auto":
            out.notes.append(f"{zero.name(key)}='auto': zeroshard's default bucket_mb is used")
        elif value is not None:
            sizes[key] = value
    if len(set(sizes.values())) > 1:
        raise UnsupportedKey(f"DeepSpeed keys reduce_bucket_size={sizes['reduce_bucket_size']} and "
                             f"allgather_bucket_size={sizes['allgather_bucket_size']} differ, but zeroshard has one "
                             "bucket size (bucket_mb); set them equal")
    if sizes:
        elements = int(next(iter(sizes.values())))
        out.values["bucket_mb"] = elements * 4 / 2**20  # the same elements per bucket, reduced in fp32


def _optimizer(root: _Section, out: _Builder) -> None:
    opt = root.section("optimizer")
    if opt is None:
        out.notes.append("no optimizer section: zeroshard train's AdamW with its own lr and weight_decay")
        return
    kind = str(opt.concrete("type", "")).lower()
    params = opt.section("params") or _Section({}, opt.name("params"))
    if kind not in ("adam", "adamw") or (kind == "adam" and params.take("adam_w_mode") is False):
        raise UnsupportedKey(f"DeepSpeed key {opt.name('type')}={opt.data.get('type')!r} is unsupported: zeroshard "
                             "train steps AdamW (decoupled weight decay); from Python, zs.optimizer takes any "
                             "elementwise torch optimizer")
    params.take("adam_w_mode")
    _refuse(params, "bias_correction", "torch's AdamW always corrects the moments' bias", off=(None, True))
    _refuse(params, "amsgrad", "zeroshard train's AdamW runs without amsgrad")
    for key in ("lr", "weight_decay"):
        value = params.concrete(key)
        if value is not None:
            out.values[key] = float(value)
    betas = params.concrete("betas")
    if betas is not None and tuple(betas) != ADAMW_BETAS:
        raise UnsupportedKey(f"DeepSpeed key {params.name('betas')}={betas!r} is unsupported: zeroshard train's "
                             f"AdamW uses betas {list(ADAMW_BETAS)}")
    eps = params.concrete("eps")
    if eps is not None and eps != ADAMW_EPS:
        raise UnsupportedKey(f"DeepSpeed key {params.name('eps')}={eps!r} is unsupported: zeroshard train's AdamW "
                             f"uses eps {ADAMW_EPS}")
    for key in ("torch_adam", "fused"):
        out.note(params, key, "zeroshard steps torch.optim.AdamW; the update is the same")
    if "weight_decay" in out.values:
        out.notes.append("weight_decay: zeroshard decays matrices and embeddings only, not biases or norm weights")
    params.finish()
    opt.finish()


def _scheduler(root: _Section, out: _Builder) -> None:
    sched = root.section("scheduler")
    if sched is None:
        return
    kind = sched.concrete("type")
    params = sched.section("params") or _Section({}, sched.name("params"))
    if kind != "WarmupCosineLR":
        raise UnsupportedKey(f"DeepSpeed key {sched.name('type')}={kind!r} is unsupported: zeroshard train runs linear "
                             "warm-up then cosine decay, which is WarmupCosineLR with warmup_type 'linear'")
    if params.take("warmup_type", "log") != "linear":  # DeepSpeed's default is "log"
        raise UnsupportedKey(f"DeepSpeed key {params.name('warmup_type')}={params.data.get('warmup_type', 'log')!r} "
                             "is unsupported: zeroshard warms up linearly; set it to \"linear\"")
    _refuse(params, "last_batch_iteration", "zeroshard resumes its schedule from checkpoints", off=(None, -1))
    _refuse(params, "warmup_min_ratio", "zeroshard warms up from 0", off=(None, 0, 0.0))
    steps = params.concrete("total_num_steps")
    if steps is None:
        raise UnsupportedKey(f"{params.name('total_num_steps')} is missing; zeroshard needs it as steps")
    out.values.update(steps=int(steps), warmup=int(params.concrete("warmup_num_steps", 0)))
    ratio = params.concrete("cos_min_ratio", 1e-4)  # DeepSpeed's default
    out.values["min_lr"] = out.values.get("lr", TrainConfig().lr) * float(ratio)
    out.notes.append("scheduler WarmupCosineLR: zeroshard's warm-up reaches lr one step earlier "
                     "(lr*(s+1)/warmup rather than lr*s/warmup)")
    params.finish()
    sched.finish()


def _misc(root: _Section, out: _Builder) -> None:
    print_every = root.concrete("steps_per_print")
    if print_every is not None:
        out.values["log_every"] = int(print_every)
    _refuse(root, "prescale_gradients", "zeroshard divides by the world size after reducing, in fp32")
    _refuse(root, "gradient_predivide_factor", "zeroshard divides by the world size after reducing, in fp32",
            off=(None, 1, 1.0))
    for key, why in {
        "sparse_attention": "DeepSpeed sparse-attention kernels", "pipeline": "pipeline parallelism",
        "sequence_parallel_size": "DeepSpeed-Ulysses sequence parallelism (all-to-all over attention heads); "
                                  "zeroshard's tp splits each block's matmuls instead",
        "compression_training": "DeepSpeed compression", "data_efficiency": "DeepSpeed data sampling",
        "curriculum_learning": "DeepSpeed curriculum learning", "elasticity": "DeepSpeed elastic batch sizes",
        "activation_checkpointing": "it configures deepspeed.checkpointing, which the model calls itself; "
                                    "zeroshard's checkpointing key (none, all, every:K, sqrt) does the job",
    }.items():
        _refuse(root, key, why, off=(None, False, {}, {"enabled": False}, 1))
    own_way = {
        "wall_clock_breakdown": "zeroshard's profile (on by default) breaks every step down",
        "memory_breakdown": "zeroshard's profile records memory per step",
        "flops_profiler": "zeroshard's profile reports MFU",
        "tensorboard": "zeroshard writes RUN_DIR/metrics.jsonl; `zeroshard report` renders it",
        "wandb": "zeroshard writes RUN_DIR/metrics.jsonl; `zeroshard report` renders it",
        "csv_monitor": "zeroshard writes RUN_DIR/metrics.jsonl; `zeroshard report` renders it",
        "zero_allow_untested_optimizer": "zeroshard checks its optimizer itself",
        "zero_force_ds_cpu_optimizer": "zeroshard's cpu offload steps torch's optimizer on the host",
        "dump_state": "a DeepSpeed debugging print",
    }
    for key, why in own_way.items():
        out.note(root, key, why)

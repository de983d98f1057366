"""DeepSpeed's ``zero_optimization`` section -> the stage and the engine's knobs.

The stage, offload (optimizer and param, cpu or nvme), bucket sizes, prefetch, MiCS shard groups
and ZeRO++'s quantized collectives map to TrainConfig keys; tuning knobs whose job zeroshard's
runtime does its own way are noted; ZeRO features zeroshard lacks (hpZ, LoCo, ZenFlow) are refused
by name. Stage rules are asked of the runtime's StagePolicy, never restated here.
"""

from __future__ import annotations

from typing import Any

from zeroshard.tools.migrate.decisions import AUTO, FROM_JSON, FROM_NOTE, FROM_ZS_DEFAULT, UnsupportedKey
from zeroshard.tools.migrate.reader import Builder, Section, default_of, flag_name, stage_policy

# Tuning knobs whose job zeroshard's runtime does its own way; none changes a number.
_ZERO_OWN_WAY = {
    "overlap_comm": "zeroshard always overlaps reductions with backward",
    "contiguous_gradients": "zeroshard's gradients always live in contiguous flat buffers",
    "reduce_scatter": "zeroshard picks the gradient collective for each stage itself",
    "allgather_partitions": "zeroshard all-gathers its param shards",
    "round_robin_gradients": "a DeepSpeed CPU-offload copy order; zeroshard copies per unit",
    "load_from_fp32_weights": "zeroshard checkpoints always hold fp32 masters",
    "elastic_checkpoint": "zeroshard checkpoints load at any world size and stage",
    "ignore_unused_parameters": "zeroshard reduces unused params' zero gradients without error",
    "sub_group_size": "optimizer step chunking; zeroshard steps per unit (disk offload: slice_mb)",
    "max_live_parameters": "zeroshard bounds live params by prefetch and reshard_after_forward",
    "max_reuse_distance": "zeroshard bounds live params by prefetch and reshard_after_forward",
    "param_persistence_threshold": "zeroshard shards every unit's params, small ones included",
    "model_persistence_threshold": "zeroshard shards every unit's params, small ones included",
    "module_granularity_threshold": "zeroshard gathers one unit (a block) at a time",
    "use_all_reduce_for_fetch_params": "zeroshard all-gathers param shards",
    "allgather_sequential": "zeroshard all-gathers each unit's flat buffer at once",
    "use_multi_rank_bucket_allreduce": "zeroshard reduces each bucket once, over its own groups",
    "leaf_module": "zeroshard's units are the model's blocks (a unit is gathered whole)",
    "legacy_stage1": "an older DeepSpeed stage-1 code path; the same math",
    "pipeline_loading_checkpoint": "zeroshard loads checkpoints into shards directly",
    "override_module_apply": "zeroshard replays a model's init into its shards itself",
    "enable_sanity_checks": "a DeepSpeed debugging switch",
    "save_muon_momentum_buffer_in_memory": "zeroshard keeps Muon's state on its owner rank",
    "cpu_offload_use_pin_memory": "zeroshard pins host buffers when a GPU is present",
    "mics_hierarchical_params_gather": "zeroshard gathers within the shard group (shard_size) directly",
    "memory_efficient_linear": "zeroshard uses torch's own linear",
    "log_trace_cache_warnings": "a DeepSpeed log switch",
}
_EXPORT = ("zeroshard checkpoints are sharded; the whole 16-bit weights this writes at each save are "
           "`zeroshard ckpt export CKPT --hf OUT --dtype bf16` (or `zeroshard ckpt export CKPT model.safetensors`)")


def convert_zero(zero: Section, out: Builder) -> None:
    out.map(zero, "stage", "stage", absent=0)
    _offload(zero, out)
    _buckets(zero, out)
    _prefetch(zero, out)
    mics = zero.concrete("mics_shard_size", -1)
    if mics not in (-1, 0, None):
        out.set(zero.name("mics_shard_size"), mics, "shard_size", mics, FROM_JSON)  # MiCS: shard in groups
    _quantized_comm(zero, out)
    # The field behind the stage3_gather_16bit_... alias, and its deprecated fp16 spelling.
    for key in ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
        if zero.has(key):
            given = zero.take(key)
            out.row(zero.name(key), given, "export" if given else "-", FROM_NOTE, _EXPORT if given else
                    "no whole-weights file at save; zeroshard's sharded checkpoints are the same", noted=True)
    out.refuse(zero, "zero_quantized_nontrainable_weights", "ZeRO++ keeps frozen weights stored quantized; zeroshard "
            "quantizes what it sends (comm_quant), never what it stores")
    out.refuse(zero, "zero_hpz_partition_size", "ZeRO++ hierarchical secondary partition (hpZ); the nearest "
            "zeroshard has is hybrid sharding, shard_size, which changes what is replicated", off=(None, 0, 1))
    out.refuse(zero, "zeropp_loco_param", "ZeRO++ LoCo gradient compression", off=(None, False, {}))
    out.refuse(zero, "zenflow", "ZenFlow updates only the top-k gradient columns on the device each step and applies "
            "the rest later on the CPU, from stale gradients; zeroshard updates every param every step from its "
            "own step's gradients. The nearest is offload = 'cpu' (offload_optimizer), the whole optimizer step on "
            "the host, exact", off=(None, False, {}, {"enabled": False}))
    for key, why in _ZERO_OWN_WAY.items():
        out.note(zero, key, why)


def _offload_target(section: Section, out: Builder, what: str, why: str = "") -> None:
    """offload_optimizer / offload_param -> offload: cpu (host memory) or nvme (disk files)."""
    device = section.concrete("device", "none")
    if device in ("none", None):
        section.take_all()  # the knobs of a disabled offload change nothing
        out.row(section.name("device"), device, "-", FROM_JSON, f"no {what} offload")
        return
    if device == "cpu":
        kind, directory = "cpu", None
        out.note(section, "nvme_path", "read only with device 'nvme'")
    elif device == "nvme":
        directory = section.concrete("nvme_path")
        if not directory:
            raise UnsupportedKey(f"{section.name('device')}='nvme' needs {section.name('nvme_path')} "
                                 "(zeroshard's offload_dir)")
        kind = "disk"
    else:
        raise UnsupportedKey(f"DeepSpeed key {section.name('device')}={device!r} is unsupported; use cpu, nvme or none")
    if out.values.get("offload", kind) != kind or out.values.get("offload_dir", directory) != directory:
        raise UnsupportedKey("DeepSpeed keys offload_optimizer and offload_param offload to different places; "
                             "zeroshard has one offload target: give both the same device (and nvme_path)")
    out.set(section.name("device"), device, "offload", kind, FROM_JSON, why, noted=what == "param")
    if directory is not None:
        out.set(section.name("nvme_path"), directory, "offload_dir", str(directory), FROM_JSON)


def _offload(zero: Section, out: Builder) -> None:
    if zero.take("cpu_offload"):  # the pre-0.3.16 spelling of offload_optimizer.device = cpu
        out.set(zero.name("cpu_offload"), True, "offload", "cpu", FROM_JSON)
    if zero.take("cpu_offload_param"):  # the deprecated spelling of offload_param.device = cpu
        out.set(zero.name("cpu_offload_param"), True, "offload", "cpu", FROM_JSON, "zeroshard offloads the fp32 "
                "masters and optimizer state; each rank's 1/N compute-dtype param shard stays on the device", noted=True)
    opt = zero.section("offload_optimizer")
    if opt is not None:
        _offload_target(opt, out, "optimizer", "fp32 masters and optimizer state in host memory (or files), "
                        "the optimizer step on the CPU")
        out.refuse(opt, "ratio", "partial optimizer offload (ZeRO-Offload++ twin flow) offloads everything or "
                "nothing in zeroshard", off=(None, 1, 1.0))
        out.note(opt, "pin_memory", "zeroshard pins host buffers when a GPU is present")
        for key in ("buffer_count", "fast_init", "pipeline", "pipeline_read", "pipeline_write"):
            out.note(opt, key, "a DeepSpeed offload I/O tuning knob; zeroshard's disk offload streams slice by slice")
        out.note(opt, "super_offload", "SuperOffload's superchip scheduling; the optimizer step is the same")
        out.note(opt, "cpuadam_cores_perc", "DeepSpeed's CPU-Adam thread share; zeroshard steps torch's optimizer")
        opt.finish()
    param = zero.section("offload_param")
    if param is not None:
        # DeepSpeed keeps the 16-bit param partitions in host memory and copies them in to gather;
        # zeroshard keeps each rank's 1/N compute-dtype shard on the device and offloads what is
        # bigger, the fp32 masters and optimizer state. The values trained are the same either way.
        stage = out.values.get("stage", 0)
        why = ("zeroshard offloads the fp32 masters and optimizer state; each rank's 1/N compute-dtype param shard "
               "stays on the device" if stage_policy(stage).shard_params else
               f"DeepSpeed offloads params at stage 3 only (this is stage {stage}); zeroshard offloads the fp32 "
               "masters and optimizer state")
        _offload_target(param, out, "param", why)
        for key in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu"):
            out.note(param, key, "a DeepSpeed param-offload tuning knob; zeroshard's param shards stay on the device")
        param.finish()


def _buckets(zero: Section, out: Builder) -> None:
    """DeepSpeed buckets count elements; zeroshard's bucket_mb counts MiB of fp32 gradients."""
    sizes, autos = {}, []
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        value = zero.take(key)
        if value == AUTO:
            autos.append(key)
        elif value is not None:
            sizes[key] = value
    if len(set(sizes.values())) > 1:
        raise UnsupportedKey(f"DeepSpeed keys reduce_bucket_size={sizes['reduce_bucket_size']} and "
                             f"allgather_bucket_size={sizes['allgather_bucket_size']} differ, but zeroshard has one "
                             "bucket size (bucket_mb); set them equal")
    flag = out.flag("bucket_mb")
    if sizes:
        key, elements = next(iter(sizes.items()))
        mb = int(elements) * 4 / 2**20  # the same elements per bucket, reduced in fp32
        if flag is not None and flag != mb:
            raise UnsupportedKey(f"DeepSpeed key {zero.name(key)}={elements} is bucket_mb={mb!r} but --bucket-mb "
                                 f"{flag}; make them agree, or write \"auto\" in the JSON to take the flag")
        for key, given in sizes.items():
            out.set(zero.name(key), given, "bucket_mb", mb, f"{FROM_JSON} (elements x 4 bytes)")
    for key in autos:
        value, source = (flag, f"auto: {flag_name('bucket_mb')}") if flag is not None else (out.values.get(
            "bucket_mb", default_of("bucket_mb")), f"auto: {FROM_ZS_DEFAULT}")
        out.set(zero.name(key), AUTO, "bucket_mb", value, source)


def _prefetch(zero: Section, out: Builder) -> None:
    """DeepSpeed prefetches parameter elements (a byte budget); zeroshard prefetches whole units, so
    only 0 (prefetch nothing) carries over as a number. Prefetching changes when a gather is issued,
    never a value."""
    for key in ("prefetch_bucket_size",):  # the field behind the stage3_prefetch_bucket_size alias
        if not zero.has(key):
            continue
        given = zero.take(key)
        flag = out.flag("prefetch")
        if given == 0:
            if flag not in (None, 0):
                raise UnsupportedKey(f"DeepSpeed key {zero.name(key)}=0 prefetches nothing but --prefetch {flag}; "
                                     "make them agree")
            out.set(zero.name(key), given, "prefetch", 0, FROM_JSON)
        elif flag is not None:
            out.set(zero.name(key), given, "prefetch", flag, f"{'auto: ' if given == AUTO else ''}{flag_name('prefetch')}")
        else:
            out.row(zero.name(key), given, f"prefetch = {default_of('prefetch')!r}", f"{'auto: ' if given == AUTO else ''}"
                    f"{FROM_ZS_DEFAULT}", "zeroshard prefetches whole units (--prefetch N), not a count of elements",
                    noted=True)



def _quantized_comm(zero: Section, out: Builder) -> None:
    """ZeRO++ qwZ and qgZ -> comm_quant: blockwise int8 with an fp32 scale per block on the wire, the
    masters (and the optimizer) exact. zeroshard's grads go as int8 where qgZ sends int4, so they
    round less; DeepSpeed's block sizes are its own, zeroshard's comm_quant_block (256) is kept."""
    on: dict[str, tuple[str, Any]] = {}
    for key, part in (("zero_quantized_weights", "weights"), ("zero_quantized_gradients", "grads")):
        value = zero.concrete(key, False)
        if not isinstance(value, bool):
            raise UnsupportedKey(f"DeepSpeed key {zero.name(key)}={value!r} must be true or false")
        if value:
            on[key] = (part, value)
    if not on:
        return
    stage = out.values.get("stage", 0)
    if not stage_policy(stage).shard_params:
        # ZeRO++ quantizes ZeRO-3's all-gather and reduce-scatter; a lower stage is not the run it describes.
        raise UnsupportedKey(f"DeepSpeed key zero_optimization.{next(iter(on))}=true is ZeRO++, which quantizes "
                             f"ZeRO-3's collectives, but stage is {stage}; set stage 3 (zeroshard also quantizes "
                             "stage-2 grads: write comm_quant = 'grads' yourself)")
    flag = out.flag("comm_quant")
    value = ",".join(part for part, _ in on.values())
    if flag is not None and flag != value:
        raise UnsupportedKey(f"DeepSpeed keys {' and '.join(on)} mean comm_quant={value!r} but --comm-quant "
                             f"{flag!r}; make them agree")
    out.values["comm_quant"] = value
    for key, (part, given) in on.items():
        out.row(zero.name(key), given, f"comm_quant = {value!r}", FROM_JSON,
                f"int8 blocks with fp32 scales on the {part} collective"
                + ("; qgZ sends grads as int4, zeroshard's int8 rounds them less" if part == "grads" else ""),
                noted=True)

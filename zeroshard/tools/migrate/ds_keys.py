"""DeepSpeed's own key vocabulary: the aliases its pydantic config models declare, so a key is
known under either spelling (deepspeed/runtime/zero/config.py: `Field(..., alias="stage3_...")`).

DeepSpeed reads a ZeRO field under its name or its alias (`populate_by_name`); the converter reads
both and names the key as the JSON wrote it. What zeroshard supports is not listed here: it is read
from the runtime's own tables where the converter maps a key (the schedules, the optimizers, the
config's fields).
"""

from __future__ import annotations

ZERO_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
"""DeepSpeedZeroConfig: alias -> field name."""

ZERO_FIELDS = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
)
"""Every field of DeepSpeedZeroConfig (DeepSpeed 0.19): the test feeds each one to the converter."""

OFFLOAD_PARAM_FIELDS = ("device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory")
OFFLOAD_OPTIMIZER_FIELDS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                            "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
"""deepspeed/runtime/zero/offload_config.py's two models."""

AUTOEP_FIELDS = (
    "enabled", "autoep_size", "expert_tensor_parallel_size", "validate_folding_routing", "preset_model",
    "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm",
    "route_norm", "route_scale", "score_apply", "combine_impl", "num_expert_groups", "num_limited_groups",
    "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor", "expert_w1", "expert_w2", "expert_w3",
    "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
)
"""The ``expert_parallel`` section (deepspeed/module_inject/auto_ep_config.py, parse_autoep_config)."""

"""The converter knows DeepSpeed's whole ZeRO vocabulary, under field names and aliases, and what it
maps into is the runtime's own tables: a schedule, an optimizer or a degree that lands there is
mapped without a second edit, and one the tables lack is refused."""

from __future__ import annotations

import pytest

from zeroshard.tools.migrate import UnsupportedKey, from_deepspeed
from zeroshard.tools.migrate.deepspeed import DS_SCHEDULES
from zeroshard.tools.migrate.ds_keys import (AUTOEP_FIELDS, OFFLOAD_OPTIMIZER_FIELDS, OFFLOAD_PARAM_FIELDS,
                                             ZERO_ALIASES, ZERO_FIELDS)
from zeroshard.trainer.config import field_names
from zeroshard.trainer.optimizers import NAMED
from zeroshard.trainer.schedules import SCHEDULES

BASE = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
# DeepSpeed's defaults, where the field's default is not "absent" (None) or False.
ZERO_DEFAULTS = {"stage": 3, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                 "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                 "load_from_fp32_weights": True, "sub_group_size": 1e9, "prefetch_bucket_size": 5e7,
                 "param_persistence_threshold": 1e5, "model_persistence_threshold": 2**63 - 1,
                 "max_live_parameters": 1e9, "max_reuse_distance": 1e9, "module_granularity_threshold": 0,
                 "ignore_unused_parameters": True, "zero_hpz_partition_size": 1, "mics_shard_size": -1,
                 "memory_efficient_linear": True, "override_module_apply": True, "leaf_module": {}}


@pytest.mark.parametrize("field", ZERO_FIELDS + tuple(ZERO_ALIASES))
def test_every_zero_key_is_known_by_field_name_and_alias(field):
    """Each DeepSpeedZeroConfig key at its default converts: an unknown one raises UnsupportedKey."""
    name = ZERO_ALIASES.get(field, field)
    value = ZERO_DEFAULTS.get(name, False if name not in ("offload_param", "offload_optimizer", "zenflow",
                                                          "zeropp_loco_param") else None)
    if value is None:
        value = {"device": "none"} if name.startswith("offload") else {}
    conv = from_deepspeed({**BASE, "zero_optimization": {"stage": 3, field: value}})
    assert conv.values["stage"] == 3


@pytest.mark.parametrize("section,fields", [("offload_param", OFFLOAD_PARAM_FIELDS),
                                            ("offload_optimizer", OFFLOAD_OPTIMIZER_FIELDS)])
def test_every_offload_key_is_known(section, fields):
    values = {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4, "buffer_size": 1e8, "max_in_cpu": 1e9,
              "pin_memory": True, "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
              "super_offload": False, "cpuadam_cores_perc": 0.8}
    conv = from_deepspeed({**BASE, "zero_optimization": {"stage": 3, section: {k: values[k] for k in fields}}})
    assert conv.values["offload"] == "cpu"


def test_every_autoep_key_is_known_and_autoep_size_is_ep():
    defaults = {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 1, "route_scale": 1.0,
                "score_apply": "auto", "score_func": "auto", "top_k": "auto", "routed_scaling_factor": "auto",
                "use_grouped_mm": True}
    ds = {**BASE, "expert_parallel": {k: defaults.get(k) for k in AUTOEP_FIELDS}}
    conv = from_deepspeed(ds, world=2, flags={"model": "tiny-moe"})
    assert conv.values["ep"] == 2 and "ep" in field_names()
    with pytest.raises(UnsupportedKey, match="expert_parallel.expert_tensor_parallel_size=2 is unsupported"):
        from_deepspeed({**ds, "expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}})


def test_what_converts_is_the_runtimes_own_tables():
    """Every DeepSpeed scheduler zeroshard's schedule table names converts to it; the converter
    accepts no other. Every optimizer of the trainer's table converts by its DeepSpeed type."""
    assert set(DS_SCHEDULES) == {s.deepspeed for s in SCHEDULES.values() if s.deepspeed} == {
        "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    for kind, name in DS_SCHEDULES.items():
        params = {} if kind == "WarmupLR" else {"total_num_steps": 20}  # WarmupLR takes no total (TypeError)
        conv = from_deepspeed({**BASE, "scheduler": {"type": kind, "params": params}})
        assert conv.values["lr_schedule"] == name and name in SCHEDULES
    for kind in ("OneCycle", "LRRangeTest"):
        with pytest.raises(UnsupportedKey, match=f"scheduler.type='{kind}' is unsupported.*--drop scheduler"):
            from_deepspeed({**BASE, "scheduler": {"type": kind}})
    for name in NAMED:
        conv = from_deepspeed({**BASE, "optimizer": {"type": "AdamW" if name == "adamw" else name, "params": {}}})
        assert conv.values.get("optimizer", "adamw") == name
    with pytest.raises(UnsupportedKey, match="optimizer.type='Lamb'"):
        from_deepspeed({**BASE, "optimizer": {"type": "Lamb"}})

"""EngineOptions (one typed record of the engine's knobs) and the event bus, without a second rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard as zs
from zeroshard.runtime import EngineEvents, EngineOptions, EventKind, get_engine
from zeroshard.runtime.engine import BACKWARD_PREFETCH_AT, MAX_INFLIGHT_REDUCTIONS


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefetch=-1), "prefetch=-1 must be >= 0"),
    (dict(bucket_mb=0), "bucket_mb=0 must be > 0"),
    (dict(accumulation="lazy"), "accumulation='lazy' is invalid; use 'sharded' or 'unsharded'"),
    (dict(checkpointing="every:0"), "checkpointing='every:0' is invalid; use none, all"),
    (dict(backward_prefetch_at=1.5), "backward_prefetch_at=1.5 is a share"),
    (dict(max_inflight_reductions=-1), "max_inflight_reductions=-1 must be >= 0"),
])
def test_bad_options_fail_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**kwargs)


def test_defaults_are_the_engine_constants_the_planner_imports():
    options = EngineOptions()
    assert options.max_inflight_reductions == MAX_INFLIGHT_REDUCTIONS
    assert options.backward_prefetch_at == BACKWARD_PREFETCH_AT
    assert options.bucket_bytes == 25 * 2**20


def test_shard_keywords_build_the_options_the_engine_owns():
    model = zs.shard(Net(), stage=3, prefetch=2, reshard_after_forward=False, checkpointing="all", offload="cpu")
    engine = get_engine(model)
    assert engine.options == EngineOptions(prefetch=2, reshard_after_forward=False, checkpointing="all",
                                           offload=zs.OffloadPolicy(kind="cpu"))
    assert engine.recompute is not None and engine.store is not None
    assert engine.init_stats["path"] == "replicated"


def test_shard_takes_one_options_object_but_not_both_forms():
    options = EngineOptions(max_inflight_reductions=1, reap_when_done=False)
    assert get_engine(zs.shard(Net(), stage=2, options=options)).options is options
    with pytest.raises(ValueError, match="options= and also engine keywords"):
        zs.shard(Net(), stage=2, prefetch=3, options=options)


def test_subscribers_get_their_kinds_until_removed():
    bus = EngineEvents()
    assert not bus.active
    seen, steps = [], []
    sub = bus.subscribe(seen.append)
    bus.subscribe(steps.append, kinds=[EventKind.STEP])
    bus.emit(EventKind.GATHER, "blocks.0", "forward", 10)
    bus.emit(EventKind.STEP, "", "step", 4)
    sub.remove()
    bus.emit(EventKind.FREE, "blocks.0", "forward", 10)
    assert [(e.kind, e.unit, e.bytes) for e in seen] == [(EventKind.GATHER, "blocks.0", 10), (EventKind.STEP, "", 4)]
    assert [e.kind for e in steps] == [EventKind.STEP]


def test_a_local_step_reports_its_reductions_and_step():
    model = zs.shard(Net(), stage=3)
    engine = get_engine(model)
    opt = zs.optimizer(model, torch.optim.SGD, lr=0.1)
    kinds = []
    with engine.events.subscribed(lambda e: kinds.append((e.kind.value, e.unit))):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    launched = [u for k, u in kinds if k == "reduce_launched"]
    assert launched == [u.name for u in engine.reduce_order if u.trainable_groups]  # the root owns no param here
    assert [u for k, u in kinds if k == "reduce_done"] == launched
    assert kinds[-1] == ("step", "")


def test_every_engine_knob_is_a_train_config_key_nested_in_one_engine_options(tmp_path):
    """One table: the engine's options. TrainConfig nests them; each field (offload's policy spread
    flat) is a key of the config, a flag and a TOML key, with the engine's own default, and a value
    given flat lands in `cfg.engine` and nowhere else."""
    import dataclasses

    from zeroshard.trainer.config import TrainConfig, field_names, load_toml, merge_config
    from zeroshard.runtime.offload.policy import OffloadPolicy
    from zeroshard.runtime.options import KNOB_NAMES, KNOBS
    from zeroshard.trainer.step import engine_options

    own = {f.name for f in dataclasses.fields(EngineOptions)} - {"offload"}
    assert set(KNOB_NAMES) == own | {"offload", "offload_dir", "offload_slice_mb"}
    assert len(dataclasses.fields(OffloadPolicy)) == 3  # a new policy field needs a flat knob
    assert set(KNOB_NAMES) <= set(field_names()) and "engine" not in field_names()
    cfg = TrainConfig()
    assert cfg.engine == EngineOptions() and engine_options(cfg) == EngineOptions()
    assert {k.name: k.default for k in KNOBS} == EngineOptions().flat()
    changed_values = {"checkpointing": "all", "offload": "disk", "offload_dir": str(tmp_path / "off"),
                      "offload_slice_mb": 8.0, "accumulation": "unsharded",
                      "pp_grad_reduce": "microbatch"}
    for knob in KNOBS:
        if knob.name not in changed_values:
            changed_values[knob.name] = (not knob.default if knob.type is bool else
                                         knob.default / 2 if knob.type is float else knob.default + 1)
    assert set(changed_values) == set(KNOB_NAMES)
    changed = TrainConfig(stage=3, **changed_values)
    assert changed.engine.flat() == changed_values and all(changed_values[k.name] != k.default for k in KNOBS)
    assert TrainConfig(**changed.to_dict()) == changed and dataclasses.replace(changed, stage=2).engine == changed.engine
    toml = tmp_path / "run.toml"
    toml.write_text("\n".join(f"{k} = {v!r}".replace("True", "true").replace("False", "false")
                              for k, v in changed_values.items()))
    assert merge_config(load_toml(toml), {"stage": 3}).engine == changed.engine
    assert engine_options(changed, prefetch=0, offload="none").prefetch == 0

"""TrainConfig: defaults, validation messages, TOML loading and flag precedence."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from zeroshard.trainer.config import (
    MODEL_NAMES,
    TrainConfig,
    field_help,
    field_names,
    load_toml,
    merge_config,
)


def test_defaults_are_valid() -> None:
    cfg = TrainConfig()
    assert cfg.stage == 0 and cfg.mp == "fp32" and cfg.data.path is None
    assert cfg.to_dict()["batch"] == cfg.batch


def test_every_field_has_a_docstring() -> None:
    # The docstrings double as --help text; an undocumented field is an undocumented flag.
    for name in field_names():
        assert field_help(name), f"TrainConfig.{name} has no docstring"


def test_model_names_match_the_model_presets() -> None:
    from zeroshard.models.gpt import GPTConfig

    assert set(MODEL_NAMES) == set(GPTConfig.names())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"model": "huge"}, "model='huge'"),
        ({"stage": 4}, "stage=4"),
        ({"mp": "fp8"}, "mp='fp8'"),
        ({"steps": 0}, "steps=0"),
        ({"nproc": 0}, "nproc=0"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": 1e-3, "min_lr": 1e-2}, "min_lr"),
        ({"warmup": -1}, "warmup=-1"),
        ({"clip": -1.0}, "clip"),
        ({"accum": 0}, "accum"),
        ({"batch": 8, "nproc": 2, "accum": 3}, "micro-steps"),
        ({"bucket_mb": 0.0}, "bucket_mb"),
        ({"prefetch": -1}, "prefetch=-1"),
        ({"reshard_after_forward": "no"}, "expected bool"),
        ({"hang_timeout_s": 0.0}, "hang_timeout_s"),
        ({"batch": 10, "nproc": 4}, "multiple of 4"),
        ({"batch": 64, "num_samples": 32, "nproc": 2}, "num_samples=32"),
        ({"steps": "10"}, "expected int"),
        ({"stage": True}, "expected int"),
        ({"data": 3}, "expected str or null"),
    ],
)
def test_bad_values_name_the_field(overrides: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        TrainConfig(**overrides)
    assert needle in str(info.value)


def test_int_is_accepted_for_float_fields() -> None:
    cfg = TrainConfig(lr=1, min_lr=0)
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        TrainConfig("tiny")  # type: ignore[misc]


def test_load_toml_top_level_and_dashed_keys(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text('model = "tiny"\nseq-len = 32\nsteps = 7\nlr = 0.002\n')
    assert load_toml(p) == {"model": "tiny", "seq_len": 32, "steps": 7, "lr": 0.002}


def test_load_toml_train_table(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text("[train]\nstage = 0\nbatch = 8\n")
    assert load_toml(p) == {"stage": 0, "batch": 8}


def test_unknown_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "run.toml"
    p.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match="unknown config key 'stepz'.*valid keys are"):
        load_toml(p)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(bad)


def test_flags_override_file_and_none_means_not_given() -> None:
    cfg = merge_config({"steps": 7, "seed": 5, "batch": 8}, {"steps": 2, "seed": None, "lr": 0.01})
    assert (cfg.steps, cfg.seed, cfg.batch, cfg.lr) == (2, 5, 8, 0.01)


def test_merge_validates_the_result() -> None:
    with pytest.raises(ValueError, match="stage=9"):
        merge_config({"stage": 0}, {"stage": 9})


def test_replace_revalidates() -> None:
    with pytest.raises(ValueError, match="stage=5"):
        dataclasses.replace(TrainConfig(), stage=5)


def test_lr_schedule_warms_up_then_decays_to_min_lr() -> None:
    from zeroshard.trainer.train import lr_at

    cfg = TrainConfig(steps=20, warmup=5, lr=1e-3, min_lr=1e-4)
    lrs = [lr_at(cfg, s) for s in range(cfg.steps)]
    assert lrs[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] == pytest.approx(1e-4)
    assert TrainConfig(steps=1, warmup=0).lr == lr_at(TrainConfig(steps=1, warmup=0), 0)
    log = TrainConfig(steps=20, warmup=5, lr=1e-3, min_lr=1e-4, warmup_shape="log")
    assert [lr_at(log, s) for s in range(5)] == pytest.approx([1e-3 * math.log(s + 2) / math.log(6) for s in range(5)])
    assert [lr_at(log, s) for s in range(5, 20)] == pytest.approx(lrs[5:]), "the same decay after either warm-up"
    with pytest.raises(ValueError, match="warmup_shape=.cubic. is invalid; use one of linear, log, cosine, 1-sqrt"):
        TrainConfig(warmup_shape="cubic")


def test_comm_quant_validation() -> None:
    assert TrainConfig(stage=3, comm_quant="weights").comm_quant == "weights"
    with pytest.raises(ValueError, match="needs stage 3"):
        TrainConfig(stage=2, comm_quant="weights")
    with pytest.raises(ValueError, match="power of two"):
        TrainConfig(stage=3, comm_quant="weights", comm_quant_block=100)
    with pytest.raises(ValueError, match="comm_quant="):
        TrainConfig(stage=3, comm_quant="weight")
    assert TrainConfig(stage=3, comm_quant="weights,grads").comm_quant == "weights,grads"
    assert TrainConfig(stage=2, comm_quant="grads").stage == 2
    with pytest.raises(ValueError, match="grads needs stage 2 or 3"):
        TrainConfig(stage=1, comm_quant="grads")
    assert TrainConfig(stage=3, comm_quant="weights,grads+ef").comm_quant == "weights,grads+ef"
    with pytest.raises(ValueError, match="grads needs stage 2 or 3"):
        TrainConfig(stage=0, comm_quant="grads+ef")
    with pytest.raises(ValueError, match="comm_quant="):
        TrainConfig(stage=3, comm_quant="grads,grads+ef")
    for block in (0, -256, 3):
        with pytest.raises(ValueError, match="power of two"):
            TrainConfig(stage=3, comm_quant="grads", comm_quant_block=block)

"""zs.shard(compile=...) and --compile: what is accepted, and the one-line errors for the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.runtime import CompileError
from zeroshard.runtime.compiled import compile_forwards, compile_options, eager_hook


@pytest.mark.parametrize(("arg", "expected"), [
    (None, None), (False, None), (True, {}), ("aot_eager", {"backend": "aot_eager"}),
    ({"backend": "inductor", "mode": "reduce-overhead"}, {"backend": "inductor", "mode": "reduce-overhead"}),
])
def test_accepted_values(arg, expected):
    assert compile_options(arg) == expected


@pytest.mark.parametrize(("arg", "needle"), [
    ("no_such_backend", "'no_such_backend' is not registered"),
    ({"backend": "aot_eager", "fullgraf": True}, "unknown keys ['fullgraf']"),
    (3, "compile=3 is invalid"),
])
def test_bad_values_are_one_line_errors(arg, needle):
    with pytest.raises(CompileError, match=needle.replace("[", r"\[").replace("]", r"\]")) as info:
        compile_options(arg)
    assert "\n" not in str(info.value)


def test_shard_checks_compile_before_touching_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(CompileError, match="not registered"):
        zs.shard(model, stage=0, compile="inductr")
    assert zs.runtime.find_engine(model) is None


def test_compiling_an_already_compiled_forward_is_refused():
    block = nn.Linear(2, 2)
    block.forward = torch.compile(block.forward, backend="eager")  # type: ignore[method-assign]
    with pytest.raises(CompileError, match="already compiled"):
        compile_forwards([block], {"backend": "eager"})


def test_runtime_hooks_are_never_traced():
    calls = []

    def hook(module, args):
        calls.append(torch.compiler.is_compiling())

    layer = nn.Linear(2, 2)
    layer.register_forward_pre_hook(eager_hook(hook))
    torch.compile(lambda x: layer(x) * 2, backend="eager")(torch.ones(1, 2))
    assert calls == [False], "the hook ran inside dynamo's trace"


def test_config_compile_flag():
    cfg = TrainConfig(compile=True, compile_backend="aot_eager")
    assert cfg.compile.enabled and cfg.compile_backend == "aot_eager"
    with pytest.raises(ValueError, match="compile_backend='tvm' is invalid"):
        TrainConfig(compile=True, compile_backend="tvm")


def test_sharding_a_compile_wrapper_is_refused():
    wrapped = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), backend="eager")
    with pytest.raises(CompileError, match="shard the model itself, then compile it"):
        zs.shard(wrapped, stage=0)

"""`plan`, `plan --time` and `tune` plan the model you will train: a save_pretrained folder, an hf:
model or any module:Class, built on the meta device as `zeroshard train` builds it; `plan
--calibrate` times a folder's own units for `plan --time`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import zeroshard as zs  # noqa: E402
from zeroshard.cli.main import main  # noqa: E402
from zeroshard.trainer.config import TrainConfig  # noqa: E402
from zeroshard.checkpoint.hf.pretrained import plain_pretrained  # noqa: E402
from zeroshard.trainer.targets import build_target  # noqa: E402
from zeroshard.tools.sim.hf_shape import hf_shape  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64, vocab_size=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out, max_shard_size="40KB")
    return out


def _json(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_folder_is_the_plan_of_the_model_from_pretrained_loads(folder, capsys):
    planned = _json(capsys, "--model", str(folder), "--world", "2", "--batch", "4", "--seq", "32")
    loaded = plain_pretrained(folder)  # every tensor real: what the meta build must plan the same
    reference = zs.plan(loaded, world=2, batch=4, seq=32).to_dict()
    assert planned["model"]["params"] == sum(p.numel() for p in {id(p): p for p in loaded.parameters()}.values())
    assert planned["layouts"] == reference["layouts"]
    assert not any(p.is_meta for p in loaded.parameters())
    assert all(p.is_meta for p in build_target(str(folder)).parameters()), "planning allocates nothing"


def test_plan_time_reads_the_folders_shape_from_its_config(folder, capsys):
    model = build_target(str(folder))
    shape = hf_shape(model, "gpt2")
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    assert (shape.n_layer, shape.hidden, shape.n_head, shape.ffn, shape.vocab) == (3, 64, 4, 256, 128)
    assert (shape.gated, shape.bias, shape.tied) == (False, True, True) and shape.block_params == block
    rows = _json(capsys, "--time", "--model", str(folder), "--world", "2", "--batch", "4", "--seq", "32")
    assert rows["workload"]["model"] == str(folder) and rows["rows"], rows


def test_hf_name_and_module_class_are_planned(capsys):
    tiny = _json(capsys, "--model", "hf:gpt2-tiny", "--world", "2")
    assert tiny["model"]["name"] == "GPT2LMHeadModel" and tiny["model"]["params"] > 0
    linear = _json(capsys, "--model", "torch.nn:Linear", "--model-config", '{"in_features": 512, "out_features": 256}',
                   "--world", "2")
    assert linear["model"]["params"] == 512 * 256 + 256


@pytest.mark.parametrize("argv, named", [
    (["--model", "no_such_pkg.mod:Net"], "cannot import 'no_such_pkg.mod'"),
    (["--model", "torch.nn:NoSuchLayer"], "module 'torch.nn' has no 'NoSuchLayer'"),
    (["--model", "torch.nn:Linear"], "give its arguments as --model-config"),
    (["--model", "torch.nn:Linear", "--model-config", "[1, 2]"], "must be a JSON object"),
    (["--model", "torch.nn:Linear", "--model-config", "{bad"], "is neither a JSON object"),
    (["--model", "small", "--model-config", "{}"], "--model-config gives a module:Class"),
    (["--model", "/no/such/folder"], "is not a model"),
    (["--model", "llama3-8b", "--vocab-size", "32"], "--vocab-size needs a model to build; llama3-8b is a shape"),
])
def test_a_bad_model_is_one_line_naming_it(argv, named, capsys):
    capsys.readouterr()
    assert main(["plan", *argv, "--world", "2"]) == 1
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err


def test_folder_refuses_a_vocabulary_it_does_not_have(folder, capsys):
    capsys.readouterr()
    assert main(["plan", "--model", str(folder), "--world", "2", "--vocab-size", "32"]) == 1
    assert "keeps its own vocabulary" in capsys.readouterr().err


def test_tune_prunes_a_folder_with_the_planner(folder):
    from zeroshard.tools.tune.grid import Candidate
    from zeroshard.tools.tune.prune import predict

    base = TrainConfig(model=str(folder), nproc=2, batch=4, seq_len=32, vocab_size=128)
    cands = [Candidate(stage=s, checkpointing="none") for s in (0, 3)]
    got = predict(cands, base)
    expected = zs.plan(build_target(str(folder)), world=2, batch=4, seq=32, device="cpu",
                       optimizer_kwargs={"weight_decay": base.weight_decay, "foreach": True})
    assert got[cands[0]].total == expected["ddp"].device.total and got[cands[1]].total == expected["zero3"].device.total


def test_calibrate_times_a_folders_block_on_the_inputs_the_model_gives_it(folder):
    """plan --calibrate's probe: the first block called as the model's forward calls it (a GPT-2
    block gets its hidden states and masks), its backward ending at the block; the whole model
    through the training step's loss; the layers counted as zs.shard finds them."""
    import argparse

    from zeroshard.cli.plan_time import CALIBRATE_SEQ, _calibrated_hf
    from zeroshard.tools.sim.unit_probe import UnitProbe

    probe = UnitProbe(str(folder), vocab=128, micro_batch=2, seq=16)
    model = probe.model
    assert probe.n_layer == model.config.n_layer and probe.block is model.transformer.h[0]
    out = probe.block_call()
    assert out.shape == (2, 16, model.config.n_embd)
    out.sum().backward()
    inside = {id(p) for p in probe.block.parameters()}
    assert all(p.grad is not None for p in probe.block.parameters())
    assert all(p.grad is None for p in model.parameters() if id(p) not in inside), "backward must stop at the block"
    assert torch.isfinite(probe.model_loss())
    # Timed under the vocabulary plan --time matches a folder's timings by (its config's), and no
    # longer than its learned positions.
    args = argparse.Namespace(seq=None, vocab_size=None)
    expected_seq = min(CALIBRATE_SEQ, model.config.n_positions)
    assert _calibrated_hf(args, str(folder)) == (hf_shape(build_target(str(folder)), "gpt2").vocab, expected_seq)


def test_calibrate_refuses_a_module_class_in_one_line(capsys):
    capsys.readouterr()
    assert main(["plan", "--calibrate", "--model", "torch.nn:Linear", "--world", "2"]) == 1
    err = capsys.readouterr().err
    assert "has none" in err and len(err.strip().splitlines()) == 1, err


def test_a_llama_shape_is_planned_for_memory_from_the_simulators_workload(capsys):
    """`plan --model llama3-8b` without --time: the planner lays out the simulator's own shape (its
    params exactly) with the simulator's activation count for the same micro-batch and sequence."""
    import json

    from zeroshard.cli.main import main
    from zeroshard.tools.sim.workload import SHAPES, Workload

    assert main(["plan", "--model", "llama3-8b", "--world", "8", "--batch", "8", "--seq", "4096", "--mp", "bf16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shape = SHAPES["llama3-8b"]
    assert out["params"] == shape.params == 8_030_261_248
    w = Workload(shape=shape, micro_batch=1, seq=4096)
    kept = out["layouts"]["zero3"]["activations_bytes"]
    assert kept == shape.n_layer * int(w.per_layer_activation_bytes()) + w.tokens * (2 * shape.hidden * 2 + 4 * shape.vocab)

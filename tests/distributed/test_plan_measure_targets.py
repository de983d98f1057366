"""`plan --measure` on the models `plan` takes besides zeroshard's GPT, each rebuilt on every rank
as `zeroshard train` builds it (on meta, sharded, then filled): a save_pretrained folder of OPT
from the architecture tests (>= 3 shards), an hf: model and a module:Class (a plain causal LM).

The planner's accounting is the same for any model, so every component it predicts (model states,
stage 3's window, the buckets) must be what the step allocated, within what tests/distributed/
test_plan_measure.py holds zeroshard's GPT to. Outside zeroshard's GPT the activations come from
a trace of the model's own forward on fake tensors (zeroshard/tools/planner/traced.py): what it
says is kept for backward must be what the real step kept, and the peak within 10%.

One spawn runs every case; the CLI test replays that spawn's results through `plan --measure`.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

import arch_workloads as aw  # noqa: E402
import zeroshard.trainer.launch  # noqa: E402
from zeroshard.cli.main import main  # noqa: E402
from zeroshard.trainer.targets import Target  # noqa: E402
from zeroshard.tools.planner import plan  # noqa: E402
from zeroshard.tools.planner.measure import MEASURED, checks, measure_many_worker, request  # noqa: E402

WORLD, BATCH, SEQ = 2, 4, 16
PREDICTED = tuple(c for c in MEASURED if c != "activations")
MODULE_CONFIG = '{"vocab": 64, "width": 32, "layers": 3}'


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("measure") / "opt"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(aw.configs()["opt"]).save_pretrained(out, max_shard_size=aw.SHARD_BYTES)
    return out


@pytest.fixture(scope="module")
def cases(folder):
    """name -> (target, stages): every stage of the folder, one each of the others."""
    return {"folder": (Target(spec=str(folder), seq_len=SEQ), (0, 1, 2, 3)),
            "hf": (Target(spec="hf:gpt2-tiny", seq_len=SEQ), (3,)),
            "module": (Target(spec="plain_lm:PlainLM", config=MODULE_CONFIG), (2,))}


@pytest.fixture(scope="module")
def plans(cases):
    return {name: plan(target.build(), world=WORLD, batch=BATCH, seq=SEQ, device="cpu")
            for name, (target, _) in cases.items()}


@pytest.fixture(scope="module")
def requests(cases, plans):
    return [request(plans[name], stages, target=target, timed_steps=1) for name, (target, stages) in cases.items()]


@pytest.fixture(scope="module")
def spawned(requests):
    return zeroshard.trainer.launch.spawn(measure_many_worker, WORLD, args=(requests,), timeout_s=600)


@pytest.fixture(scope="module")
def measured(cases, plans, spawned):
    out = {}
    for i, name in enumerate(cases):
        out[name] = checks(plans[name], [r[i] for r in spawned])
        for c in out[name]:
            print(f"{name} {c.layout}: " + ", ".join(f"{k} {getattr(c.predicted, k)} vs {c.measured[k]}" for k in MEASURED)
                  + f", peak {c.predicted.allocated} vs {c.measured_total}, step {c.step_s}")
    return out


@pytest.mark.parametrize("name", ["folder", "hf", "module"])
def test_every_planned_component_is_what_the_step_allocated(measured, name):
    for check in measured[name]:
        for comp in PREDICTED:
            assert getattr(check.predicted, comp) == pytest.approx(check.measured[comp], rel=0.02, abs=64 * 1024), \
                (check.layout, comp)
        if check.layout == "zero3":
            assert check.measured["window"] > 0


@pytest.mark.parametrize("name", ["folder", "hf", "module"])
def test_traced_activations_are_what_the_step_kept(measured, plans, name):
    assert plans[name].activations is not None
    for check in measured[name]:
        assert check.predicted_kept == pytest.approx(check.measured["activations"], rel=0.02, abs=4096), check.layout
        assert check.predicted.allocated == pytest.approx(check.measured_total, rel=0.10), check.layout
        assert check.step_s is not None and check.step_s > 0


def test_plan_measure_cli_builds_the_folder_on_every_rank(folder, requests, spawned, monkeypatch, capsys):
    """The CLI's request is the fixture's folder request (same target, stages, timed steps), so the
    fixture's ranks stand in for its spawn; its JSON pairs them with its own plan."""
    def replay(fn, world, *, args, timeout_s):
        (req,) = args
        assert world == WORLD and req["target"] == requests[0]["target"] and req["stages"] == requests[0]["stages"]
        assert req["timed_steps"] > 0
        return [r[0] for r in spawned]

    monkeypatch.setattr(zeroshard.trainer.launch, "spawn", replay)
    capsys.readouterr()
    assert main(["plan", "--model", str(folder), "--world", str(WORLD), "--batch", str(BATCH), "--seq", str(SEQ),
                 "--measure", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {m["layout"]: m for m in out["measurement"]}
    assert list(rows) == ["ddp", "zero1", "zero2", "zero3"]
    for layout, m in rows.items():
        assert m["predicted_bytes"]["params"] == out["layouts"][layout]["params_bytes"] == m["measured_bytes"]["params"]
        assert m["step_s"] > 0 and m["predicted_kept_activation_bytes"] == out["activations"]["saved"]


@pytest.mark.parametrize("argv, named", [
    (["--model", "torch.nn:Linear", "--model-config", '{"in_features": 8, "out_features": 8}'], "embeds none"),
    (["--params", "7e9"], "not --params"),
])
def test_what_cannot_take_a_training_step_is_refused_in_one_line(argv, named, capsys):
    capsys.readouterr()
    assert main(["plan", *argv, "--world", str(WORLD), "--measure"]) == 1
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err


def test_a_sequence_longer_than_the_folders_positions_is_refused_in_one_line(folder, capsys):
    positions = aw.configs()["opt"].max_position_embeddings
    capsys.readouterr()
    assert main(["plan", "--model", str(folder), "--world", str(WORLD), "--seq", str(positions + 1), "--measure"]) == 1
    err = capsys.readouterr().err
    assert f"--seq {positions}" in err and len(err.strip().splitlines()) == 1, err

"""`optimizer` in the config: names, TOML tables, a class of one's own, and refusals by name."""

from __future__ import annotations

import pytest

from zeroshard.trainer.config_checks import check_runnable
import torch

from zeroshard.trainer.config import TrainConfig, load_toml, merge_config
from zeroshard.trainer.optimizers import parse_optimizer, plain_optimizers, resolve_class
from zeroshard.models import GPT, GPTConfig


def test_names_and_tables_parse():
    assert parse_optimizer("Muon").name == "muon"
    spec = parse_optimizer({"name": "adafactor", "beta2-decay": -0.7})
    assert spec.name == "adafactor" and spec.options == {"beta2_decay": -0.7}
    assert parse_optimizer({"name": "pkg.mod:Cls", "per_tensor": True}).options == {"per_tensor": True}


@pytest.mark.parametrize("value, words", [
    ("lion", "is not adamw, muon, adafactor or module:Class"),
    ({"lr": 0.1}, "needs name"),
    ({"name": "muon", "per_tensor": True}, "classified already"),
])
def test_bad_choices_are_refused_in_one_line(value, words):
    with pytest.raises(ValueError, match=words) as info:
        check_runnable(TrainConfig(optimizer=value))  # the check that needs torch's classes
    assert "\n" not in str(info.value)


def test_toml_optimizer_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('stage = 2\n[optimizer]\nname = "muon"\nlr = 0.02\nmomentum = 0.9\n')
    cfg = merge_config(load_toml(path), {"steps": 3})
    assert cfg.optimizer == {"name": "muon", "lr": 0.02, "momentum": 0.9} and cfg.stage == 2
    assert merge_config(load_toml(path), {"optimizer": "adafactor"}).optimizer == "adafactor"  # the flag wins


def test_module_class_resolves_or_is_refused_by_name():
    assert resolve_class("torch.optim:SGD") is torch.optim.SGD
    with pytest.raises(ValueError, match="no torch.optim.Optimizer subclass 'Nope'"):
        resolve_class("torch.optim:Nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_class("no_such_module_xyz:Cls")


def test_plain_muon_is_muon_on_matrices_and_adamw_on_the_rest():
    model = GPT(GPTConfig.named("tiny"))
    muon, adamw = plain_optimizers({"name": "muon", "lr": 0.02}, model, lr=1e-3, weight_decay=0.1)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"]) and muon.param_groups[0]["lr"] == 0.02
    counted = sum(p.numel() for o in (muon, adamw) for g in o.param_groups for p in g["params"])
    assert counted == sum(p.numel() for p in model.parameters())
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]

"""Runtime checks that need no second rank: input validation and execution-order tracking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import ExecutionOrderError, get_engine


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny"))


def test_unknown_stage_is_rejected():
    with pytest.raises(ValueError, match="stage must be 0"):
        zs.shard(tiny(), stage=5)


def test_module_listed_twice_is_rejected():
    model = tiny()
    with pytest.raises(ValueError, match="listed twice"):
        zs.shard(model, stage=3, units=[model.blocks[0], model.blocks[0]])


def test_overlapping_units_are_rejected():
    model = tiny()
    with pytest.raises(ValueError, match="overlap"):
        zs.shard(model, stage=3, units=[model.blocks[0], model.blocks[0].attn])


def test_model_without_trainable_params_is_rejected():
    model = tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable params"):
        zs.shard(model, stage=2)


def test_params_on_mixed_devices_are_rejected():
    model = tiny()
    model.blocks[1].to("meta")
    with pytest.raises(ValueError, match="mixed devices"):
        zs.shard(model, stage=1)


def test_sharding_twice_is_rejected():
    model = zs.shard(tiny(), stage=0)
    with pytest.raises(ValueError, match="already sharded"):
        zs.shard(model, stage=0)


def test_non_elementwise_optimizer_is_rejected():
    model = zs.shard(tiny(), stage=3)
    with pytest.raises(ValueError, match="not elementwise"):
        zs.optimizer(model, torch.optim.LBFGS, lr=1.0)


def test_per_tensor_torch_optimizers_are_refused_even_when_declared_elementwise():
    model = zs.shard(tiny(), stage=0)
    for cls in (torch.optim.LBFGS, torch.optim.Adafactor, torch.optim.Muon, torch.optim.SparseAdam):
        with pytest.raises(ValueError, match=f"{cls.__name__} is not elementwise"):
            zs.optimizer(model, cls, elementwise=True, lr=1e-3)


class _TrustRatio(torch.optim.SGD):
    """A LARS-like subclass: even a subclass of an allowed class may compute per-tensor norms."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * float(p.norm() / p.grad.norm()))


def test_undeclared_optimizer_is_refused_and_the_error_says_why():
    model = zs.shard(tiny(), stage=1)
    with pytest.raises(ValueError) as info:
        zs.optimizer(model, _TrustRatio, lr=0.1)
    message = str(info.value)
    assert "\n" not in message
    for part in ("_TrustRatio is not a known elementwise optimizer", "trust ratio", "elementwise=True",
                 "silently give wrong updates"):
        assert part in message


def test_allow_list_and_opt_in_are_accepted():
    model = zs.shard(tiny(), stage=1)
    for cls in zs.runtime.optim.ELEMENTWISE_OPTIMIZERS:
        opt = zs.optimizer(model, cls, lr=1e-3)
        assert isinstance(opt, cls)
    opt = zs.optimizer(model, _TrustRatio, elementwise=True, lr=0.1)  # the user's word is taken
    assert isinstance(opt, _TrustRatio)


def test_default_units_are_the_blocks_and_tied_weight_has_one_owner():
    model = zs.shard(tiny(), stage=3)
    engine = get_engine(model)
    names = [u.name for u in engine.units]
    assert sorted(n for n in names if n != "<root>") == [f"blocks.{i}" for i in range(4)]
    slots = [s.fqn for g in engine.groups for s in g.layout.slots]
    assert slots.count("tok_emb.weight") == 1 and "lm_head.weight" not in slots
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and len(names) == len(set(names))


def test_names_are_kept_and_full_state_dict_matches_unsharded():
    reference = tiny()
    expected = reference.state_dict()
    model = zs.shard(tiny(), stage=3)
    assert list(model.state_dict().keys()) == list(expected.keys())
    full = zs.full_state_dict(model)
    for key, value in expected.items():
        assert torch.equal(full[key], value), key


def test_unit_predicate_selects_units():
    model = zs.shard(tiny(), stage=3, units=lambda name, m: name in ("blocks.0", "blocks.2"))
    assert sorted(u.name for u in get_engine(model).units) == ["<root>", "blocks.0", "blocks.2"]


def test_unsharded_context_shows_full_params():
    model = zs.shard(tiny(), stage=3)
    assert model.blocks[0].attn.qkv.weight.dim() == 1  # the local shard piece outside the window
    with zs.unsharded(model):
        assert model.blocks[0].attn.qkv.weight.shape == (192, 64)
    assert get_engine(model).live_full_bytes() == 0


class Reorderable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.swap = False

    def forward(self, x):
        order = [0, 2, 1] if self.swap else [0, 1, 2]
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return x.sum()


def test_changed_execution_order_raises_naming_units():
    model = zs.shard(Reorderable(), stage=3)
    x = torch.randn(4, 8)
    model(x).backward()
    model(x).backward()
    model.swap = True
    with pytest.raises(ExecutionOrderError, match=r"ran blocks\.1 at position 2, this step ran blocks\.2"):
        model(x)


def test_original_params_are_released_after_sharding():
    import gc
    import weakref

    model = tiny()
    original = weakref.ref(model.blocks[0].attn.qkv.weight)
    zs.shard(model, stage=3)
    gc.collect()
    assert original() is None, "the pre-shard full param must not outlive zs.shard"


def test_per_tensor_classes_are_accepted_and_mixed_in_one_optimizer():
    model = zs.shard(tiny(), stage=3)
    groups = zs.muon_groups(model, muon={"lr": 0.02}, weight_decay=0.1)
    opt = zs.optimizer(model, torch.optim.AdamW, param_groups=groups, lr=3e-4)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 3e-4, 3e-4]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.0]  # Muon's own default, then ours
    assert "momentum" in opt.param_groups[0] and "betas" in opt.param_groups[1]  # each class's own defaults
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 1.5e-4, 1.5e-4]
    del sched
    names = groups[0]["params"]
    assert names and all(n.endswith("weight") and "emb" not in n and "lm_head" not in n for n in names)


def test_muon_on_a_vector_is_refused_by_name_with_the_fix():
    model = zs.shard(tiny(), stage=0)
    with pytest.raises(ValueError) as info:
        zs.optimizer(model, torch.optim.Muon, lr=0.02)
    message = str(info.value)
    assert "Muon" in message and "zs.muon_groups" in message and "\n" not in message


def test_undeclared_optimizer_error_offers_both_declarations():
    model = zs.shard(tiny(), stage=1)
    with pytest.raises(ValueError, match="per_tensor=True"):
        zs.optimizer(model, _TrustRatio, lr=0.1)
    with pytest.raises(ValueError, match="declare one"):
        zs.optimizer(model, _TrustRatio, lr=0.1, elementwise=True, per_tensor=True)
    with pytest.raises(ValueError, match="torch.optim.Optimizer class"):
        zs.optimizer(model, torch.optim.AdamW, lr=0.1, param_groups=[{"params": [n for n, _ in
                                                                             model.named_parameters()],
                                                                      "optimizer": "muon"}])

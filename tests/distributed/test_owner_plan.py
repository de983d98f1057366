"""The planner's per-rank optimizer state and owner-exchange bytes for per-tensor optimizers
(zeroshard/tools/planner/owner_state.py) against what each rank of a real stage-3 step holds and
sends: the Muon recipe (Muon on the hidden matrices, AdamW on the rest) and Adafactor, world 4."""

from __future__ import annotations

import owner_plan_workloads as opw
import pytest
import torch

from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime.materialize import meta_init
from zeroshard.tools.planner.inventory import Inventory
from zeroshard.tools.planner.optim_probe import probe
from zeroshard.tools.planner.owner_state import optimizer_per_rank, owner_loads, per_tensor_params
from zeroshard.trainer.launch import spawn

WORLD = 4
CLASSES = {"muon": torch.optim.Muon, "adafactor": torch.optim.Adafactor}


@pytest.fixture(scope="module")
def measured():
    return spawn(opw.suite, WORLD, timeout_s=600)


def _planned(name: str, preset: str = "tiny"):
    with meta_init():
        model = GPT(GPTConfig.named(preset, **opw.CONFIG))
    params = per_tensor_params(model, CLASSES[name], {"lr": 1e-3})
    assert params is not None
    units = Inventory(model, name=preset, dp=WORLD).comm_units(stage=opw.STAGE, shards=WORLD, bucket_bytes=0)
    trainable = [g for u in units for g in u.groups if g.trainable]
    per_element = probe(params.elementwise, torch.float32, {}).per_element
    return (optimizer_per_rank(trainable, params, WORLD, per_element),
            owner_loads(trainable, params, WORLD, {torch.float32: torch.float32}).exchange)


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_planned_state_per_rank_is_what_each_rank_holds(measured, name):
    state, _ = _planned(name)
    held = [r[name]["optimizer"] for r in measured]
    for rank in range(WORLD):
        assert state[rank] == pytest.approx(held[rank], rel=0.02, abs=1024), (rank, state, held)
    assert max(held) / min(held) == pytest.approx(max(state) / min(state), rel=0.05)


@pytest.mark.parametrize("name", ["muon", "adafactor"])
def test_planned_exchange_bytes_are_the_ledgers(measured, name):
    _, exchange = _planned(name)
    assert [r[name]["exchange"] for r in measured] == list(exchange)


if __name__ == "__main__":  # the figures for `small`: python tests/distributed/test_owner_plan.py small
    import sys

    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    ranks = spawn(opw.suite, WORLD, args=(preset,), timeout_s=1200)
    for name in CLASSES:
        state, exchange = _planned(name, preset)
        held = [r[name]["optimizer"] for r in ranks]
        print(f"{preset} world {WORLD} stage {opw.STAGE} {name}: optimizer state per rank (MB) planned "
              f"{[round(b / 1e6, 3) for b in state]} held {[round(b / 1e6, 3) for b in held]}; "
              f"largest/smallest planned {max(state) / min(state):.3f} held {max(held) / min(held):.3f}; "
              f"exchange bytes planned {list(exchange)} ledger {[r[name]['exchange'] for r in ranks]}")

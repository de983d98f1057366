"""The runtime's host clock on one rank: off unless asked, a full table when asked, and no number
of the step changed by it; the full-param tally the engine samples equals the storages it stands for."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.runtime.events import EventKind
from zeroshard.runtime.host_clock import KINDS, recording
from zeroshard.tools.benchmark.host import measure, rows, unit_host_seconds
from zeroshard.trainer.step import one_step


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.named("tiny", n_layer=3, n_embd=32, seq_len=16))


def _steps(model, clocked: bool, steps: int = 3):
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = [one_step(model, opt, x, x).loss_sum for _ in range(steps)]
    return losses, [p.detach().clone() for p in zs.full_state_dict(model).values()]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_clocked_engine_computes_the_same_numbers(stage):
    plain = zs.shard(_gpt(), stage=stage)
    assert get_engine(plain).host_clock is None  # built outside recording(): nothing is timed
    with recording():
        clocked = zs.shard(_gpt(), stage=stage)
    clock = get_engine(clocked).host_clock
    assert clock is not None
    (loss_a, params_a), (loss_b, params_b) = _steps(plain, False), _steps(clocked, True)
    assert [float(v) for v in loss_a] == [float(v) for v in loss_b]
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    table = clock.table()
    assert table["optimizer"]["calls"] == 6 and table["optimizer_math"]["calls"] >= 3  # 3 steps, 3 zero_grads
    if stage == 3:  # every kind ran: 5 units (3 blocks, the root... per forward) gathered and reduced
        assert all(table[k]["calls"] > 0 and table[k]["ns"] > 0 for k in KINDS)


def test_breakdown_rows_add_up_and_feed_the_simulator():
    result = measure(_gpt(), *([torch.randint(0, 256, (1, 16))] * 2), stage=3, steps=2, warmup=1)
    assert result["units"] == 4 and result["steps"] == 2
    table = {r["kind"]: r for r in rows([result])}
    runtime = sum(table[k]["us_per_step"] for k in KINDS if k != "optimizer_math")
    assert table["runtime total"]["us_per_step"] == pytest.approx(runtime)
    assert table["runtime total"]["us_per_unit"] == pytest.approx(runtime / 4)
    assert 0 < table["runtime total"]["us_per_step"] < table["whole step"]["us_per_step"]
    fwd, bwd = unit_host_seconds(result)
    per_unit = sum(result["kinds"][k]["ns"] for k in KINDS if k not in ("optimizer", "optimizer_math")) / 8 / 1e9
    assert fwd > 0 and bwd > 0 and fwd + bwd == pytest.approx(per_unit)


def test_the_full_param_tally_is_the_storages():
    model = zs.shard(_gpt(), stage=3, prefetch=2)
    engine = get_engine(model)
    seen = []

    def check(event) -> None:
        if event.kind in (EventKind.GATHER, EventKind.FREE):
            seen.append((engine._tally.bytes, engine.live_full_bytes()))  # noqa: SLF001

    with engine.events.subscribed(check):
        _steps(model, False, steps=2)
    assert len(seen) > 10 and all(tally == storages for tally, storages in seen)
    assert engine.peak_full_bytes == max(s for s, _ in seen) and engine.max_unsharded_units >= 2


@pytest.mark.parametrize("missing", [False, True])
def test_collected_grads_fill_the_flat_buffer_as_slot_copies(missing):
    """Stages 2-3 collect a unit's grads into its flat buffer by one concatenation when every grad
    is there (the slot copies otherwise): each slot holds its grad, padding and unused params zero."""
    model = zs.shard(_gpt(), stage=3)
    engine = get_engine(model)
    with torch.no_grad():
        model(torch.zeros(1, 16, dtype=torch.long))  # creates every unit's params
    group = engine.units[0].groups[0]
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=generator) for p in group.created_params()]
    if missing:
        grads[1] = None
    for param, grad in zip(group.created_params(), grads):
        param.grad = grad
    group.collect_grads()
    expected = torch.zeros(group.layout.numel)
    for slot, grad in zip(group.layout.slots, grads):
        if grad is not None:
            expected[slot.offset:slot.end] = grad.reshape(-1)
    assert torch.equal(group.full_grads(), expected)
    assert all(p.grad is None for p in group.created_params())
    group.grad_full = None

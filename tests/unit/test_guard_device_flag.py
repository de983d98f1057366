"""The non-finite guard's flag taken on the device by an optimizer that can (torch's fused AdamW:
``found_inf``), one rank: the update of a bad step skips itself (masters, moments and step counts
as if the step never came, bitwise), nothing waits for the flag before the update, and the count,
the first unit and the report are those of the flag read at once (foreach AdamW)."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine, guard

CFG = GPTConfig.named("tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=8)
STEPS, BAD = 3, 1


@pytest.fixture(scope="module", autouse=True)
def _world():
    zs.init()
    yield
    zs.shutdown()


def _run(stage: int, *, fused: bool, steps: list[int], poison: int | None):
    """Take ``steps`` (batch indices); at step ``poison`` a NaN lands in the first block's grad shard."""
    torch.manual_seed(0)
    model = zs.shard(GPT(CFG), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                       **({"fused": True} if fused else {"foreach": True}))
    engine = get_engine(model)
    took_flag, skipped = [], []
    for i in steps:
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(i))
        model(x, x).backward()
        if i == poison:
            engine.finish_reductions()
            group = next(g for g in engine.trainable_groups if g.unit != "<root>" and g.grad_shard.numel())
            group.grad_shard.view(-1)[0] = float("nan")
        opt.step()
        took_flag.append(guard.state_of(engine).pending is not None)
        skipped.append(guard.skipped(engine))
        assert "found_inf" not in opt.__dict__  # the flag is one step's
        opt.zero_grad()
    states = {k: {n: v.clone() for n, v in s.items()} for k, s in enumerate(opt.state.values())}
    return zs.full_state_dict(model), states, took_flag, skipped, guard.report(engine)


def test_a_fused_update_skips_itself_as_if_the_batch_never_came():
    stage = 3  # the guard's path is the same at every stage; stage 3 has a unit per block
    params, states, took, skipped, report = _run(stage, fused=True, steps=list(range(STEPS)), poison=BAD)
    assert took == [True] * STEPS  # decided on the device every step, read after the update
    assert skipped == [i == BAD for i in range(STEPS)]
    ref_params, ref_states, _, _, _ = _run(stage, fused=True, steps=[i for i in range(STEPS) if i != BAD], poison=None)
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)
    assert all(torch.equal(states[k][n], ref_states[k][n]) for k in ref_states for n in ref_states[k])
    # The same count and diagnosis as the flag read at once by an optimizer that cannot take it.
    _, _, took_now, skipped_now, report_now = _run(stage, fused=False, steps=list(range(STEPS)), poison=BAD)
    assert took_now == [False] * STEPS and skipped_now == skipped
    assert report["skipped_steps"] == report_now["skipped_steps"] == 1
    first, first_now = report["skips"][0], report_now["skips"][0]
    assert first["step"] == first_now["step"] and first["first_unit"] == first_now["first_unit"] is not None
    # (the runs' earlier updates differ, fused against foreach: only where the NaN is must agree)
    assert first["nonfinite"] == first_now["nonfinite"] == [{"rank": 0, "unit": first["first_unit"]}]
    assert first["unit_norms"][first["first_unit"]] == first_now["unit_norms"][first["first_unit"]] == "nan"

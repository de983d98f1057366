"""The guard's check on a step that does not clip (each grad buffer's fp32 norm, not the float64
global norm), one rank: for each kind of bad value it decides as the norm's finiteness does, and it
squares nothing in float64 unless it suspects the step (then the norm itself decides)."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import clip, get_engine, guard

CFG = GPTConfig.named("tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=64, seq_len=8)
BIG = 3e38  # finite; two of them square past fp32's range in the norm


@pytest.fixture(scope="module")
def engine_and_model():
    zs.init()
    torch.manual_seed(0)
    model = zs.shard(GPT(CFG), stage=3)
    engine = get_engine(model)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    model(x, x).backward()
    engine.finish_reductions()
    yield engine
    zs.shutdown()


def _shards(engine) -> list[torch.Tensor]:
    return [g.grad_shard for g in engine.trainable_groups if g.grad_shard is not None and g.grad_shard.numel()]


# (values written at the start of the first two shards, a loss) -> the norm is finite?
CASES = {
    "finite": ((None, None), 1.0),
    "large, below the bound": ((1e18, -1e18), 1.0),
    "nan": ((float("nan"), None), 1.0),
    "inf": ((None, float("inf")), 1.0),
    "-inf": ((float("-inf"), None), 1.0),
    "nan loss": ((None, None), float("nan")),
    "one huge, norm finite": ((BIG, None), 1.0),
    "two huge, norm overflows": ((BIG, -BIG), 1.0),
}


@pytest.mark.parametrize("case", CASES)
def test_the_decision_is_the_norms_finiteness(engine_and_model, case, monkeypatch):
    engine = engine_and_model
    (first, second), loss = CASES[case]
    shards = _shards(engine)
    saved = [s.view(-1)[0].clone() for s in shards[:2]]
    for shard, value in zip(shards, (first, second)):
        if value is not None:
            shard.view(-1)[0] = value
    st = guard.state_of(engine)
    try:
        guard.note_loss(engine, torch.tensor(loss))
        want = not bool(torch.isfinite(clip.guard_norm(engine)))  # the norm the guard computed before
        squared: list[int] = []
        real_square_sum = clip.square_sum
        monkeypatch.setattr(clip, "square_sum", lambda t, a, b: squared.append(b - a) or real_square_sum(t, a, b))
        bad = guard.should_skip(engine, clip.guard_norm)
        assert bad == want == (case not in ("finite", "large, below the bound", "one huge, norm finite"))
        # The float64 squares are taken only for a suspected step: a non-finite value or loss, or a
        # buffer norm at or above BOUND (a finite one, where the norm then says the step is good).
        assert bool(squared) == (case not in ("finite", "large, below the bound"))
        assert guard.norm_value(engine) is None  # no norm was read to log
    finally:
        for shard, value in zip(shards, saved):
            shard.view(-1)[0] = value
        st.consecutive, st.first_report, st.loss = 0, None, None


def test_the_bound_leaves_room_for_every_square():
    # Below BOUND, each |value| (fp32 squares) or each buffer's squares (exact squares) is bounded:
    # 2^48 values, or 2^48 buffers, sum in float64 to below fp32's largest square.
    limit = float(torch.finfo(torch.float32).max)
    assert 2.0 ** 48 * max(guard.BOUND ** 2, limit) < limit ** 2 / 2

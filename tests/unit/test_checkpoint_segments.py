"""One meaning of a checkpointing policy: the blocks the runtime wraps into each segment are the
planner's segments, and `zeroshard tune` prunes with the planner's figures for the same policy.

`every:K` means segments of K consecutive blocks (each keeps only its input and is rebuilt whole in
backward), not "every K-th block"; if the runtime, the planner or tune read it another way, a test
here fails.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.models import GPT, GPTConfig
from zeroshard.tools.planner import plan
from zeroshard.runtime import get_engine
from zeroshard.runtime.recompute import segment_length
from zeroshard.tools.tune.grid import DEFAULT_AXES, candidates, parse_axes
from zeroshard.tools.tune.prune import predict

DEPTHS = (2, 5, 8)
POLICIES = ("none", "all", "every:2", "every:3", "every:4", "sqrt")


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def wrapped_segments(depth: int, policy: str) -> list[tuple[int, ...]]:
    """The block indices of each segment the runtime actually installed on a sharded GPT."""
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named("tiny", n_layer=depth)), stage=0, checkpointing=policy)
    recompute = get_engine(model).recompute
    if recompute is None:
        return []
    return [tuple(int(name.split(".")[1]) for name in seg) for seg in recompute.describe()["segments"]]


@pytest.mark.parametrize("depth", DEPTHS)
def test_planner_segments_are_the_blocks_the_runtime_wraps(depth):
    for policy in POLICIES:
        planned = plan(GPTConfig.named("tiny", n_layer=depth), world=1, checkpointing=policy, device="cpu")
        assert planned.activations is not None
        ranges = [tuple(range(a, b)) for a, b in planned.activations.segments]
        assert ranges == wrapped_segments(depth, policy), policy


def test_every_k_is_segments_of_k_blocks():
    # Written out once, so that a change of meaning in the shared function shows here too.
    assert wrapped_segments(5, "every:2") == [(0, 1), (2, 3), (4,)]
    assert wrapped_segments(8, "sqrt") == [(0, 1, 2), (3, 4, 5), (6, 7)]
    # Segments keep one input each and rebuild the longest: every:2 at 8 blocks keeps 4 inputs, rebuilds 2.
    acts = plan(GPTConfig.named("tiny", n_layer=8), world=1, checkpointing="every:2", device="cpu").activations
    assert acts.saved - acts.root == 4 * acts.boundary and acts.recompute == 2 * acts.per_layer


def test_tune_prunes_with_the_planners_meaning():
    """tune (tiny: 4 blocks) keeps the policy as written and predicts from the plan's segments, so
    policies with the same segments predict the same bytes and different segments differ."""
    base = TrainConfig(model="tiny", nproc=2, batch=16, seq_len=64)  # activations decide the peak
    grid = candidates(parse_axes(**{**DEFAULT_AXES, "stages": "0", "bucket_mb": "25",
                                    "checkpointing": "none,all,every:1,every:2,every:3,sqrt"}))
    by_policy = {c.checkpointing: p.allocated for c, p in predict(grid, base).items()}
    assert wrapped_segments(4, "sqrt") == wrapped_segments(4, "every:2")
    assert by_policy["sqrt"] == by_policy["every:2"] and by_policy["all"] == by_policy["every:1"]
    assert len({by_policy[p] for p in ("none", "every:1", "every:2", "every:3")}) == 4


@pytest.mark.parametrize("text", ["every:0", "every:x", "every:", "half", "every:2:3", "SQRT"])
def test_a_policy_the_runtime_refuses_is_refused_everywhere(text):
    with pytest.raises(ValueError):
        segment_length(text, 4)
    with pytest.raises(ValueError, match="checkpointing"):
        plan("tiny", world=1, checkpointing=text)
    with pytest.raises(ValueError, match="--checkpointing"):
        parse_axes(**{**DEFAULT_AXES, "checkpointing": text})
    with pytest.raises(ValueError, match="checkpointing"):
        TrainConfig(model="tiny", checkpointing=text)


def test_tune_prunes_an_offloaded_run_with_the_offload_layout():
    """A base config with offload="cpu" is pruned with the plan's offload figures (masters and
    optimizer state off the device), not with the plain layout's."""
    grid = candidates(parse_axes(**{**DEFAULT_AXES, "stages": "1", "bucket_mb": "25", "checkpointing": "none"}))
    plain = predict(grid, TrainConfig(model="tiny", nproc=2, batch=2, seq_len=16))
    off = predict(grid, TrainConfig(model="tiny", nproc=2, batch=2, seq_len=16, offload="cpu"))
    # Off the device: at least the optimizer state (the plain zero1 layout's, tiny's AdamW moments).
    moved = plan("tiny", world=2, batch=2, seq=16, device="cpu")["zero1"].device.optimizer
    assert plain[grid[0]].allocated - off[grid[0]].allocated >= moved

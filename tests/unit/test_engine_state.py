"""The engine's visible state on one rank: its training-state enum, its memory snapshot, the
names it speaks, and a second mesh next to the default one."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.runtime.engine import TrainingState


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def _tiny(stage: int, **kw):
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named("tiny")), stage=stage, **kw)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    return model, x


@pytest.mark.parametrize("stage", [0, 3])
def test_training_state_follows_the_step(stage):
    model, x = _tiny(stage)
    engine = get_engine(model)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(engine.state))
    model.blocks[0].register_full_backward_hook(lambda m, gi, go: seen.append(engine.state))
    assert engine.state is TrainingState.IDLE
    loss = model(x, x)
    assert seen == [TrainingState.FORWARD] and engine.state is TrainingState.IDLE
    loss.backward()
    assert seen[-1] is TrainingState.BACKWARD and engine.state is TrainingState.IDLE
    with torch.no_grad():
        model(x, x)
    assert engine.state is TrainingState.IDLE


def test_memory_snapshot_sorts_the_buffers_by_kind():
    for stage in (0, 1, 2, 3):
        model, x = _tiny(stage)
        engine = get_engine(model)
        params = sum(p.numel() for p in model.parameters())
        model(x, x).backward()
        snap = engine.memory_snapshot()
        assert snap.state is TrainingState.IDLE and not snap.offloaded
        # Stages 0-1 keep their full grads for the run; 2-3 hold only reduced shards after backward.
        kept = sum(t.numel() for t in snap.kept_grads)
        assert (kept >= params) if stage < 2 else kept == 0, stage
        assert snap.transient_grads == [] if stage >= 2 else True
        assert sum(t.numel() for t in snap.grad_shards) >= params  # one rank: the shard is everything
        assert snap.live_full_bytes == (0 if stage == 3 else sum(t.numel() * t.element_size()
                                                                 for t in snap.full_params))


def test_names_are_enums_that_read_as_text():
    assert zs.Group.SHARD == "shard" and f"{zs.Group.SHARD}" == "shard" and str(zs.Phase.FORWARD) == "forward"
    mesh = zs.get_mesh()
    assert mesh.group_size(zs.Group.WORLD) == 1 and mesh.dims[zs.Dim.PP] == 1 and mesh.dims[zs.Dim.EP] == 1
    with pytest.raises(ValueError, match="unknown group 'shards'; expected one of"):
        mesh.group_size("shards")


def test_second_mesh_needs_its_own_name_and_records_it():
    with pytest.raises(ValueError, match="name of its own"):
        zs.new_mesh(name="default")
    other = zs.new_mesh(name="experts")
    with pytest.raises(ValueError, match="exists already"):
        zs.new_mesh(name="experts")
    model = zs.shard(GPT(GPTConfig.named("tiny")), stage=3, mesh=other)
    assert zs.mesh_of(model) is other
    ledger = zs.ledger()
    start = ledger.next_seq
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(x, x).backward()
    records = ledger.since(start)
    assert records and {r.mesh for r in records} == {"experts"}


@pytest.mark.parametrize("stage", [0, 3])
def test_bucket_size_shapes_the_units_only_where_the_stage_policy_says_it_is_read(stage):
    counts = [len(get_engine(_tiny(stage, bucket_mb=mb)[0]).units) for mb in (0.01, 1000.0)]
    assert (counts[0] != counts[1]) == zs.runtime.StagePolicy(stage).reads("bucket_mb")

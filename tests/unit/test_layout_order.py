"""The flat buffers' param order: decaying params first, so each rank's shard makes few optimizer
segments, capped so torch's per-tensor loop keeps its temporaries small; and what users see of
the model (its state dict, its numbers) does not depend on that order."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.runtime.layout import SEGMENT_NUMEL, FlatLayout, decay_first


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    zs.init()
    yield
    zs.shutdown()


def _layout(numels: list[int], shards: int = 1) -> FlatLayout:
    return FlatLayout([(str(i), torch.Size([n])) for i, n in enumerate(numels)], shards)


def test_decay_first_keeps_model_order_inside_each_class():
    shapes = [("ln.w", (8,)), ("qkv.w", (8, 24)), ("qkv.b", (24,)), ("proj.w", (8, 8)), ("proj.b", (8,))]
    ordered = decay_first(shapes, lambda item: (item[0], torch.Size(item[1])))
    assert [name for name, _ in ordered] == ["qkv.w", "proj.w", "ln.w", "qkv.b", "proj.b"]


def test_segments_merge_runs_of_one_key_up_to_the_cap():
    decaying = [True, True, False, False]
    small = _layout([100, 200, 7, 3])
    assert [key for key, _, _ in small.segments(0, decaying.__getitem__)] == [True, False]
    # Runs stop at a key change, and one run never outgrows the larger of the cap and the largest param.
    big = _layout([SEGMENT_NUMEL // 2, SEGMENT_NUMEL // 2, SEGMENT_NUMEL // 2, 64])
    runs = big.segments(0, lambda i: True)
    assert [stop - start for _, start, stop in runs] == [SEGMENT_NUMEL, SEGMENT_NUMEL // 2 + 64]
    huge = _layout([2 * SEGMENT_NUMEL, 64, 64])
    assert [stop - start for _, start, stop in huge.segments(0, lambda i: True)] == [2 * SEGMENT_NUMEL, 128]
    # Over two shards each rank's runs stay inside its own shard.
    two = _layout([100, 200, 7, 3], shards=2)
    lo, hi = two.shard_range(1)
    assert all(lo <= start < stop <= hi for _, start, stop in two.segments(1, decaying.__getitem__))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_optimizer_steps_two_segments_per_buffer_of_small_params(stage):
    torch.manual_seed(0)
    model = zs.shard(GPT(GPTConfig.named("tiny")), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    engine = get_engine(model)
    for group in engine.trainable_groups:
        flags = [len(slot.shape) >= 2 for slot in group.layout.slots]
        assert flags == sorted(flags, reverse=True), f"{group.unit}: a vector before a matrix"
    segments = sum(len(g["params"]) for g in opt.param_groups)
    assert segments == 2 * len(engine.trainable_groups)  # tiny's buffers are under the cap
    assert segments < sum(1 for _ in model.parameters())


@pytest.mark.parametrize("stage", [0, 3])
def test_full_state_dict_lists_the_params_as_the_model_does(stage):
    torch.manual_seed(0)
    plain = GPT(GPTConfig.named("tiny"))
    names = list(plain.state_dict())
    model = zs.shard(GPT(GPTConfig.named("tiny")), stage=stage)
    assert list(zs.full_state_dict(model)) == names


@pytest.mark.parametrize("stage", [0, 3])
def test_steps_equal_torch_adamw_over_the_same_groups(stage):
    """Segments that merge several params change no number: each element's update is its own."""
    cfg = GPTConfig.named("tiny")
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    model = zs.shard(GPT(cfg), stage=stage)
    ref = torch.optim.AdamW(zs.optim_groups(plain, 0.1), lr=1e-2, foreach=True)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        plain(x, x).backward()
        ref.step()
        ref.zero_grad()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    got = zs.full_state_dict(model)
    for name, value in plain.state_dict().items():
        assert torch.equal(got[name], value), name


def _manifest(groups: list[tuple[str, list[str]]], shapes: dict[str, tuple[int, ...]], experts: frozenset[str] = frozenset()):
    params = [{"fqn": f, "shape": list(s), **({"ep": {"ep": 2}} if f in experts else {})} for f, s in shapes.items()]
    return {"params": params, "groups": [{"unit": unit, "trainable": True, "master_dtype": "float32",
                                          "compute_dtype": "float32", "params": names} for unit, names in groups]}


def test_reshard_lays_a_checkpoint_in_model_order_out_as_the_runtime_does_now():
    """A checkpoint saved before decaying params came first lists each group in model order (a
    bucket's units in backward order): ``ckpt reshard`` lays it out in today's buffer order."""
    from zeroshard.checkpoint.export import _groups_at

    shapes = {"b0.w": (4, 4), "b0.b": (4,), "b1.w": (4, 4), "b1.b": (4,), "emb": (8, 4), "norm": (4,)}
    manifest = _manifest([("b1+b0+<root>", ["b1.w", "b1.b", "b0.w", "b0.b", "emb", "norm"])], shapes)
    whole = {p["fqn"]: p for p in manifest["params"]}
    assert _groups_at(manifest, whole, ep=1)[0]["params"] == ["b1.w", "b0.w", "emb", "b1.b", "b0.b", "norm"]
    # At ep 1 an expert group joins its unit's dense group: units in the bucket's order, model order
    # inside each, then decaying first, as split_groups orders the joined refs.
    shapes = {"b0.w": (4, 4), "b0.experts": (2, 4, 4), "b0.b": (4,), "b1.w": (4, 4), "b1.experts": (2, 4, 4)}
    manifest = _manifest([("b1+b0", ["b1.w", "b0.w", "b0.b"]), ("b1+b0", ["b1.experts", "b0.experts"])], shapes,
                         experts=frozenset({"b0.experts", "b1.experts"}))
    whole = {p["fqn"]: p for p in manifest["params"]}
    assert _groups_at(manifest, whole, ep=1)[0]["params"] == ["b1.w", "b1.experts", "b0.w", "b0.experts", "b0.b"]

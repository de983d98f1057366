"""Data sources with a known loss floor, and the world-size-independent sampler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from zeroshard.trainer.data import (
    ByteFileDataset,
    GlobalBatchSampler,
    MarkovSource,
    SyntheticDataset,
    build_dataset,
    collate,
)

# --- MarkovSource -------------------------------------------------------------------


@pytest.fixture(scope="module")
def source() -> MarkovSource:
    return MarkovSource(vocab_size=64, order=2, seed=0)


def test_stationary_distribution_is_a_fixed_point(source):
    pi = source.stationary()
    assert pi.shape == (64**2,)
    assert pi.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(pi >= 0)
    np.testing.assert_allclose(source.advance(pi), pi, atol=1e-12)


def test_entropy_rate_matches_empirical_log_loss(source):
    h = source.entropy_rate()
    assert 0 < h < math.log(64) - 0.5  # sparse rows: clearly learnable
    seq = source.generate(200_000, np.random.default_rng(123))
    # -log P(x_t | x_{t-2}, x_{t-1}) by hand for a few positions, then trust log_prob.
    lp = source.log_prob(seq)
    for t in (2, 3, 1000, 199_999):
        s = seq[t - 2] * 64 + seq[t - 1]
        assert lp[t - 2] == pytest.approx(math.log(source.transitions[s, seq[t]]))
    assert -lp.mean() == pytest.approx(h, rel=0.02)


def test_near_uniform_chain_has_entropy_log_v():
    h = MarkovSource(vocab_size=16, order=2, seed=1, concentration=1e6).entropy_rate()
    assert h == pytest.approx(math.log(16), abs=1e-4)
    assert h <= math.log(16)


def test_order_one_chain_and_smaller_concentration_is_lower_entropy():
    sparse = MarkovSource(vocab_size=32, order=1, seed=0, concentration=0.01)
    dense = MarkovSource(vocab_size=32, order=1, seed=0, concentration=1.0)
    assert sparse.entropy_rate() < dense.entropy_rate() < math.log(32)
    seq = sparse.generate(100_000, np.random.default_rng(0))
    assert -sparse.log_prob(seq).mean() == pytest.approx(sparse.entropy_rate(), rel=0.02)


def test_generate_is_deterministic_and_in_range(source):
    a = source.generate(500, np.random.default_rng([5, 6]))
    b = source.generate(500, np.random.default_rng([5, 6]))
    assert a.dtype == np.int64 and a.shape == (500,)
    np.testing.assert_array_equal(a, b)
    assert a.min() >= 0 and a.max() < 64
    assert len(source.generate(1, np.random.default_rng(0))) == 1
    assert len(source.generate(0, np.random.default_rng(0))) == 0


def test_same_seed_same_chain_different_seed_different_chain():
    a, b, c = (MarkovSource(vocab_size=8, order=2, seed=s) for s in (3, 3, 4))
    np.testing.assert_array_equal(a.transitions, b.transitions)
    assert not np.array_equal(a.transitions, c.transitions)


def test_window_floor_charges_the_short_context_positions(source):
    h = source.entropy_rate()
    h1, h2 = source.block_entropy(1), source.block_entropy(2)
    # Order 2: only the first prediction has a single token of context.
    assert source.window_floor(64) == pytest.approx(((h2 - h1) + 63 * h) / 64)
    assert h < source.window_floor(64) < source.window_floor(8) < math.log(64)
    assert source.block_entropy(0) == 0.0


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"vocab_size": 1}, "vocab_size"),
        ({"order": 0}, "order"),
        ({"concentration": 0.0}, "concentration"),
        ({"vocab_size": 256, "order": 3}, "lower vocab_size or order"),
    ],
)
def test_markov_source_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MarkovSource(**kwargs)


# --- datasets -----------------------------------------------------------------------


def test_synthetic_dataset_samples_are_pure_functions_of_seed_and_index(source):
    ds = SyntheticDataset(source, num_samples=100, seq_len=32, seed=9)
    x, y = ds[17]
    assert x.shape == y.shape == (32,) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one
    ds[3], ds[99]  # access order must not matter
    again = SyntheticDataset(source, num_samples=100, seq_len=32, seed=9)[17]
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    assert not torch.equal(ds[18][0], x)
    assert not torch.equal(SyntheticDataset(source, 100, 32, seed=10)[17][0], x)
    assert len(ds) == 100 and ds.vocab_size == 64
    assert ds.entropy_floor == pytest.approx(source.window_floor(32))
    with pytest.raises(IndexError):
        ds[100]


def test_byte_file_dataset_windows(tmp_path):
    path = tmp_path / "text.txt"
    data = bytes(range(256)) * 2 + b"tail"  # 516 bytes
    path.write_bytes(data)
    ds = ByteFileDataset(path, seq_len=9)  # windows of 10 bytes, 51 of them
    assert len(ds) == 51 and ds.vocab_size == 256 and ds.entropy_floor is None
    x, y = ds[3]
    assert x.tolist() == list(data[30:39]) and y.tolist() == list(data[31:40])
    assert x.dtype == torch.long
    assert ds[-1][1].tolist() == list(data[501:510])


def test_byte_file_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ByteFileDataset(tmp_path / "missing.txt", seq_len=8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"12345678")
    with pytest.raises(ValueError, match="fewer than one window.*smaller seq_len"):
        ByteFileDataset(short, seq_len=8)


def test_collate_and_build_dataset(tmp_path):
    ds = build_dataset(seq_len=16, num_samples=64, vocab_size=32, order=1, seed=2)
    assert isinstance(ds, SyntheticDataset) and ds.vocab_size == 32 and len(ds) == 64
    x, y = collate(ds, [5, 1, 7])
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[1], ds[1][0]) and torch.equal(y[2], ds[7][1])
    (tmp_path / "t.txt").write_text("hello world " * 20)
    assert isinstance(build_dataset(data_path=tmp_path / "t.txt", seq_len=16), ByteFileDataset)


# --- GlobalBatchSampler ---------------------------------------------------------------


def _take(sampler: GlobalBatchSampler, n: int) -> list[list[int]]:
    return [sampler.next_indices() for _ in range(n)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_are_disjoint_and_concatenate_to_the_single_process_batch(world):
    reference = _take(GlobalBatchSampler(100, 8, seed=1), 30)  # crosses epoch boundaries
    per_rank = [_take(GlobalBatchSampler(100, 8, world=world, rank=r, seed=1), 30)
                for r in range(world)]
    for step, ref in enumerate(reference):
        parts = [per_rank[r][step] for r in range(world)]
        assert all(len(p) == 8 // world for p in parts)
        assert sum(parts, []) == ref  # rank order, contiguous slices
        assert len(set(ref)) == 8


def test_sampler_is_deterministic_and_seed_dependent():
    def run(seed: int, n: int) -> list[list[int]]:
        return _take(GlobalBatchSampler(50, 5, seed=seed), n)

    assert run(3, 20) == run(3, 20)
    assert run(3, 3) != run(4, 3)


def test_epoch_rollover_and_drop_last():
    s = GlobalBatchSampler(10, 4, world=2, rank=1)
    assert s.steps_per_epoch == 2  # 10 // 4: the last 2 samples are dropped each epoch
    g = GlobalBatchSampler(10, 4)
    epoch0 = _take(g, 2)
    assert (g.epoch, g.step) == (1, 0)
    used = sum(epoch0, [])
    assert len(set(used)) == 8  # each sample at most once per epoch, 2 left out
    epoch1 = _take(g, 2)
    assert epoch1 != epoch0  # a fresh permutation
    # Every rank drops the same tail, so all ranks step the same number of times.
    _take(s, 2)
    assert (s.epoch, s.step) == (1, 0)


def test_start_epoch_skips_ahead():
    g = GlobalBatchSampler(40, 4, seed=5)
    _take(g, 10)
    assert _take(g, 10) == _take(GlobalBatchSampler(40, 4, seed=5, start_epoch=1), 10)


def test_resume_mid_epoch_gives_identical_following_indices():
    full = GlobalBatchSampler(64, 8, world=2, rank=1, seed=7)
    first = _take(full, 5)
    sd = full.state_dict()
    assert sd == {"seed": 7, "epoch": 0, "step": 5, "global_batch": 8, "num_samples": 64}
    rest = _take(full, 12)
    resumed = GlobalBatchSampler(64, 8, world=2, rank=1, seed=0)  # the saved seed wins
    resumed.load_state_dict(sd)
    assert (resumed.epoch, resumed.step) == (0, 5)
    assert _take(resumed, 12) == rest
    assert first != rest[:5]


def test_resume_at_a_different_world_size_sees_the_same_global_batches():
    old = GlobalBatchSampler(64, 8, world=2, rank=0, seed=11)
    _take(old, 3)
    sd = old.state_dict()
    expected = _take(GlobalBatchSampler(64, 8, seed=11), 10)[3:]
    news = [GlobalBatchSampler(64, 8, world=4, rank=r) for r in range(4)]
    for n in news:
        n.load_state_dict(sd)
    got = [sum((n.next_indices() for n in news), []) for _ in range(7)]
    assert got == expected


def test_load_state_dict_rejects_mismatches():
    sd = GlobalBatchSampler(64, 8).state_dict()
    with pytest.raises(ValueError, match="num_samples=64.*has 65"):
        GlobalBatchSampler(65, 8).load_state_dict(sd)
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatchSampler(64, 16).load_state_dict(sd)
    with pytest.raises(ValueError, match="missing keys"):
        GlobalBatchSampler(64, 8).load_state_dict({"seed": 0})
    with pytest.raises(ValueError, match="corrupt"):
        GlobalBatchSampler(64, 8).load_state_dict({**sd, "step": 8})


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        ((64, 6), {"world": 4}, r"global_batch \(6\).*world \(4\)"),
        ((4, 8), {}, r"num_samples \(4\).*global_batch \(8\)"),
        ((64, 8), {"world": 2, "rank": 2}, "rank"),
        ((64, 0), {}, "global_batch"),
    ],
)
def test_sampler_validation(args, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GlobalBatchSampler(*args, **kwargs)

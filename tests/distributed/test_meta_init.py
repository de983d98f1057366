"""Meta-device init: bitwise equal to a plain build at every world size, within the memory bound."""

from __future__ import annotations

import pytest

import init_workloads as iw
from zeroshard.trainer.launch import spawn

# A module spawn runs many cases; on a loaded two-core machine it can outlast the default per-test
# timeout, which the first test pays for.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def world2():
    # World 2 also measures the init peak: one spawn instead of two (a gloo world costs seconds here).
    return spawn(iw.world2_suite, 2, timeout_s=600)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"world{n}")
def equality(request):
    world = request.param
    if world == 2:
        return world, [r["equality"] for r in request.getfixturevalue("world2")]
    return world, spawn(iw.equality_suite, world, timeout_s=420)


@pytest.mark.parametrize("model", ["tiny", "small", "reset_parameters", "init_weights"])
@pytest.mark.parametrize("stage", [2, 3])
def test_meta_init_is_bitwise_single_process_init(equality, model, stage):
    world, per_rank = equality
    for rank, result in enumerate(per_rank):
        case = result[(model, stage)]
        assert case["path"] == "meta"
        assert case["equal"], f"{model} stage {stage} world {world} rank {rank} differs from a plain build"


def test_init_peak_is_own_shards_plus_largest_param(world2):
    per_rank = [r["init_memory"] for r in world2]
    for rank, r in enumerate(per_rank):
        bound = r["shard_bytes"] + r["largest_param_bytes"]
        print(f"rank {rank}: meta-init peak {r['meta_peak'] / 2**20:.1f} MiB (bound {bound / 2**20:.1f} MiB), "
              f"plain peak {r['plain_peak'] / 2**20:.1f} MiB, model {r['model_bytes'] / 2**20:.1f} MiB")
        assert r["meta_peak"] <= bound
        assert r["plain_peak"] >= r["model_bytes"]

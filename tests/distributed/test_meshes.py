"""Several parallel contexts in one process: models sharded over different meshes train side by side."""

from __future__ import annotations

import pytest

import workloads as w
from zeroshard.trainer.launch import spawn


@pytest.fixture(scope="module")
def two_meshes():
    return spawn(w.two_meshes_suite, 4, timeout_s=420)[0]


@pytest.fixture(scope="module")
def reference():
    return w.reference_run(10, w.GLOBAL_BATCH)


@pytest.mark.parametrize("name", ["full", "hybrid", "hybrid-stage1"])
def test_each_model_matches_one_process(two_meshes, reference, name):
    diff = w.max_param_diff(two_meshes["params"][name], reference["params"])
    loss = max(abs(a - b) for a, b in zip(two_meshes["losses"][name], reference["losses"]))
    print(f"{name}: params vs one process {diff:.2e}, losses {loss:.2e}")
    assert diff <= 1e-5 and loss <= 1e-5


def test_each_model_runs_on_its_own_mesh(two_meshes):
    meshes = two_meshes["meshes"]
    assert (meshes["full"]["shard_size"], meshes["full"]["replicate_size"]) == (4, 1)
    assert (meshes["hybrid"]["shard_size"], meshes["hybrid"]["replicate_size"]) == (2, 2)
    groups = two_meshes["groups_by_mesh"]
    # The default mesh shards over the whole world; only the named mesh has a replicate group.
    assert "replicate" not in groups[""] and {"shard", "replicate"} <= groups["hybrid"]

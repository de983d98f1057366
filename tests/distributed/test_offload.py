"""CPU and disk offload of masters and optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest

import offload_workloads as ow
from zeroshard.trainer.launch import WorkerError, spawn


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    directory = tmp_path_factory.mktemp("offload")
    results = spawn(ow.parity_suite, 2, args=(str(directory),), timeout_s=420)
    return directory, results


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_offload_is_bitwise_neutral(parity, stage, kind):
    _, results = parity
    base, got = results[0][(stage, "none")], results[0][(stage, kind)]
    assert got["losses"] == base["losses"]
    assert all((got["params"][k] == base["params"][k]).all() for k in base["params"])


def test_disk_files_exist_while_training_and_vanish_at_clean_exit(parity):
    directory, results = parity
    assert all(r["files_seen"] > 0 for r in results)
    assert not any(p.name.startswith("zeroshard-offload-") for p in Path(directory).iterdir())


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """A crashed run's leftovers in a directory, then a plain and a disk-offload run there: the disk run
    is also the next run that must remove the leftovers (one world-1 start fewer than apart)."""
    directory = tmp_path_factory.mktemp("resident")
    with pytest.raises(WorkerError):
        spawn(ow.crash_with_files, 1, args=(str(directory),), timeout_s=120)
    leftovers = [p for p in directory.iterdir() if p.name.startswith("zeroshard-offload-")]
    files_left = [f for p in leftovers for f in p.iterdir()]
    plain = spawn(ow.resident_after_steps, 1, args=("none", str(directory)), timeout_s=300)[0]
    left_after_plain = [p for p in directory.iterdir() if p.name.startswith("zeroshard-offload-")]
    disk = spawn(ow.resident_after_steps, 1, args=("disk", str(directory)), timeout_s=300)[0]
    left_after_disk = [p for p in directory.iterdir() if p.name.startswith("zeroshard-offload-")]
    return {"leftovers": leftovers, "files_left": files_left, "left_after_plain": left_after_plain,
            "left_after_disk": left_after_disk, "plain": plain, "disk": disk}


def test_crash_leftovers_are_removed_by_the_next_run(resident):
    leftovers = resident["leftovers"]
    assert len(leftovers) == 1 and resident["files_left"]
    assert resident["left_after_plain"] == leftovers  # a run without disk offload leaves them alone
    assert not resident["left_after_disk"]


def test_disk_offload_drops_resident_memory(resident):
    plain, disk = resident["plain"], resident["disk"]
    mib = 2**20
    drop = plain["anon"] - disk["anon"]
    print(f"offloaded {plain['offloaded_bytes'] / mib:.1f} MiB: anonymous RSS {plain['anon'] / mib:.1f} -> "
          f"{disk['anon'] / mib:.1f} MiB (drop {drop / mib:.1f}); file-backed RSS {plain['file'] / mib:.1f} -> "
          f"{disk['file'] / mib:.1f} MiB")
    assert drop >= 0.7 * plain["offloaded_bytes"]
    assert disk["file"] - plain["file"] < 0.5 * plain["offloaded_bytes"], "released slices must leave RSS"

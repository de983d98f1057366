"""CPU and disk offload of masters and optimizer state."""

from __future__ import annotations

from pathlib import Path

import pytest

import offload_workloads as ow
from zeroshard.launch import WorkerError, spawn


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


def test_crash_leftovers_are_removed_by_the_next_run(tmp_path):
    with pytest.raises(WorkerError):
        spawn(ow.crash_with_files, 1, args=(str(tmp_path),), timeout_s=120)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("zeroshard-offload-")]
    assert len(leftovers) == 1 and any(leftovers[0].iterdir())
    spawn(ow.resident_after_steps, 1, args=("disk", str(tmp_path), 64, 2), timeout_s=120)
    assert not any(p.name.startswith("zeroshard-offload-") for p in tmp_path.iterdir())


def test_disk_offload_drops_resident_memory(tmp_path):
    plain = spawn(ow.resident_after_steps, 1, args=("none", str(tmp_path)), timeout_s=300)[0]
    disk = spawn(ow.resident_after_steps, 1, args=("disk", str(tmp_path)), timeout_s=300)[0]
    mib = 2**20
    drop = plain["anon"] - disk["anon"]
    print(f"offloaded {plain['offloaded_bytes'] / mib:.1f} MiB: anonymous RSS {plain['anon'] / mib:.1f} -> "
          f"{disk['anon'] / mib:.1f} MiB (drop {drop / mib:.1f}); file-backed RSS {plain['file'] / mib:.1f} -> "
          f"{disk['file'] / mib:.1f} MiB")
    assert drop >= 0.7 * plain["offloaded_bytes"]
    assert disk["file"] - plain["file"] < 0.5 * plain["offloaded_bytes"], "released slices must leave RSS"

"""Never lose a checkpoint: rotation deletes only what verified, and a strict resume refuses to
start over checkpoints of which none verifies. Fake one-file checkpoints; no process group."""

from __future__ import annotations

from pathlib import Path

from test_checkpoint_format import _fake_checkpoint

from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.rotation import rotate
from zeroshard.checkpoint.save import write_latest
from zeroshard.checkpoint.training import search


def _damage_rank_file(directory: Path) -> None:
    target = directory / fmt.rank_file(0)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(data)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_rotation_sets_corrupt_aside_and_deletes_only_verified_checkpoints_of_its_lineage(tmp_path):
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, f"step-{step}", step, lineage="run-a")
    _damage_rank_file(tmp_path / "step-4")
    _fake_checkpoint(tmp_path, "step-3", 3, lineage="run-b")  # another run's, older: never ours to delete
    newest = _fake_checkpoint(tmp_path, "step-10", 10, lineage="run-a")
    write_latest(newest)

    done = rotate(tmp_path, 2, newest=newest, lineage="run-a")

    # Kept: the 2 newest verified of run-a (10, 8), run-b's 3, and the corrupt 4 under a new name.
    assert _names(tmp_path) == ["step-10", "step-3", "step-4.corrupt", "step-8"]
    assert sorted(p.name for p in done.deleted) == ["step-2", "step-6"]
    (old, new, why), = done.set_aside
    assert (old.name, new.name) == ("step-4", "step-4.corrupt") and "corrupt" in why
    lines = done.describe()
    assert any("step-4.corrupt" in line and "fails verification" in line for line in lines)

    # The set-aside one is no candidate any more, and a second one of the same name gets its own suffix.
    _fake_checkpoint(tmp_path, "step-4", 4, lineage="run-a")
    _damage_rank_file(tmp_path / "step-4")
    again = rotate(tmp_path, 2, newest=newest, lineage="run-a")
    assert [n.name for _, n, _ in again.set_aside] == ["step-4.corrupt-2"] and again.deleted == []
    assert _names(tmp_path) == ["step-10", "step-3", "step-4.corrupt", "step-4.corrupt-2", "step-8"]


def test_keep_last_zero_deletes_nothing_but_still_sets_corrupt_aside(tmp_path):
    for step in (2, 4):
        _fake_checkpoint(tmp_path, f"step-{step}", step, lineage="a")
    (tmp_path / "step-2" / fmt.MANIFEST).write_text("{")
    newest = _fake_checkpoint(tmp_path, "step-6", 6, lineage="a")
    done = rotate(tmp_path, 0, newest=newest, lineage="a")
    assert done.deleted == [] and _names(tmp_path) == ["step-2.corrupt", "step-4", "step-6"]


def test_strict_resume_refuses_when_no_checkpoint_verifies_and_names_each(tmp_path):
    for step in (2, 4):
        _fake_checkpoint(tmp_path, f"step-{step}", step)
        (tmp_path / f"step-{step}" / fmt.MANIFEST).write_text('{"format": "zeroshard-ch')  # truncated
    lost = _fake_checkpoint(tmp_path, "step-6", 6)
    (lost / fmt.MANIFEST).unlink()  # a sync tool dropped it: only rank files remain
    (tmp_path / ".step-8.partial").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    lines: list[str] = []

    path, refusal = search(tmp_path, "auto", lines.append)
    assert path is None and refusal is not None
    assert "step-2" in refusal and "step-4" in refusal and "step-6" in refusal and "not valid JSON" in refusal
    assert "no manifest.json" in refusal and "ckpt repair" in refusal and "--resume fresh-ok" in refusal
    assert "\n" not in refusal, "one line: the launcher keeps one line of a rank's error"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "a refused resume touches nothing"

    path, refusal = search(tmp_path, "fresh-ok", lines.append)
    assert (path, refusal) == (None, None)
    assert any("fresh-ok" in line and "kept" in line for line in lines)


def test_empty_or_missing_dir_and_interrupted_saves_only_start_fresh(tmp_path):
    assert search(tmp_path / "missing", "auto", print) == (None, None)
    assert search(tmp_path, "auto", print) == (None, None)
    (tmp_path / ".step-2.partial").mkdir()  # a first save killed mid-write: nothing ever committed
    assert search(tmp_path, "auto", print) == (None, None)


def test_strict_resume_takes_the_newest_that_verifies(tmp_path):
    good = _fake_checkpoint(tmp_path, "step-2", 2, lineage="a")
    _fake_checkpoint(tmp_path, "step-4", 4, lineage="a")
    (tmp_path / "step-4" / fmt.MANIFEST).write_text("{")
    assert search(tmp_path, "auto", print) == (str(good), None)

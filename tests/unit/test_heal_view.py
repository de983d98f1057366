"""What a run healed, as `zeroshard doctor`, the end-of-run table and `zeroshard report` show it: a
run directory holding one skipped step, one spike rollback and two replica changes (the files the
guard, the rollback and the replica groups write; tests/distributed/test_heal.py and
tests/e2e/test_replica_recovery.py make them in real runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroshard.cli.main import main
from zeroshard.observing.heal_view import findings, marks, summary_rows

SKIP = {"step": 4, "first_rank": 1, "first_unit": "blocks.0"}
ROLLBACK = {"step": 8, "loss": 40.0, "window_mean": 2.5, "restored_step": 6, "checkpoint": "ckpt/step-00000006",
            "skipped_batches": [[0, 6], [0, 7]], "skipped_samples": list(range(16))}
CHANGES = [{"step": 5, "replica": 0, "event": "saw a group leave", "participants": 1, "note": "2 -> 1 groups training"},
           {"step": 9, "replica": 0, "event": "saw a group join", "participants": 2, "note": "1 -> 2 groups training"}]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    lines = [{"kind": "header"}] + [{"step": s, "loss": 2.0, "skipped": float(s == SKIP["step"]), "replicas": 2.0}
                                    for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "rollbacks.jsonl").write_text(json.dumps(ROLLBACK) + "\n")
    (tmp_path / "replicas.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHANGES))
    return tmp_path


def _run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().out


def test_the_doctor_shows_skips_rollbacks_and_replica_changes(run_dir: Path, capsys) -> None:
    rc, out = _run(["doctor", str(run_dir)], capsys)  # no ledger: what the run healed is still shown
    assert rc == 0, out
    assert out.splitlines() == [
        "skipped 1 step(s) for a non-finite loss or grad norm: 4",
        "rollback: loss 40 at step 8 (16.0x the recent mean); reloaded step 6 and skipped 2 batches (16 samples)",
        "replica 0 saw a group leave at step 5: 2 -> 1 groups training",
        "replica 0 saw a group join at step 9: 1 -> 2 groups training"]
    rc, out = _run(["doctor", str(run_dir), "--json"], capsys)
    healing = json.loads(out)["healing"]
    assert (healing["skipped_steps"], healing["rollbacks"], healing["replica_changes"]) == ([4], [ROLLBACK], CHANGES)


def test_the_end_of_run_table_shows_them() -> None:
    summary = {"nonfinite_skipped_steps": 1, "nonfinite_skips": [SKIP], "rollbacks": [ROLLBACK],
               "replica_changes": CHANGES}
    assert summary_rows(summary) == [
        ("steps skipped (non-finite)", "1 (first at step 4, rank 1, unit blocks.0)"),
        ("spike rollback", "step 8 -> 6, 2 batches skipped"),
        ("replica change", "replica 0 saw a group leave at step 5"),
        ("replica change", "replica 0 saw a group join at step 9")]


def test_the_report_marks_them_on_the_loss_chart_and_prints_them(run_dir: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    assert marks(findings(run_dir)) == [("skipped", 4, "skipped (non-finite)"), ("replica", 5, "replica 0 saw a group leave"),
                                        ("rollback", 8, "rollback to step 6"), ("replica", 9, "replica 0 saw a group join")]
    rc, out = _run(["report", str(run_dir)], capsys)
    assert rc == 0 and (run_dir / "report" / "loss.png").stat().st_size > 0, out
    lines = out.splitlines()
    assert lines[1:] == ["what the run healed (marked on loss.png):",
                         "skipped 1 step(s) for a non-finite loss or grad norm: 4",
                         "rollback: loss 40 at step 8 (16.0x the recent mean); reloaded step 6 and skipped 2 batches "
                         "(16 samples)",
                         "replica 0 saw a group leave at step 5: 2 -> 1 groups training",
                         "replica 0 saw a group join at step 9: 1 -> 2 groups training"], out

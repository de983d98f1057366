"""`zeroshard train` with the [heal] table: K consecutive non-finite steps (ZEROSHARD_GRAD_FAULT) stop
the run with one error line and RUN_DIR/nonfinite.json; metrics.jsonl, the doctor and its JSON name
the skipped steps, the first rank and the unit. Real subprocesses on two gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import FAST, read_metrics, run_cli, run_main


def test_k_bad_steps_stop_the_run_and_the_doctor_names_rank_and_unit(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    toml = tmp_path / "run.toml"
    toml.write_text("stage = 3\nnproc = 2\n[optim]\nsteps = 8\n[heal]\nmax_bad_steps = 3\n")  # from the TOML
    proc = run_cli(["train", "--config", str(toml), *FAST, "--run-dir", str(run_dir)],
                   env={"ZEROSHARD_GRAD_FAULT": "rank=1,step=3,unit=blocks.1,count=3"}, timeout=180)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("zeroshard train: error")]
    assert len(errors) == 1 and "3 consecutive steps" in errors[0] and "rank 1, unit blocks.1" in errors[0], proc.stderr
    assert "skipped on every rank" in proc.stdout
    report = json.loads((run_dir / "nonfinite.json").read_text())
    assert report["stopped"] and report["consecutive"] == 3 and report["max_bad_steps"] == 3
    first = report["first"]
    assert (first["step"], first["first_rank"], first["first_unit"]) == (3, 1, "blocks.1")
    assert [s["step"] for s in report["skips"]] == [3, 4, 5]
    # Steps 1-4 were recorded (3 and 4 skipped); step 5, the third skip, stopped the run.
    assert [(r["step"], r["skipped"]) for r in read_metrics(run_dir)] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]

    doctor = run_main(["doctor", str(run_dir)], capsys)
    assert doctor.returncode == 1
    lines = doctor.stdout.splitlines()
    assert any(ln.startswith("stopped: 3 consecutive steps") and "step 3" in ln and "rank 1, unit blocks.1" in ln
               for ln in lines), doctor.stdout
    assert "skipped 3 step(s) for a non-finite loss or grad norm: 3, 4, 5" in doctor.stdout
    as_json = json.loads(run_main(["doctor", str(run_dir), "--json"], capsys).stdout)
    assert as_json["healing"]["nonfinite_stop"]["first"]["first_unit"] == "blocks.1"

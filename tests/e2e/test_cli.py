"""The `zeroshard` command as a user runs it: real subprocesses, real gloo ranks.

Kept small (tiny model, short sequences, few steps): each run pays for importing torch in
three processes, so the whole file stays around a minute on two cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroshard.observing.observer import step_records

# Small enough to be quick, large enough that 30 steps visibly lower the loss.
FAST = ["--model", "tiny", "--batch", "8", "--seq-len", "32", "--num-samples", "256"]
RUN_TIMEOUT_S = 180


def zeroshard_cmd() -> list[str]:
    """The installed console script when present (what a user types), else the module."""
    script = Path(sys.executable).with_name("zeroshard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "zeroshard.cli.main"]


def run_cli(args: list[str], *, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT_S,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    # A parent launched under torchrun must not make the child think it is one of its ranks.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        zeroshard_cmd() + args, capture_output=True, text=True, timeout=timeout, env=full_env,
        cwd=cwd,
    )


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`zeroshard ARGS` in this process: the same `main` the console script calls, minus an interpreter
    start (seconds here). For commands that spawn no rank and need no environment of their own
    (doctor, report, errors before launch); an uncaught exception fails the calling test."""
    from zeroshard.cli.main import main

    earlier = capsys.readouterr()
    rc = main(args)
    out = capsys.readouterr()
    sys.stdout.write(earlier.out)  # keep what the test printed before, for its report
    sys.stderr.write(earlier.err)
    return subprocess.CompletedProcess(["zeroshard", *args], rc, out.out, out.err)


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's step records (its header line left out)."""
    return step_records((run_dir / "metrics.jsonl").read_text().splitlines())


def test_train_writes_metrics_and_config_and_loss_falls(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(["train", *FAST, "--nproc", "2", "--steps", "30", "--lr", "3e-3",
                    "--warmup", "3", "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stdout + proc.stderr

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 31))
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["step_time_s"] > 0 and m["tokens"] == 8 * 32
    first = sum(m["loss"] for m in metrics[:5]) / 5
    last = sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < first - 0.1, f"loss did not fall: {first:.4f} -> {last:.4f}"

    config = json.loads((run_dir / "config.json").read_text())
    assert config["world"] == 2 and config["backend"] == "gloo"
    assert config["train"]["stage"] == 0 and config["train"]["steps"] == 30
    assert config["model"]["seq_len"] == 32 and config["params"] > 0
    assert config["entropy_floor"] > 0

    assert "summary" in proc.stdout and "entropy floor" in proc.stdout
    assert f"{metrics[-1]['loss']:.4f}" in proc.stdout  # the table shows the measured final loss
    # Where the ranks ran: metrics.jsonl's header, summary.json and the table say the same.
    header = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert header["kind"] == "header" and header["topology"] == summary["topology"]
    assert summary["topology"]["shape"] == "1 host x 2 ranks" and summary["topology"]["inside_host"]["shard"]
    assert "1 host x 2 ranks; inside a host: shard" in proc.stdout
    # Stage 0 all-reduces every fp32 gradient once per step: exactly 4 bytes per parameter, plus the
    # non-finite guard's flag (8 bytes: stage 0's clip norm is computed on each rank's whole grads,
    # so the ranks agree on the flag through one all-reduce of their own).
    assert f"{config['params'] * 4 + 8:,}" in proc.stdout


def test_verify_stage0_matches_single_process() -> None:
    proc = run_cli(["verify", "--json", "--stage", "0", "--nproc", "2", "--steps", "8", *FAST])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True
    assert result["max_abs_param_diff_vs_single"] <= 1e-5
    assert result["max_abs_loss_diff_vs_single"] <= 1e-5
    assert result["max_abs_param_diff_vs_stage0"] == 0.0  # stage 0 is its own stage-0 run
    assert len(result["losses"]["single"]) == len(result["losses"]["distributed"]) == 8


def test_accumulation_steps_the_schedule_once_per_optimizer_step(tmp_path: Path) -> None:
    from zeroshard.trainer.config import TrainConfig
    from zeroshard.trainer.train import lr_at

    run_dir = tmp_path / "run"
    flags = ["--nproc", "2", "--stage", "2", "--accum", "2", "--steps", "6", "--warmup", "2",
             "--lr", "3e-3", "--mp", "bf16"]
    proc = run_cli(["train", *FAST, *flags, "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = read_metrics(run_dir)
    cfg = TrainConfig(model="tiny", batch=8, seq_len=32, num_samples=256, nproc=2, stage=2, accum=2,
                      steps=6, warmup=2, lr=3e-3, mp="bf16")
    assert [m["lr"] for m in metrics] == pytest.approx([lr_at(cfg, s) for s in range(6)], rel=1e-12)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["accum"] == 2
    assert manifest["precision"]["param_compute_dtype"] == "bfloat16"
    assert manifest["precision"]["grad_accumulation_dtype"] == "float32"
    assert "bfloat16 / bfloat16" in proc.stdout  # the summary prints the precision manifest


def test_verify_with_accumulation_matches_single_process() -> None:
    proc = run_cli(["verify", "--json", "--stage", "2", "--nproc", "2", "--accum", "2", "--steps", "6", *FAST])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True and result["accum"] == 2
    assert result["max_abs_param_diff_vs_single"] <= 1e-5


def test_verify_stage3_from_meta_init_is_bitwise_our_ddp() -> None:
    # One verify run for two claims: stage 3 at two ranks is bitwise our DDP, and `--init meta`
    # starts from the single-process weights (else neither the single-process nor the stage-0 diff holds).
    proc = run_cli(["verify", "--json", "--stage", "3", "--nproc", "2", "--init", "meta", "--steps", "8", *FAST])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True
    assert result["max_abs_param_diff_vs_single"] <= 1e-5
    assert result["max_abs_param_diff_vs_stage0"] == 0.0  # two ranks: every stage equals DDP bitwise


# Each lever and each checkpointing policy is on in one case, and hybrid sharding meets offload and
# checkpointing in one world-4 case (two world-4 verify runs cost about a minute here); that cpu and
# disk offload are bitwise the same at every stage is tests/distributed/test_offload.py's proof.
@pytest.mark.parametrize("levers", [
    ["--checkpointing", "sqrt"],
    ["--offload", "cpu", "--checkpointing", "every:2"],
    ["--nproc", "4", "--shard-size", "2", "--checkpointing", "all", "--offload", "disk"],
], ids=["ckpt", "cpu-offload+ckpt", "hybrid+ckpt+disk"])
def test_verify_memory_levers_combinations(tmp_path: Path, levers: list[str]) -> None:
    flags = ["verify", "--json", "--stage", "3", "--nproc", "2", "--steps", "4", *FAST, *levers]
    if "disk" in levers:
        flags += ["--offload-dir", str(tmp_path / "offload")]
    proc = run_cli(flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True and result["max_abs_param_diff_vs_single"] <= 1e-5


def test_fault_on_rank1_fails_fast_and_names_rank1(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = run_cli(
        ["train", *FAST, "--nproc", "2", "--steps", "50", "--run-dir", str(tmp_path / "run"),
         "--hang-timeout-s", "90"],
        env={"ZEROSHARD_FAULT": "rank=1,step=3"}, timeout=150,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("zeroshard train: error")]
    assert len(err_lines) == 1, proc.stderr
    assert "rank 1" in err_lines[0] and "injected fault" in err_lines[0], err_lines[0]
    assert elapsed < 90, f"took {elapsed:.0f}s: the surviving rank was not stopped promptly"


def test_malformed_fault_variable_is_one_error_line_before_launch(tmp_path: Path) -> None:
    # Before the named fault points, this spec raised a KeyError halfway through the first save.
    proc = run_cli(["train", *FAST, "--nproc", "2", "--steps", "2", "--run-dir", str(tmp_path / "run")],
                   env={"ZEROSHARD_CKPT_FAULT": "rank=1"}, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("zeroshard train: error")]
    assert len(err_lines) == 1, proc.stderr
    assert "ZEROSHARD_CKPT_FAULT='rank=1' is malformed: missing step" in err_lines[0], err_lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def test_toml_config_is_honoured_and_flags_override_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    toml = tmp_path / "run.toml"
    toml.write_text(
        'model = "tiny"\nnproc = 2\nbatch = 4\nseq_len = 16\nsteps = 5\nseed = 7\n'
        f'num_samples = 64\nlr = 0.002\nrun_dir = "{run_dir}"\n'
    )
    proc = run_cli(["train", "--config", str(toml), "--steps", "3", "--lr", "0.001"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = json.loads((run_dir / "config.json").read_text())["train"]
    assert (train["batch"], train["seq_len"], train["seed"], train["num_samples"]) == (4, 16, 7, 64)
    assert (train["steps"], train["lr"]) == (3, 0.001)  # the flags won
    assert len(read_metrics(run_dir)) == 3


@pytest.mark.parametrize(
    ("toml_text", "flags", "needle"),
    [
        ("stage = 7\n", [], "stage=7"),
        ("stepz = 3\n", [], "unknown config key 'stepz'"),
        ('steps = "ten"\n', [], "steps='ten'"),
        ("", ["--batch", "3", "--nproc", "2"], "multiple of 2"),
    ],
)
def test_bad_config_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], toml_text: str, flags: list[str],
                                        needle: str) -> None:
    # In this process: each case fails before any rank starts, so a subprocess would only add an
    # interpreter start; test_malformed_fault_variable_is_one_error_line_before_launch is the
    # subprocess path of an error before launch.
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "bad.toml"
    toml.write_text(toml_text)
    proc = run_main(["train", "--config", str(toml), *flags], capsys)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.startswith("zeroshard train: error")]) == 1, proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started

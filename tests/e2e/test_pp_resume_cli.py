"""`zeroshard train --pp 2 --save-every`, then `--resume auto` at `--pp 4`: the resumed run continues
the uninterrupted one (tiny GPT, tied head, stage 3, 4 ranks), and the offline tools take the pp
checkpoint as any other.

Two `zeroshard train` runs: the uninterrupted one at pp 2 saving every step, and its step-2
checkpoint resumed at pp 4 (one pipeline of one block per stage) for the last step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_cli import read_metrics, run_cli
from test_resize_cli import max_diff, params

TOL = 1e-5  # the stage-0 tolerance of the parity tests
GPT = ["--model", "tiny", "--batch", "8", "--seq-len", "32", "--num-samples", "256", "--nproc", "4",
       "--stage", "3", "--steps", "3", "--warmup", "1", "--save-every", "1", "--keep-last", "0"]


def train(tmp: Path, name: str, *extra: str) -> tuple[Path, Path, str]:
    ckpt, run_dir = tmp / f"{name}-ck", tmp / f"{name}-run"
    done = run_cli(["train", *GPT, "--ckpt-dir", str(ckpt), "--run-dir", str(run_dir), *extra])
    assert done.returncode == 0, done.stdout + done.stderr
    return ckpt, run_dir, done.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, Path]:
    # --desync-check 1: every step, the ranks of each stage must agree (the stages differ by design).
    return train(tmp_path_factory.mktemp("pp_resume"), "pp2", "--pp", "2", "--desync-check", "1")[:2]


def test_resume_at_another_pp_continues_the_run(tmp_path, uninterrupted):
    ckpt2, run2 = uninterrupted
    shutil.copytree(ckpt2 / "step-00000002", tmp_path / "pp4-ck" / "step-00000002")
    shutil.copytree(run2, tmp_path / "pp4-run")  # a relaunch keeps its run dir
    ckpt4, run4, out = train(tmp_path, "pp4", "--pp", "4", "--resume", "auto")
    assert "saved on 4 ranks at stage 3, in pp 2 pipeline stages; now 4 ranks at stage 3, in pp 4 pipeline " \
           "stages" in out, out
    # 2 data-parallel ranks of 2 microbatches of 2 -> one pipeline of 4 microbatches of 2: no accumulation.
    assert "resized from 2 to 1 data-parallel ranks at step 2: accumulation 1 -> 1" in out, out
    update = max_diff(params(ckpt2 / "step-00000003", tmp_path), params(ckpt4 / "step-00000003", tmp_path))
    ours, theirs = read_metrics(run4), read_metrics(run2)
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs, strict=True))
    print(f"pp 2 -> pp 4 at step 2: next update max|param diff| {update:.1e} against the uninterrupted pp-2 run; "
          f"loss max|diff| {losses:.1e}")
    assert update <= TOL and losses <= TOL
    assert [m["step"] for m in ours] == [1, 2, 3]
    placement = json.loads((ckpt4 / "step-00000003" / "manifest.json").read_text())["pipeline"]
    assert placement["pp"] == 4 and placement["blocks"] == [[0], [1], [2], [3]]
    # The doctor on the pp-4 ledgers: the middle stages send and receive both ways, and every send is paired.
    ok = run_cli(["doctor", str(run4)])
    assert ok.returncode == 0 and "verdict: OK: no divergence: the ranks of each of the 4 pp stage groups" in ok.stdout
    cut = run_cli(["doctor", str(stopped_ledgers(run4, tmp_path / "cut", [1], step=3)[0])])
    assert cut.returncode == 1 and "verdict: PP_UNMATCHED: " in cut.stdout, cut.stdout
    assert "rank 1 (pp stage 1) stopped at mb 1 of forward (step 3): its last receive from stage 0" in cut.stdout


def test_profile_shows_each_stage_share_and_the_bubble(uninterrupted):
    """The pp-2 run's profile (on by default): per pp rank, each stage's forward and backward compute
    (timed by the stages' compute events) plus idle fill the schedule, and with the rest fill the
    step; the bubble is measured on every rank and the theory is the planner's."""
    from zeroshard.tools.planner.pipeline import PipelineShape

    run_dir = uninterrupted[1]
    pipe = json.loads((run_dir / "summary.json").read_text())["profile"]["pipeline"]
    shape = PipelineShape.resolve(pp=2)  # the run's defaults: 1f1b, one microbatch per stage
    assert (pipe["schedule"], pipe["pp"], pipe["microbatches"]) == ("1f1b", 2, shape.microbatches)
    assert pipe["theory_bubble"] == shape.bubble
    assert [r["rank"] for r in pipe["by_rank"]] == [0, 1, 2, 3]
    for r in pipe["by_rank"]:
        assert r["pp_rank"] == r["rank"] // 2  # pp is the outermost dim
        assert list(r["stages"]) == [str(r["pp_rank"])]
        (stage,) = r["stages"].values()
        assert stage["forward"] > 0 and stage["backward"] > 0 and stage["backward_weight"] == 0  # no split backward
        assert stage["forward"] + stage["backward"] == pytest.approx(r["compute_s"])
        # A pipeline of two stages always waits: the last for the first forward, the first for the last grads.
        assert 0 < r["idle_s"] and r["compute_s"] + r["idle_s"] == pytest.approx(r["schedule_s"])
        assert r["schedule_s"] < r["step_s"] and r["bubble"] == pytest.approx(r["idle_s"] / r["schedule_s"])
    for rank in range(4):
        steps = [json.loads(line) for line in (run_dir / "profile" / f"rank-{rank}.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2, 3]
        for s in steps:
            # Every microbatch of the step was bracketed once per phase, on this rank's one stage.
            calls = s["pipeline"]["calls"][str(rank // 2)]
            assert calls == {"forward": shape.microbatches, "backward": shape.microbatches, "backward_weight": 0}
            assert s["pipeline"]["schedule_s"] + s["optimizer_s"] <= s["step_s"]


def stopped_ledgers(run_dir: Path, dest: Path, ranks: list[int], step: int = 2) -> tuple[Path, int]:
    """The run's real ledger dumps, with ``ranks`` cut right after their ``step``'s forward receive of
    microbatch 1, as a rank hung there would have left them (their crash-safe rings are left out,
    since the doctor would merge the full history back). Returns the copy and the cut's seq."""
    from zeroshard.comm.ledger import read_dump

    (dest / "ledger").mkdir(parents=True)
    cut = -1
    for path in sorted((run_dir / "ledger").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        header, records = read_dump(path)
        if rank in ranks:
            cut = next(r["seq"] for r in records if r["op"] == "recv" and r["step"] == step
                       and r["phase"] == "forward" and r["unit"].endswith(".mb1"))
            records = [r for r in records if r["seq"] <= cut]
            header = {**header, "reason": "hang", "message": "cut for the test", "next_seq": cut + 1}
        lines = [json.dumps(header)] + [json.dumps(r) for r in records]
        (dest / "ledger" / path.name).write_text("\n".join(lines) + "\n")
    return dest, cut


def test_doctor_names_the_pp_stage_and_microbatch_where_a_rank_stopped(tmp_path, uninterrupted):
    """Real pp-2 ledgers: the healthy run is OK (the stages' calls differ by design); cut one rank of
    stage 1 and the doctor names its stage and microbatch and the receive its peer waits for; cut
    both ranks of stage 1 and it names the send stage 0 never got an answer to."""
    ok = run_cli(["doctor", str(uninterrupted[1])])
    assert ok.returncode == 0 and "verdict: OK" in ok.stdout, ok.stdout + ok.stderr

    one, cut = stopped_ledgers(uninterrupted[1], tmp_path / "one", [2])
    done = run_cli(["doctor", str(one), "--json"])
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "never_entered" and report["never_entered"]["missing"] == [2]
    assert report["never_entered"]["seq"] == cut + 1 and report["never_entered"]["entered"] == [3]
    assert report["pp"]["stages"] == {"0": [0], "1": [0], "2": [1], "3": [1]}
    assert report["pp"]["stopped"]["2"] == {"op": "recv", "stage": 1, "mb": 1, "phase": "forward", "step": 2,
                                            "seq": cut}
    summary = report["summary"]
    assert "rank 2 (pp stage 1) stopped at mb 1 of forward (step 2): its last receive from stage 0" in summary
    # Its stage-0 partner went on to wait for the grads rank 2 never sent back.
    u = report["pp"]["unmatched"]
    assert (u["rank"], u["op"], u["phase"], u["step"], u["peer"]) == (0, "recv", "backward", 2, 2)
    assert (f"rank 0 (pp stage 0) posted its receive of mb {u['mb']} of backward (step 2) from stage 1, which "
            "never came: rank 2 (pp stage 1) never sent it") in summary

    both = run_cli(["doctor", str(stopped_ledgers(uninterrupted[1], tmp_path / "both", [2, 3])[0])])
    assert both.returncode == 1
    assert "verdict: PP_UNMATCHED: rank 0 (pp stage 0) posted its receive of mb" in both.stdout, both.stdout
    assert "rank 2 (pp stage 1) stopped at mb 1 of forward (step 2)" in both.stdout
    print(summary, both.stdout.splitlines()[1], sep="\n")


def test_a_pp_that_does_not_divide_the_blocks_is_refused_before_launch(tmp_path, uninterrupted):
    shutil.copytree(uninterrupted[0] / "step-00000002", tmp_path / "ck" / "step-00000002")
    done = run_cli(["train", *GPT, "--nproc", "3", "--pp", "3", "--ckpt-dir", str(tmp_path / "ck"), "--resume",
                    "auto"])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "pp=3 x 1 stages per rank does not divide the 4 blocks of tiny" in done.stderr, done.stderr


def test_offline_tools_take_a_pp_checkpoint(tmp_path, uninterrupted):
    source = uninterrupted[0] / "step-00000003"
    shown = run_cli(["ckpt", "inspect", str(source)])
    assert shown.returncode == 0 and "pipeline: pp 2, 2 stages (1f1b): stage 0 on pp rank 0: blocks 0-1" in shown.stdout
    done = run_cli(["ckpt", "reshard", str(source), str(tmp_path / "flat"), "-w", "2"])
    assert done.returncode == 0, done.stderr
    checked = run_cli(["ckpt", "verify", str(source), str(tmp_path / "flat")])
    assert checked.returncode == 0 and checked.stdout.count("OK") == 2, checked.stdout + checked.stderr
    full = params(source, tmp_path)
    assert max_diff(full, params(tmp_path / "flat", tmp_path)) == 0
    assert (full["lm_head.weight"] == full["tok_emb.weight"]).all()


def test_a_pretrained_llama_folder_runs_under_pp_and_matches_one_process(tmp_path):
    """A folder written the way users get one (save_pretrained, several weight shards), cut into 2
    stages: `verify --pp 2` loads it, trains 3 steps and matches one process on transformers' model."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                         intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    folder = tmp_path / "llama"
    tf.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    done = run_cli(["verify", "--model", str(folder), "--nproc", "4", "--pp", "2", "--stage", "3", "--microbatches",
                    "2", "--batch", "8", "--seq-len", "32", "--steps", "3", "--json"])
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"llama folder, pp 2 x shard 2 stage 3: params vs one process {result['max_abs_param_diff_vs_single']:.1e}")
    assert result["passed"] and result["pp"] == 2
    assert result["max_abs_param_diff_vs_single"] <= TOL and result["mismatched_param_names"] == []


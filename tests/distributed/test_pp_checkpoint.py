"""Checkpoints under pipeline parallelism: saved at (pp 2, shard 2), resumed at (pp 1, shard 4) and
(pp 4, shard 1); a (pp 1, shard 4) checkpoint resumed at (pp 2, shard 2); an interleaved one (two
stages per rank, saved in the background) and a (pp 2, tp 2) one resumed at pp 1; tiny-moe at
(pp 2, ep 2) resumed at ep 1 and at pp 1 with ep 2; pp 4 against one
process; the offline tools (verify, inspect, export, export --hf, reshard, repair) on a pp checkpoint.

One spawned world-4 group runs every layout in turn, each on its own mesh, saving and resuming
through the train loop's own TrainingCheckpoints (pp_ckpt_workloads.suite); the tests read its
results and the checkpoints it left.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pp_ckpt_workloads as w
import zeroshard as zs
from zeroshard.checkpoint import format as fmt
from zeroshard.checkpoint.training import checkpoint_name
from zeroshard.cli.main import main as cli
from zeroshard.trainer.launch import spawn
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.train import reference_train

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)

TOL = 1e-5  # the stage-0 tolerance of the parity tests


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pp_ckpt")


@pytest.fixture(scope="module")
def suite(root):
    return spawn(w.suite, w.WORLD, args=(str(root),), timeout_s=900)[0]


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _saved(root: Path, layout: str, stage: int) -> Path:
    return root / f"{layout}-stage{stage}" / checkpoint_name(w.K)


@pytest.mark.parametrize("case", w.RESUMES, ids=[f"{a}-stage{s}-to-{b}-stage{t}" for a, s, b, t in w.RESUMES])
def test_resume_at_another_pp_equals_the_continuous_run(suite, case):
    """The loaded params are the saved ones bitwise (the tied head included: its copy on the last
    stage, or the one param of pp 1); the next update (optimizer state, scheduler, sampler and step
    restored) and the remaining steps equal the uninterrupted run's, which saved the checkpoint."""
    saved_layout, saved_stage, _, _ = case
    run, continuous = suite[case], suite[("continuous", saved_layout, saved_stage)]
    assert run["start"] == w.K
    assert _diff(run["loaded"], continuous["at_save"]) == 0
    assert torch.equal(run["loaded"]["lm_head.weight"], run["loaded"]["tok_emb.weight"])
    update, end = _diff(run["after_first"], continuous["after_first"]), _diff(run["params"], continuous["params"])
    losses = max(abs(a - b) for a, b in zip(run["losses"], continuous["losses"][w.K:]))
    print(f"{case}: next update vs continuous {update:.2e}, after {w.K} more steps {end:.2e}, losses {losses:.2e}; "
          f"resize {run['resize']} ({suite['times'][case]:.1f} s)")
    assert update <= TOL and end <= TOL and losses <= TOL
    assert len(run["losses"]) == w.K and run["lr"] == continuous["lr"]
    # The global batch stays: 2 data-parallel ranks -> 4 (pp 1) or 1 (pp 4, accumulating 2 micro-steps).
    saved_dp, now_dp = (w.WORLD // w.LAYOUTS[k]["pp"] // w.LAYOUTS[k].get("tp", 1) for k in (case[0], case[2]))
    if saved_dp == now_dp:  # ep alone changed (pp2ep2 -> pp2moe): the same data-parallel world, no resize
        assert run["resize"] is None
    else:
        assert run["resize"]["from_world"] == saved_dp and run["resize"]["to_world"] == now_dp


def test_pp4_trains_at_parity_with_one_process(suite):
    got = suite["pp4-parity"]
    cfg = w.config("pp4", 3, steps=w.PARITY_STEPS, warmup=0, lr=3e-4)
    ref = reference_train(cfg)
    diff = _diff(got["params"], ref["params"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"gpt pp 4 x shard 1 stage 3 1f1b, {w.PARITY_STEPS} steps: max abs param diff vs one process {diff:.2e}, "
          f"loss {loss:.2e} ({suite['times']['pp4-parity']:.1f} s)")
    assert got["stages"] == [0] and got["tied"] == [("tok_emb.weight", "lm_head.weight")]
    assert diff <= 1e-5 and loss <= 1e-5


def test_manifest_records_the_pp_placement(root, suite):
    manifest = zs.checkpoint.verify(_saved(root, "pp2", 3))
    placement = manifest["pipeline"]
    assert placement["pp"] == 2 and placement["stages"] == 2 and placement["blocks"] == [[0, 1], [2, 3]]
    assert placement["pp_rank_of_stage"] == [0, 1]
    assert placement["tied"] == [{"param": "tok_emb.weight", "copy": "lm_head.weight", "owner_stage": 0,
                                  "copy_stage": 1}]
    first, last = placement["stage_params"]
    assert "tok_emb.weight" in first and "blocks.1.mlp.fc.weight" in first and "norm_f.weight" not in first
    assert "blocks.2.attn.qkv.weight" in last and "norm_f.weight" in last and "lm_head.weight" not in last
    # One entry per param of the whole model, under its unsharded names: the tied pair once, with both names.
    names = {p["fqn"] for p in manifest["params"]}
    assert names == set(first) | set(last)
    tied = next(p for p in manifest["params"] if p["fqn"] == "tok_emb.weight")
    assert tied["aliases"] == ["tok_emb.weight", "lm_head.weight"] and tied["state"] == ["exp_avg", "exp_avg_sq"]
    assert manifest["mesh"]["pp_size"] == 2 and manifest["world"] == 4
    assert manifest["extra"]["train"]["pp"] == 2
    # Each stage's two shard ranks write that stage's params; no rank writes another stage's.
    written = {r: set() for r in range(4)}
    for p in manifest["params"]:
        for piece in p["pieces"]:
            written[int(piece["file"][5:10])].add(p["fqn"])
    assert written[0] | written[1] == set(first) and written[2] | written[3] == set(last)
    # Interleaved: four stages of one block, two per rank; the head's copy on stage 3 (pp rank 1).
    looped = zs.checkpoint.verify(_saved(root, "pp2i", 1))["pipeline"]
    assert looped["stages"] == 4 and looped["blocks"] == [[0], [1], [2], [3]]
    assert looped["pp_rank_of_stage"] == [0, 1, 0, 1] and looped["tied"][0]["copy_stage"] == 3
    # pp x tp: each stage's tp-split params as one part per tp rank, placed like a tp checkpoint's.
    with_tp = zs.checkpoint.verify(_saved(root, "pp2tp2", 3))
    parts = {p["fqn"]: p["tp"] for p in with_tp["params"] if "tp" in p}
    assert parts["blocks.3.attn.qkv.weight#tp1"]["of"] == "blocks.3.attn.qkv.weight" and parts[
        "blocks.3.attn.qkv.weight#tp1"]["tp"] == 2
    assert "blocks.3.attn.qkv.weight" in with_tp["pipeline"]["stage_params"][1]
    # pp x ep: each expert param once, at its full stacked shape, its ep placement recorded, and its
    # pieces written by its own stage's two ranks (ep rank r: rows [2r, 2r + 2) of the 4 experts).
    with_ep = zs.checkpoint.verify(_saved(root, "pp2ep2", 3))
    assert with_ep["pipeline"]["pp"] == 2 and with_ep["mesh"]["ep_size"] == 2
    experts = {p["fqn"]: p for p in with_ep["params"] if ".mlp.experts." in p["fqn"]}
    assert len(experts) == 4 * 4 and all(p["ep"] == {"placement": "shard", "dim": 0, "ep": 2, "edp": 1}
                                         for p in experts.values())
    first = experts["blocks.0.mlp.experts.fc_weight"]
    assert first["shape"][0] == 4 and [q["file"] for q in first["pieces"]] == ["rank-00000.safetensors",
                                                                             "rank-00001.safetensors"]
    assert [q["file"][:10] for q in experts["blocks.3.mlp.experts.fc_weight"]["pieces"]] == ["rank-00002",
                                                                                           "rank-00003"]


def test_export_and_plain_load_give_the_full_tensors(root, suite, tmp_path):
    saved = suite[("continuous", "pp2", 3)]["at_save"]
    out = tmp_path / "full.safetensors"
    assert cli(["ckpt", "export", str(_saved(root, "pp2", 3)), str(out)]) == 0
    assert _diff(load_file(out), saved) == 0
    plain = GPT(GPTConfig.named("tiny", vocab_size=saved["tok_emb.weight"].shape[0], seq_len=32))
    zs.load(_saved(root, "pp2", 3), plain, rng=False)
    assert _diff({k: v.detach() for k, v in plain.state_dict().items()}, saved) == 0


def test_hf_llama_export_opens_with_from_pretrained(root, suite, tmp_path):
    import transformers

    got = suite["llama"]
    assert got["tied"] == [("model.embed_tokens.weight", "lm_head.weight")]
    out = tmp_path / "hf"
    assert cli(["ckpt", "export", str(root / "llama-pp2"), "--hf", str(out)]) == 0
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert _diff({k: v.detach() for k, v in model.state_dict().items()}, got["params"]) == 0


def test_verify_inspect_and_reshard_work_on_a_pp_checkpoint(root, suite, tmp_path, capsys):
    source = _saved(root, "pp2", 3)
    assert cli(["ckpt", "verify", str(source)]) == 0
    assert cli(["ckpt", "inspect", str(source)]) == 0
    shown = capsys.readouterr().out
    assert "pipeline: pp 2, 2 stages (1f1b)" in shown and "tok_emb.weight = lm_head.weight" in shown
    out = tmp_path / "r2"
    assert cli(["ckpt", "reshard", str(source), str(out), "-w", "2"]) == 0
    assert cli(["ckpt", "verify", str(out)]) == 0
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    assert "pipeline" not in manifest and manifest["resharded_from"]["pp"] == 2
    saved = suite[("continuous", "pp2", 3)]["at_save"]
    plain = GPT(GPTConfig.named("tiny", vocab_size=saved["tok_emb.weight"].shape[0], seq_len=32))
    zs.load(out, plain, rng=False)
    assert _diff({k: v.detach() for k, v in plain.state_dict().items()}, saved) == 0


def test_saving_one_stage_or_the_wrong_optimizers_is_one_clear_line(root, suite):
    errors = suite["llama"]["errors"]
    print(errors)
    assert "one stage of a pipeline" in errors["one stage"] and "zs.save(path, pipe, pipe_optimizers)" in errors["one stage"]
    assert "pass the list pipe.optimizers(...) returned" in errors["optimizers"]
    assert all("\n" not in e for e in errors.values())
    assert not (root / "bad").exists()


def test_repair_rebuilds_a_lost_pp_manifest(root, suite, tmp_path):
    """Rank 0's header carries the skeleton of every stage (gathered from the pp ranks), so a lost
    manifest comes back whole from the rank files."""
    import shutil

    copy = Path(shutil.copytree(_saved(root, "pp2", 3), tmp_path / "lost"))
    original = json.loads((copy / fmt.MANIFEST).read_text())
    (copy / fmt.MANIFEST).unlink()
    assert cli(["ckpt", "repair", str(copy)]) == 0
    rebuilt = zs.checkpoint.verify(copy)
    assert rebuilt["params"] == original["params"] and rebuilt["pipeline"] == original["pipeline"]
    assert rebuilt["buffers"] == original["buffers"] and rebuilt["groups"] == original["groups"]

"""Checkpoints of split experts: saved at (shard 2 x ep 2), resumed at ep 1 (shard 4) and ep 4,
directly and after an offline ``ckpt reshard --ep``, and at ep 2 again from the ep-1 reshard (a
checkpoint with no experts placed); in a world of 1; exported whole, to one file and to a
``from_pretrained`` folder; loaded into a plain model in this process; its manifest repaired. HF
Mixtral saved under ep with tp ((shard 2 x tp 2), ep 2) resumes at tp 1 and at (tp 2, ep 4).

One spawned world of 4 runs every resume (ep_ckpt_workloads.suite): tiny-moe (with its
load-balancing loss) saved at stage 3, HF Mixtral saved at stage 2, resumed at other stages too.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import ep_ckpt_workloads as w  # noqa: E402
import ep_workloads as ew  # noqa: E402
import zeroshard as zs  # noqa: E402
from zeroshard.checkpoint import CheckpointError  # noqa: E402
from zeroshard.checkpoint.export import export, reshard  # noqa: E402
from zeroshard.checkpoint.format import rank_file  # noqa: E402
from zeroshard.checkpoint.verify import verify  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # the first test carries the group's spawn (slow on a loaded machine)

TOL = 1e-5  # the stage-0 tolerance of the parity tests
RESUMES = [(name, r) for name, resumes in w.RESUMES.items() for r in resumes]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ep_ckpt")


@pytest.fixture(scope="module")
def suite(root):
    return spawn(w.suite, 4, (str(root),), timeout_s=900)


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_manifest_records_expert_placement(root, suite):
    """An expert param is one entry of the model's own shape with its ep placement; its pieces are
    element runs of the whole tensor: ep rank 0's ranks (0 and 2) hold the first block of experts,
    each its edp shard of it."""
    manifest = _manifest(root / "gpt-ep2")
    params = {p["fqn"]: p for p in manifest["params"]}
    experts = [p for fqn, p in params.items() if ".mlp.experts." in fqn]
    saved = suite[0]["gpt"]["saved"]
    assert len(experts) == 8 and all(p["shape"] == list(saved[p["fqn"]].shape) and p["shape"][0] == 4 for p in experts)
    assert all(p["ep"] == {"placement": "shard", "dim": 0, "ep": 2, "edp": 2} for p in experts)
    first, second = set(), set()
    for p in experts:
        half = saved[p["fqn"]].numel() // 2
        assert all(q["stop"] <= half or q["start"] >= half for q in p["pieces"])  # no piece straddles two blocks
        first |= {q["file"] for q in p["pieces"] if q["stop"] <= half}
        second |= {q["file"] for q in p["pieces"] if q["start"] >= half}
    assert (first, second) == ({rank_file(0), rank_file(2)}, {rank_file(1), rank_file(3)})
    fc = params["blocks.0.mlp.experts.fc_weight"]
    assert fc["state"] == ["exp_avg", "exp_avg_sq"]
    assert "ep" not in params["blocks.0.mlp.router.weight"]
    assert manifest["mesh"]["ep_size"] == 2
    verify(root / "gpt-ep2")  # what `zeroshard ckpt verify` runs: sizes, sha256, coverage


def test_manifest_under_ep_with_tp_records_both_placements(root, suite):
    """Mixtral saved at (shard 2 x tp 2) with ep 2: the experts are placed over ep (edp 2: world / ep)
    and whole on dim 0 as without tp; the attention's projections are saved as one part per tp rank."""
    manifest = _manifest(root / "mixtral-tp-ep2")
    params = {p["fqn"]: p for p in manifest["params"]}
    experts = [p for fqn, p in params.items() if ".experts." in fqn]
    assert experts and all(p["ep"] == {"placement": "shard", "dim": 0, "ep": 2, "edp": 2} and "tp" not in p
                           for p in experts)
    parts = {fqn.split("#")[0].rsplit(".", 2)[-2] for fqn, p in params.items() if p.get("tp")}
    assert parts == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert (manifest["mesh"]["tp_size"], manifest["mesh"]["ep_size"]) == (2, 2)
    verify(root / "mixtral-tp-ep2")


@pytest.mark.parametrize("name, resume", RESUMES, ids=[f"{n}-{r.mesh}-stage{r.stage}-{r.source}" for n, r in RESUMES])
def test_resume_at_another_ep_equals_continuous(suite, name, resume):
    """Right after the load every param and every AdamW moment is bitwise the saved run's (each
    expert's moments land with that expert); the next update equals the continuous run's."""
    for rank in suite:
        got, out = rank[name], rank[name][resume]
        assert _diff(out["loaded"], got["saved"]) == 0
        assert _diff(out["moments"], got["moments"]) == 0
        assert min(v.abs().max().item() for k, v in got["moments"].items() if ".experts." in k) > 0
        diff = _diff(out["next"], got["continuous"])
        assert diff <= TOL
    print(f"{name} saved at {w.CASES[name].mesh} stage {w.CASES[name].stage} -> {resume.mesh} stage {resume.stage} "
          f"({resume.source}): loaded bitwise, next update vs continuous {diff:.2e}")


@pytest.mark.parametrize("resume", [w.Resume("ep4", 3, "reshard-ep4"), w.Resume("ep1", 3, "reshard-ep1")],
                         ids=["ep4", "ep1"])
def test_reshard_is_the_runtimes_layout(suite, resume):
    """At the saved stage, each rank of a run at the new ep reads its own file of the reshard only:
    at ep 4 each expert group is one block, and at ep 1 the expert groups join their units' dense
    ones, as the engine lays them out."""
    for rank, out in enumerate(suite):
        assert out["gpt"][resume]["files"] == [rank_file(rank)]


def test_reshard_records_the_new_placement(root, suite):
    four, one = _manifest(root / "gpt-reshard-ep4"), _manifest(root / "gpt-reshard-ep1")
    assert {json.dumps(p.get("ep")) for p in four["params"] if ".experts." in p["fqn"]} == \
        {json.dumps({"placement": "shard", "dim": 0, "ep": 4, "edp": 1})}
    assert four["mesh"]["ep_size"] == 4 and four["resharded_from"]["ep"] == 2
    assert not any("ep" in p for p in one["params"]) and "ep_size" not in one["mesh"]
    for path in ("gpt-reshard-ep4", "gpt-reshard-ep1"):
        verify(root / path)


def test_reshard_refuses_an_ep_it_cannot_place(root, suite, tmp_path):
    with pytest.raises(CheckpointError, match=r"^ep 3 does not divide world 4") as err:
        reshard(root / "gpt-ep2", tmp_path / "a", 4, ep=3)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=r"^ep 8 does not divide the 4 experts of 'blocks.0.mlp.experts"):
        reshard(root / "gpt-ep2", tmp_path / "b", 8, ep=8)
    with pytest.raises(CheckpointError, match=r"saved without expert parallelism.*--ep 1"):
        reshard(root / "gpt-reshard-ep1", tmp_path / "c", 4, ep=2)


def test_resume_in_one_process_equals_continuous(root, suite):
    """The Mixtral checkpoint of (shard 2 x ep 2) resumed by a world of 1 (stage 1): every expert and
    moment in place, and the next update equals the continuous run's (Mixtral adds no aux loss, so
    one rank's micro-batches give the same step)."""
    zs.init()
    try:
        out = w.resume_alone(str(root), "mixtral", stage=1)
    finally:
        zs.shutdown()
    got = suite[0]["mixtral"]
    assert _diff(out["loaded"], got["saved"]) == 0 and _diff(out["moments"], got["moments"]) == 0
    diff = _diff(out["next"], got["continuous"])
    print(f"mixtral saved at (shard 2 x ep 2) -> world 1, stage 1: next update vs continuous {diff:.2e}")
    assert diff <= TOL


def test_repair_rebuilds_the_expert_placement(root, suite, tmp_path):
    """A lost manifest comes back from the rank files' headers with every expert's placement and pieces."""
    import shutil

    from zeroshard.checkpoint.repair import repair

    shutil.copytree(root / "gpt-ep2", tmp_path / "lost")
    (tmp_path / "lost" / "manifest.json").unlink()
    repair(tmp_path / "lost")
    rebuilt, saved = _manifest(tmp_path / "lost"), _manifest(root / "gpt-ep2")
    assert rebuilt["params"] == saved["params"] and rebuilt["mesh"] == saved["mesh"]
    verify(tmp_path / "lost")


def test_export_gives_full_tensors(root, suite, tmp_path):
    export(root / "gpt-ep2", tmp_path / "full.safetensors")
    full = load_file(str(tmp_path / "full.safetensors"))
    assert _diff(full, suite[0]["gpt"]["saved"]) == 0


def test_plain_model_loads_the_checkpoint(root, suite):
    """One process, no process group: the plain model gets every expert in place."""
    model = ew.build_model(w.CASES["gpt"])
    zs.load(root / "gpt-ep2", model, rng=False)
    assert _diff({k: v.detach() for k, v in model.state_dict().items()}, suite[0]["gpt"]["saved"]) == 0


def test_hf_export_of_a_mixtral_checkpoint_opens_in_from_pretrained(root, suite, tmp_path):
    """``ckpt export --hf`` of the ep-2 Mixtral checkpoint: from_pretrained opens the folder with no
    missing or unexpected keys, and holds the saved params (experts stacked whole)."""
    import transformers

    from zeroshard.checkpoint.hf import export_checkpoint

    out = export_checkpoint(root / "mixtral-ep2", tmp_path / "hf", max_shard_size="20KB")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    saved, state = suite[0]["mixtral"]["saved"], model.state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)

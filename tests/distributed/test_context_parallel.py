"""Context parallelism: sequences split over cp 2, each attention scheme, against one process on the
whole sequences (10 steps, fp32, gloo), on zeroshard's GPT and a save_pretrained Qwen3 folder (GQA,
rotary positions); the ledger's cp bytes against the shapes; the one-line refusals.

One spawned world-4 group runs every case (cp_workloads.CASES); bench/context_parallel.py runs the
heavier matrix (cp 4, tp x cp, sliding windows, memory) and prints its figures.
"""

from __future__ import annotations

import functools
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

import cp_workloads as w
from zeroshard.models import GPT, GPTConfig
from zeroshard.parallel.cp import apply_context_parallel, positions, split
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.config_checks import check_runnable
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.train import reference_train

pytestmark = pytest.mark.timeout(900)
PARAM_TOL, LOSS_TOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cp")
    w.make_tokens(root)  # next to the folder: the packed cases' documents
    w.make_moe_folder(root)
    return w.make_folder(root)


@pytest.fixture(scope="module")
def suite(folder) -> dict:
    return spawn(w.suite, w.WORLD, args=(str(folder),), timeout_s=900)


@pytest.fixture(scope="module")
def references(folder) -> dict:
    return {name: reference_train(w.train_config(w.model_name(name, str(folder)))) for name in ("gpt", "qwen3")}


@functools.cache
def other_reference(folder: Path, name: str, layout: tuple) -> dict:
    return reference_train(w.case_config(name, "ring", layout, str(folder)))


def _diffs(got: dict, ref: dict) -> tuple[float, float]:
    assert set(got["params"]) == set(ref["params"])
    param_diff = max((got["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    return param_diff, loss_diff


COMPOSED = w.PP_CASES + w.PACK_CASES + w.EP_CASES


@pytest.mark.parametrize("case", COMPOSED, ids=[f"{n}-{s}-{lay[0]}-stage{lay[2]}" for n, s, lay in COMPOSED])
def test_pp_ep_x_cp_and_packed_documents_train_as_one_process(suite, references, folder, case):
    """pp 2 x cp 2 (the stages' sequences split); packed documents under cp 2 x shard 2 (each
    document's causal mask and positions across the split); ep 2 x cp 2 x shard 2 (each cp rank's
    tokens routed over ep, the load-balancing loss the whole batch's): against one process on
    whole rows."""
    name, scheme, layout = case
    # One process on whole rows: pp does not change its numbers (no MoE), nor the scheme.
    ref = references[name] if layout[0] == "pp2" else other_reference(folder, name, layout)
    param_diff, loss_diff = _diffs(suite[0]["cases"][(name, scheme, layout[0], layout[2])], ref)
    print(f"{name} {scheme} cp 2 x {layout[0]} stage {layout[2]}: |param diff| {param_diff:.2e}, "
          f"|loss diff| {loss_diff:.2e}")
    assert param_diff <= PARAM_TOL and loss_diff <= LOSS_TOL


@pytest.mark.parametrize("case", w.CASES, ids=[f"{n}-{s}-{lay[0]}-stage{lay[2]}" for n, s, lay in w.CASES])
def test_cp_trains_as_one_process_on_whole_sequences(suite, references, case):
    name, scheme, (layout, _, stage) = case
    got, ref = suite[0]["cases"][(name, scheme, layout, stage)], references[name]
    assert set(got["params"]) == set(ref["params"])
    param_diff = max((got["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    print(f"{name} {scheme} cp 2 x {layout} stage {stage}: |param diff| {param_diff:.2e}, |loss diff| {loss_diff:.2e}")
    assert param_diff <= PARAM_TOL and loss_diff <= LOSS_TOL
    for other in suite[1:]:  # every rank ends with the same full model
        theirs = other["cases"][(name, scheme, layout, stage)]["params"]
        assert all(torch.equal(theirs[k], got["params"][k]) for k in got["params"])


def test_a_cp_checkpoint_resumes_at_cp_1(suite, references):
    """Saved after 5 steps at cp 2 x shard 2, resumed for 5 more at cp 1 over the 4 ranks: the run
    ends where one process does after 10 (cp holds no params of its own)."""
    got, ref = suite[0]["resumed"], references["gpt"]
    param_diff = max((got["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"][w.STEPS // 2:], strict=True))
    print(f"cp 2 -> cp 1 resume: |param diff| {param_diff:.2e}, |loss diff| {loss_diff:.2e}")
    assert param_diff <= PARAM_TOL and loss_diff <= LOSS_TOL


def test_zero_shards_over_dp_times_cp(suite):
    groups = suite[0]["cases"][("gpt", "ring", "shard2", 3)]["groups"]
    assert groups == {"cp": 2, "shard": 4, "dp": 4, "batch_dp": 2}
    groups = suite[0]["cases"][("gpt", "ring", "replicate2", 3)]["groups"]
    assert groups == {"cp": 2, "shard": 2, "dp": 4, "batch_dp": 2}


def _cp_bytes_from_shapes(name: str, scheme: str) -> int:
    """One step's cp bytes on a rank, from the shapes: per layer, ring all-gathers k and v (the
    ledger counts the gathered output) in forward and again in backward's recompute, and
    reduce-scatters their grads (the full input); Ulysses
    sends q, k, v and the output through an all-to-all each way, and their grads back."""
    if name == "gpt":
        cfg = GPTConfig.named("tiny")
        layers, q_width, kv_width = cfg.n_layer, cfg.n_embd, cfg.n_embd
    else:
        layers, q_width, kv_width = 2, 4 * 8, 2 * 8
    rows = w.BATCH // 2  # dp 2: each rank's samples, cp 2 ranks of each
    if scheme == "ring":
        return layers * 6 * rows * w.SEQ * kv_width * 4  # fp32
    return layers * 2 * rows * (w.SEQ // 2) * (2 * q_width + 2 * kv_width) * 4


@pytest.mark.parametrize("name,scheme", [("gpt", "ring"), ("gpt", "ulysses"), ("qwen3", "ring"), ("qwen3", "ulysses")])
def test_ledger_cp_bytes_equal_the_shapes(suite, name, scheme):
    got = suite[0]["cases"][(name, scheme, "shard2", 3)]["cp_bytes"]
    want = _cp_bytes_from_shapes(name, scheme)
    print(f"{name} {scheme}: ledger cp bytes/step {got[0]:,} vs shapes {want:,}")
    assert got == [want] * w.STEPS


@pytest.mark.parametrize("scheme,layout,stage", [(s, lay[0], lay[2]) for n, s, lay in w.CASES if n == "gpt"])
def test_the_step_schedule_lists_the_ledger_s_cp_exchanges(suite, scheme, layout, stage):
    """The runtime's step schedule (which the planner and the simulator read) lists every cp
    exchange the ledger recorded in a step: the same calls, phases and bytes (accumulation included)."""
    got = suite[0]["cases"][("gpt", scheme, layout, stage)]
    listed, recorded = Counter(got["schedule_cp"]), Counter(got["ledger_cp"])
    print(f"gpt {scheme} {layout} stage {stage}: schedule cp bytes {sum(b for *_, b in got['schedule_cp']):,}, "
          f"ledger {sum(b for *_, b in got['ledger_cp']):,}")
    assert listed == recorded and len(listed) > 0


def test_ring_layout_is_load_balanced_and_keeps_global_positions():
    seq, cp = 16, 2  # 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert positions(seq, cp=cp, rank=0, scheme="ring").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(seq, cp=cp, rank=1, scheme="ring").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert positions(seq, cp=cp, rank=1, scheme="ulysses").tolist() == list(range(8, 16))
    ids = torch.arange(seq).reshape(1, seq)
    assert torch.equal(split(ids, cp=cp, rank=0, scheme="ring")[0], positions(seq, cp=cp, rank=0, scheme="ring"))


def _fake_mesh(cp: int) -> object:
    return types.SimpleNamespace(cp_size=cp, tp_size=1, cp_rank=0)


def test_one_line_errors():
    with pytest.raises(ValueError, match=r"^sequence length 30 does not divide into 2 x cp = 4 load-balanced") as e:
        check_runnable(TrainConfig(model="tiny", nproc=2, cp=2, seq_len=30))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^ulysses attention splits the heads over cp=8 ranks, but the model has 4 "):
        apply_context_parallel(GPT(GPTConfig.named("tiny", seq_len=32)), _fake_mesh(8), "ulysses")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^cp=2: Linear's attention takes no path context parallelism can split"):
        apply_context_parallel(torch.nn.Linear(2, 2), _fake_mesh(2))  # type: ignore[arg-type]
    dims = TrainConfig(model="tiny", nproc=4, cp=2, pp=2, seq_len=32).dims  # pp x cp composes
    assert (dims.pp, dims.cp, dims.dp, dims.zero_shard) == (2, 2, 1, 2)
    with pytest.raises(ValueError, match=r"^cp=3 does not divide the 4 ranks"):
        TrainConfig(model="tiny", nproc=4, cp=3, seq_len=36)


def test_pp_ep_and_packing_with_cp_reach_the_flags_and_the_toml_keys(tmp_path):
    """`zeroshard train` resolves pp x cp (TOML), ep x cp (flags) and packed documents with cp
    (flags) to a runnable config, checked as before a launch, where each was refused before."""
    from zeroshard.cli.main import build_parser
    from zeroshard.cli.train import check_before_launch, config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nnproc = 4\n[parallel]\ncp = 2\npp = 2\ncp_attention = "ulysses"\n'
                    '[data]\nseq_len = 32\n')
    tokens = str(w.make_tokens(tmp_path))
    runs = {"pp": ["train", "--config", str(toml)],
            "ep": ["train", "--model", "tiny-moe", "--nproc", "4", "--cp", "2", "--ep", "2", "--seq-len", "32"],
            "packed": ["train", "--nproc", "2", "--cp", "2", "--data", tokens, "--doc-mask", "--seq-len", "32"]}
    got = {}
    for name, argv in runs.items():
        cfg = config_from_args(build_parser().parse_args(argv))
        check_before_launch(cfg)
        got[name] = (cfg.dims.pp, cfg.dims.cp, cfg.dims.ep, cfg.parallel.cp_attention, cfg.data.doc_mask)
    assert got == {"pp": (2, 2, 1, "ulysses", False), "ep": (1, 2, 2, "ring", False), "packed": (1, 2, 1, "ring", True)}

"""Hugging Face GPT-2 and Llama under zs.shard: blocks found with no hints, tied embeddings, every
stage against a plain single-process run of the same model, and meta-device init."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_workloads as hw  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402

PARAM_TOL = 1e-5
LOSS_TOL = 1e-5
BLOCKS = {"hf:gpt2-tiny": ("GPT2Block", "transformer.h"), "hf:llama-tiny": ("LlamaDecoderLayer", "model.layers")}
TIED = {"hf:gpt2-tiny": ["lm_head.weight", "transformer.wte.weight"],
        "hf:llama-tiny": ["lm_head.weight", "model.embed_tokens.weight"]}


@pytest.fixture(scope="module")
def references():
    return {name: hw.reference_run(name) for name in hw.MODELS}


@pytest.fixture(scope="module")
def world2():
    return spawn(hw.parity_suite, 2, timeout_s=420)[0]


def max_param_diff(got: dict, ref: dict) -> float:
    assert ref.keys() == got.keys()
    return max((got[k].float() - ref[k].float()).abs().max().item() for k in ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", hw.MODELS)
def test_matches_single_process(references, world2, name, stage):
    run, ref = world2[(name, stage)], references[name]
    diff = max_param_diff(run["params"], ref["params"])
    loss_diff = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    print(f"{name} world=2 stage={stage}: max|param - single| = {diff:.3e}, max|loss - single| = {loss_diff:.3e}")
    assert diff <= PARAM_TOL
    assert loss_diff <= LOSS_TOL
    assert run["losses"][-1] < run["losses"][0], "training must make progress"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", hw.MODELS)
def test_stages_are_bitwise_ddp_at_world2(world2, name, stage):
    ddp, run = world2[(name, 0)], world2[(name, stage)]
    assert all(run["params"][k].equal(ddp["params"][k]) for k in ddp["params"])
    assert run["losses"] == ddp["losses"]


@pytest.mark.parametrize("name", hw.MODELS)
def test_blocks_are_found_without_hints_and_the_embedding_tie_is_one_param(world2, name):
    run = world2[(name, 3)]
    kind, container = BLOCKS[name]
    assert run["block_types"] == [kind]
    assert run["blocks"] == [f"{container}.{i}" for i in range(4)]
    assert sorted(run["units"]) == sorted(run["blocks"] + ["<root>"]), "stage 3: one unit per block, plus the root"
    assert run["tied"] == [TIED[name]], "the tied embedding / LM head must be one flat param, owned once"


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", hw.MODELS)
def test_meta_init_is_bitwise_the_full_build(world2, name, stage):
    case = world2["meta"][(name, stage)]
    assert case["path"] == "meta"
    assert case["equal"], f"{name} stage {stage}: meta-device init differs from the full build"
    assert case["buffers_equal"], f"{name}: buffers (rotary inv_freq) differ from the full build"

"""torch.compile under zs.shard at world 2: compiled runs match eager at every stage, graphs are
compiled once (no recompiles), a block's forward has the documented number of graph breaks, and a
use the runtime does not support is refused by name. Backend aot_eager (see compile_workloads)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import compile_workloads as cw  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402

# The spawned suite takes 83 s on the 2 shared cores at load ~8 but took 9.7 min at load ~35 (six
# other suites); dynamo and AOTAutograd are CPU-bound, so contention hits them hardest.
pytestmark = pytest.mark.timeout(900)

LOSS_TOL = 1e-5
BLOCK_GRAPH_BREAKS = 0
"""docs/compile.md: a GPT Block or LlamaDecoderLayer forward compiles to one graph, no break."""


@pytest.fixture(scope="module")
def world2():
    ranks = spawn(cw.compile_suite, 2, timeout_s=900)
    return ranks


def _check(case: dict, label: str) -> None:
    diff = max(abs(a - b) for a, b in zip(case["eager"], case["compiled"]))
    print(f"{label}: max|loss compiled - eager| over {cw.STEPS} steps = {diff:.3e}, graphs after each step {case['graphs']}")
    assert len(case["compiled"]) == cw.STEPS
    assert diff <= LOSS_TOL
    assert case["graphs"][0] >= 1, "nothing was compiled: dynamo fell back to eager"
    assert case["graphs"][-1] == case["graphs"][0], "graphs were compiled again after step 1 (recompiles)"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_blocks_match_eager(world2, stage):
    for rank, out in enumerate(world2):
        _check(out[("tiny", stage)], f"rank {rank} tiny stage {stage} compile={cw.BACKEND!r}")


def test_checkpointed_segments_wrap_the_compiled_forward(world2):
    _check(world2[0]["checkpointed"], "tiny stage 3 checkpointing=every:2")


def test_hf_llama_blocks_compile(world2):
    _check(world2[0]["llama"], "hf:llama-tiny stage 3")
    # Four decoder layers, one graph: a graph break inside the layer would add at least one more.
    assert world2[0]["llama"]["graphs"][-1] == 1


def test_whole_model_compiled_after_shard(world2):
    # Stage 3: a graph break at each unit's hooks (docs/compile.md). Stages 0-2 compile to one graph
    # and match eager as well; left out here because that graph takes the longest to compile.
    _check(world2[0][("whole", 3)], "model.compile() after zs.shard, stage 3")


def test_graph_breaks_per_block(world2):
    breaks = world2[0]["breaks"]["tiny"]
    print(f"tiny GPT Block: torch._dynamo.explain {breaks}")
    assert breaks["block"] == BLOCK_GRAPH_BREAKS, breaks["block_reasons"]
    assert breaks["block_graphs"] == 1


def test_compiling_a_checkpointed_unit_yourself_is_refused(world2):
    for out in world2:
        message = out["refused"]["checkpointed"]
        assert message is not None, "the step ran: the checkpointed unit went eager without a word"
        assert "blocks.0" in message and "zs.shard(..., compile=...)" in message


def test_compiled_autograd_is_refused(world2):
    for out in world2:
        message = out["refused"]["compiled_autograd"]
        assert message is not None and message.startswith("compiled autograd is not supported")
        assert "\n" not in message

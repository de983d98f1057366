"""Pipeline stages without a process group: splits, schedule rules, the config's one-line errors."""

from __future__ import annotations

import pytest

from zeroshard.comm.dims import ParallelDims
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.config_checks import check_runnable
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.parallel.pipeline.layout import block_names, layout_of
from zeroshard.parallel.pipeline.own_forward import StageModule
from zeroshard.parallel.pipeline.schedules import check_microbatches, schedule_spec, stages_per_rank
from zeroshard.parallel.pipeline.split import even_split, explicit_split
from zeroshard.parallel.pipeline.tied import find_tied


def test_even_split_and_its_error():
    assert even_split(4, 2).blocks == ((0, 1), (2, 3))
    assert even_split(4, 4).blocks == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError, match="3 pipeline stages do not divide the model's 4 blocks"):
        even_split(4, 3)


def test_explicit_split_names_blocks_in_order():
    names = [f"blocks.{i}" for i in range(4)]
    assert explicit_split([["blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]], names, 2).blocks == ((0,), (1, 2, 3))
    for bad, message in [([["blocks.1"], ["blocks.0", "blocks.2", "blocks.3"]], "in model order"),
                         ([["tok_emb", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3"]], "not a block"),
                         ([["blocks.0", "blocks.1", "blocks.2", "blocks.3"]], "1 stage lists but the pipeline has 2"),
                         ([[], names], "is empty")]:
        with pytest.raises(ValueError, match=message):
            explicit_split(bad, names, 2)


def test_stage_modules_keep_the_model_names_and_the_tie_is_found():
    model = GPT(GPTConfig.named("tiny"))
    split = even_split(4, 2)
    layout = layout_of(model)
    first = StageModule(model, layout, split.blocks[0], stage_index=0, num_stages=2)
    last = StageModule(model, layout, split.blocks[1], stage_index=1, num_stages=2)
    assert [n for n, _ in first.named_parameters()][:3] == ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight"]
    assert {n.split(".")[1] for n, _ in last.named_parameters() if n.startswith("blocks.")} == {"2", "3"}
    assert "lm_head.weight" in dict(last.named_parameters(remove_duplicate=False))
    assert block_names(layout)[-1] == "blocks.3"
    tied = find_tied(model, layout, split)
    assert [(t.owner_fqn, t.copy_fqn, t.owner_stage, t.copy_stage) for t in tied] == \
        [("tok_emb.weight", "lm_head.weight", 0, 1)]


def test_schedule_rules_are_one_line():
    one, inter = schedule_spec("1f1b"), schedule_spec("interleaved-1f1b")
    assert stages_per_rank(one, 0) == 1 and stages_per_rank(inter, 0) == 2
    for call, message in [(lambda: schedule_spec("zb"), "pp_schedule='zb' is not a schedule"),
                          (lambda: stages_per_rank(one, 2), "runs one stage per rank"),
                          (lambda: check_microbatches(one, microbatches=1, pp=2, local_batch=4), "at least pp=2"),
                          (lambda: check_microbatches(one, microbatches=4, pp=2, local_batch=6),
                           "microbatches=4 does not split"),
                          (lambda: check_microbatches(inter, microbatches=5, pp=2, local_batch=10), "rounds of pp=2")]:
        with pytest.raises(ValueError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def _dims_of_shape(shape, names, world):
    dims = ParallelDims.from_shape(shape, names, world)
    return dims.shard, dims.tp, dims.pp


def test_mesh_shape_names_pp_outermost():
    assert _dims_of_shape((2, 2), ("pp", "shard"), 4) == (2, 1, 2)
    assert _dims_of_shape((2, 1, 2), ("pp", "shard", "tp"), 4) == (1, 2, 2)
    with pytest.raises(ValueError, match="covers 6 ranks but the world has 4"):
        _dims_of_shape((2, 3), ("pp", "shard"), 4)
    with pytest.raises(ValueError, match="in that order"):
        _dims_of_shape((2, 2), ("shard", "pp"), 4)


def test_train_config_takes_meta_init_under_pp():
    assert TrainConfig(pp=2, nproc=4, batch=8, init="meta").init == "meta"


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "gpipe", "looped-bfs"])
def test_train_config_takes_compile_under_every_schedule_with_one_backward_pass(schedule):
    assert TrainConfig(pp=2, nproc=4, batch=8, compile=True, pp_schedule=schedule).compile.enabled


@pytest.mark.parametrize("kw, message", [
    (dict(pp=3, nproc=6), "pp=3 x 1 stages per rank does not divide the 4 blocks"),
    (dict(pp=2, nproc=4, batch=8, microbatches=1), "at least pp=2 microbatches"),
    (dict(pp=2, nproc=4, batch=12, microbatches=4), "microbatches=4 does not split"),
    (dict(pp=3, nproc=6, batch=6, model="hf:gpt2-tiny"), "pp=3 x 1 stages per rank does not divide the 4 blocks"),
    (dict(pp=2, nproc=4, batch=8, compile=True, pp_schedule="interleaved-zero-bubble"),
     "compile is not composed with the interleaved-zero-bubble schedule"),
    (dict(pp=2, nproc=4, batch=8, model="hf:llama-tiny", init="meta"),
     "init=meta under pp > 1 is not yet composed with a Hugging Face preset"),
    (dict(pp=2, nproc=4, batch=8, checkpointing="all", pp_schedule="interleaved-zero-bubble"),
     "checkpointing='all' is not composed with the interleaved-zero-bubble schedule"),
])
def test_train_config_refuses_pipelines_it_cannot_run(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        check_runnable(TrainConfig(**kw))
    assert "\n" not in str(e.value)


def test_a_pretrained_folder_is_cut_by_its_config(tmp_path):
    """pp reads a folder's config.json: its layers are the blocks, whatever the architecture; a config
    that counts none needs the blocks path."""
    import json

    def folder(name: str, **config) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return str(tmp_path / name)

    assert check_runnable(TrainConfig(pp=2, nproc=4, batch=8, model=folder("llama", model_type="llama",
                                                                           num_hidden_layers=4))).pp == 2
    for model, message in [(folder("odd", model_type="qwen2", num_hidden_layers=3), "does not divide the 3 blocks"),
                           (folder("gpt2", model_type="gpt2", n_layer=3), "does not divide the 3 blocks"),
                           (folder("own", model_type="own"), "counts no layers .* give the model's blocks path")]:
        with pytest.raises(ValueError, match=message) as e:
            check_runnable(TrainConfig(pp=2, nproc=4, batch=8, model=model))
        assert "\n" not in str(e.value)
    own = TrainConfig(pp=2, nproc=4, batch=8, model=str(tmp_path / "own"), pp_blocks="transformer.h")
    assert check_runnable(own).pipeline.blocks == "transformer.h"


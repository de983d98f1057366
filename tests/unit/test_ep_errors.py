"""Expert parallelism's one-line errors, before any rank or group exists, and the `ep` flag/TOML key."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.cli.main import main
from zeroshard.comm.dims import ParallelDims, check_ep_layout
from zeroshard.trainer.config import TrainConfig, config_from_sources
from zeroshard.trainer.config_checks import check_runnable
from zeroshard.parallel.experts import ExpertParallelError, check_ep, moe_layers
from zeroshard.models import GPT, GPTConfig


def test_ep_in_a_named_shape_is_carved_out_of_the_dense_shard():
    assert ParallelDims.from_shape((2, 2), ("shard", "ep"), 4) == ParallelDims(shard=4, ep=2)
    assert ParallelDims.from_shape((2, 2, 2), ("replicate", "shard", "ep"), 8) == ParallelDims(replicate=2, shard=4, ep=2)
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 2\) covers 4 ranks but the world has 8"):
        ParallelDims.from_shape((2, 2), ("shard", "ep"), 8)
    with pytest.raises(ValueError, match="in that order"):
        ParallelDims.from_shape((2, 2), ("ep", "shard"), 4)


@pytest.mark.parametrize("ep, dp, tp, message", [
    (3, 4, 1, "ep=3 does not divide the 4 data-parallel ranks"),
    (4, 3, 2, r"ep=4 does not divide the 6 data-parallel x tp ranks \(dp 3 x tp 2\)"),
    (3, 3, 2, "ep=3 with tp=2: an ep group must hold whole tp groups or lie inside one"),
    (0, 4, 1, "ep=0 must be a positive int"),
])
def test_mesh_refuses_an_ep_that_does_not_fit(ep, dp, tp, message):
    with pytest.raises(ValueError, match=message) as err:
        check_ep_layout(ep, dp, tp)
    assert "\n" not in str(err.value)


def test_a_model_ep_cannot_split_is_named():
    with zs.meta_init():
        dense = GPT(GPTConfig.named("tiny"))
        moe = GPT(GPTConfig.named("tiny-moe"))
    with pytest.raises(ExpertParallelError,
                       match="ep=2 needs a mixture-of-experts model, but GPT declares no expert-parallel plan"):
        check_ep(dense, 2)
    with pytest.raises(ExpertParallelError, match="ep=3 does not divide the 4 experts of blocks.0.mlp.experts"):
        check_ep(moe, 3)
    assert [layer.name for layer in check_ep(moe, 4)] == [f"blocks.{i}.mlp.experts" for i in range(4)]


def test_the_hf_plan_finds_mixtral_and_qwen_moe_experts():
    tf = pytest.importorskip("transformers")
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    models = [tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **common)),
              tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=32, num_experts=4, **common)),
              tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=48, **common))]
    found = [[(layer.name, layer.num_experts) for layer in moe_layers(m)] for m in models]
    assert found[0] == found[1] == [(f"model.layers.{i}.mlp.experts", 4) for i in range(2)] and found[2] == []


def test_the_gpt_moe_layer_is_the_dense_mlp_per_expert():
    """With one expert and top-1 routing (weight 1), an MoE GPT computes the dense GPT's function."""
    torch.manual_seed(0)
    moe = GPT(GPTConfig.named("tiny", n_expert=1, expert_top_k=1))
    dense = GPT(GPTConfig.named("tiny"))
    with torch.no_grad():
        for block, ref in zip(moe.blocks, dense.blocks):
            experts = block.mlp.experts
            experts.fc_weight.copy_(ref.mlp.fc.weight[None]), experts.fc_bias.copy_(ref.mlp.fc.bias[None])
            experts.proj_weight.copy_(ref.mlp.proj.weight[None]), experts.proj_bias.copy_(ref.mlp.proj.bias[None])
        for name, p in dense.named_parameters():
            if ".mlp." not in name:
                dict(moe.named_parameters())[name].copy_(p)
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(moe(x), dense(x), atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (("--model", "tiny-moe", "--nproc", "4", "--ep", "3"), "ep=3 does not divide the 4 data-parallel ranks"),
    (("--model", "tiny", "--nproc", "4", "--ep", "2"), "ep=2 needs a mixture-of-experts model, but tiny has no MoE"),
    (("--model", "tiny-moe", "--nproc", "8", "--batch", "8", "--ep", "8"), "ep=8 does not divide the 4 experts"),
    (("--model", "tiny-moe", "--nproc", "6", "--batch", "12", "--tp", "2", "--ep", "3"),
     "ep=3 with tp=2: an ep group must hold whole tp groups or lie inside one"),
    (("--model", "hf:gpt2-tiny", "--nproc", "4", "--tp", "2", "--ep", "2"), "has no tensor-parallel plan"),
    # Under pp the experts are split inside each stage: ep must divide a stage's ranks.
    (("--model", "tiny-moe", "--nproc", "4", "--pp", "2", "--ep", "4"),
     "ep=4 does not divide the 2 data-parallel ranks of a pipeline stage"),
    (("--model", "tiny-moe", "--nproc", "8", "--batch", "8", "--pp", "2", "--tp", "2", "--ep", "2"),
     "ep=2 with tp=2 under pp=2 is not composed yet"),
])
def test_train_and_verify_refuse_a_bad_ep_in_one_line(capsys, argv, message):
    for command in ("train", "verify"):
        assert main([command, *argv]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"zeroshard {command}: error: ") and message in err and err.count("\n") == 1, err


def test_ep_is_a_flag_and_a_toml_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "tiny-moe"\nnproc = 4\nep = 2\nstage = 3\n')
    assert config_from_sources(path, {}).ep == 2
    assert config_from_sources(path, {"ep": 4}).ep == 4  # a flag overrides the file
    assert TrainConfig(model="tiny-moe", nproc=4, ep=4, batch=8).ep == 4
    both = tmp_path / "tp.toml"  # ep with tp: the ep ranks are borrowed from dp x tp
    both.write_text('model = "tiny-moe"\nnproc = 4\ntp = 2\nep = 2\nstage = 3\n')
    assert (config_from_sources(both, {}).tp, config_from_sources(both, {}).ep) == (2, 2)
    assert TrainConfig(model="tiny-moe", nproc=4, tp=2, ep=4, batch=8).ep == 4
    path.write_text('model = "tiny-moe"\nnproc = 4\nep = 2\npp = 2\nstage = 3\n')  # ep inside each pp stage
    assert (config_from_sources(path, {}).ep, config_from_sources(path, {}).pp) == (2, 2)


def test_pp_takes_moe_folders_but_refuses_their_router_logits_loss_in_one_line(tmp_path):
    """A Mixtral / Qwen-MoE folder is cut into stages (its experts split over ep inside each); one whose
    config asks for transformers' load-balancing loss is refused before launch: that loss is one term
    over every layer's tokens, which no stage holds."""
    import json

    config = {"model_type": "mixtral", "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_runnable(TrainConfig(model=str(tmp_path), nproc=4, pp=2, ep=2, batch=8)).pp == 2
    (tmp_path / "config.json").write_text(json.dumps({**config, "output_router_logits": True,
                                                      "router_aux_loss_coef": 0.02}))
    with pytest.raises(ValueError, match="asks for its routers' load-balancing loss") as err:
        check_runnable(TrainConfig(model=str(tmp_path), nproc=4, pp=2, ep=2, batch=8))
    assert "\n" not in str(err.value) and "output_router_logits to false" in str(err.value)

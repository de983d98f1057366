"""The MoE layout comes from the plan a model declares (transformers' base_model_ep_plan, the GPT's
ep_plan), not from its class name; and the experts module's own forward, run on one ep rank's
block of experts (LocalExperts, top-1 with unit weights), gives that rank's share of the whole
forward: summed over two simulated ranks it is the model's experts forward, for each family's
experts code (eager and grouped_mm), biases, interleaved gates and transposed weights included."""

from __future__ import annotations

import copy

import pytest

tf = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import zeroshard as zs  # noqa: E402
from zeroshard.models.gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.parallel.experts import ExpertParallelError, LocalExperts, check_ep, moe_layout  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, num_experts_per_tok=2)


def family(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "olmoe":
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=32, num_experts=4, **COMMON))
    if name == "gpt_oss":
        return tf.GptOssForCausalLM(tf.GptOssConfig(intermediate_size=16, num_local_experts=4, head_dim=8,
                                                    sliding_window=4, **COMMON))
    if name == "deepseek_v3":
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, head_dim=4, **{**COMMON, "num_key_value_heads": 4}))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON))
    if name == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(moe_intermediate_size=32, num_experts=4, **COMMON))
    return GPT(GPTConfig.named("tiny-moe"))


PARAMS = {"gpt_oss": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
          "gpt": ("fc_weight", "fc_bias", "proj_weight", "proj_bias")}


@pytest.mark.parametrize("name, blocks", [("olmoe", range(4)), ("gpt_oss", range(4)), ("deepseek_v3", range(1, 4)),
                                          ("mixtral", range(4)), ("qwen2_moe", range(4)), ("gpt", range(4))])
def test_the_layout_is_the_declared_plan(name, blocks):
    """Every experts module the plan names, with the params it marks stacked; DeepSeek-V3's first
    block is dense (first_k_dense_replace=1); the GPT's router is its MoE MLP."""
    model = family(name)
    layers = moe_layout(model)
    prefix = "blocks.{}.mlp.experts" if name == "gpt" else "model.layers.{}.mlp.experts"
    assert [layer.name for layer in layers] == [prefix.format(i) for i in blocks]
    assert all(layer.params == PARAMS.get(name, ("gate_up_proj", "down_proj")) for layer in layers)
    assert all(layer.num_experts == 4 and layer.expert is None for layer in layers)
    assert all((layer.router is not None) == (name == "gpt") for layer in layers)


def _block(module: nn.Module, rank: int, local: int) -> nn.Module:
    """Ep rank ``rank``'s module: its own block of every stacked param, as zs.expert_parallel leaves it."""
    block = copy.deepcopy(module)
    for name, param in module.named_parameters(recurse=False):
        setattr(block, name, nn.Parameter(param.detach()[rank * local:(rank + 1) * local]))
    return block


def _split_forward(module: nn.Module, hidden, index, weights, ep: int = 2) -> torch.Tensor:
    """What ep ranks compute together: each rank its block of the experts, its own forward on the
    rows routed there (LocalExperts), weighted and summed into the tokens on the sender."""
    total = module.num_experts
    local = total // ep
    out = torch.zeros_like(hidden)
    token = torch.arange(hidden.shape[0]).repeat_interleave(index.shape[1])
    for rank in range(ep):
        mine = (index.reshape(-1) // local) == rank
        rows = LocalExperts(_block(module, rank, local), total, local)(hidden[token[mine]],
                                                                       index.reshape(-1)[mine] % local)
        out.index_add_(0, token[mine], rows * weights.reshape(-1)[mine][:, None])
    return out


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("name", ["olmoe", "gpt_oss", "deepseek_v3", "mixtral", "qwen2_moe", "gpt"])
def test_local_experts_on_two_ranks_are_the_models_experts_forward(name, impl):
    if name == "gpt" and impl == "grouped_mm":
        pytest.skip("the GPT's experts have one forward")
    model = family(name)
    if name != "gpt":
        model.set_experts_implementation(impl)
    layer = moe_layout(model)[0]
    with torch.no_grad():
        for p in layer.module.parameters():
            p.normal_(0, 0.2)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(24, 64 if name == "gpt" else 32, generator=g)  # the GPT's tiny-moe is 64 wide
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=g)
    with torch.no_grad():
        whole = type(layer.module).forward(layer.module, hidden, index, weights)
        split = _split_forward(layer.module, hidden, index, weights)
        nothing = LocalExperts(_block(layer.module, 1, 2), 4, 2)(hidden[:0], index.reshape(-1)[:0])
    diff = (split - whole).abs().max().item()
    print(f"{name} ({impl}): max |split - whole| {diff:.1e} of {whole.abs().max().item():.2f}")
    assert diff <= 1e-6 and whole.abs().max() > 0.1
    assert nothing.shape == (0, hidden.shape[1])


def test_empty_rows_keep_every_stacked_param_in_the_graph():
    """A rank that receives no rows still gives each stacked param a (zero) grad, so every rank's
    reduction holds the same params."""
    layer = moe_layout(family("gpt_oss"))[0]
    block = _block(layer.module, 0, 2)
    rows = torch.zeros(0, 32, requires_grad=True)
    LocalExperts(block, 4, 2)(rows, torch.zeros(0, dtype=torch.long)).sum().backward()
    grads = [getattr(block, p).grad for p in layer.params]
    assert all(g is not None and g.abs().sum() == 0 for g in grads)


def test_a_plan_style_zeroshard_does_not_run_is_refused_by_name():
    model = family("olmoe")
    # The plan as the config declares it (the spec reads it from there, once per model).
    model.config.base_model_ep_plan = {**model.config.base_model_ep_plan, "layers.*.mlp.gate": "moe_identity_expert"}
    with pytest.raises(ExpertParallelError, match="moe_identity_expert, which zeroshard does not run"):
        check_ep(model, 2)


def test_a_model_without_a_plan_is_refused_naming_the_plan():
    with zs.meta_init():
        dense = GPT(GPTConfig.named("tiny"))
    with pytest.raises(ExpertParallelError, match="GPT declares no expert-parallel plan"):
        check_ep(dense, 2)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=48, **COMMON))
    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM declares no expert-parallel plan"):
        check_ep(llama, 2)

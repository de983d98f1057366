"""The HF routers' load-balancing loss in sum form (zeroshard/models/router_aux.py) is transformers'
own: divided by the scored targets it is ``load_balancing_loss_func`` of the same router logits
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS; with and without an attention mask), the terms of two ranks holding halves of
a batch add up to the whole batch's loss (values and gradients), and ``hf_loss_sum`` over the
scored targets is the model's own ``labels=`` loss with the aux term."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from zeroshard.models.hf import hf_loss_sum  # noqa: E402
from zeroshard.models.router_aux import aux_loss_sum, model_balance_loss, router_aux_coef, set_count_reduction  # noqa: E402,E501

VOCAB, BATCH, SEQ = 48, 4, 8
FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "olmoe", "gpt_oss")


def tiny(family: str, **extra) -> torch.nn.Module:
    import transformers as tf

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=SEQ, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.1, use_cache=False, **extra)
    torch.manual_seed(0)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=4, **common))
    if family == "olmoe":  # softmax routing, the top-k weights not renormalised
        return tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=32, num_experts=4, **common))
    if family == "gpt_oss":  # a router bias, softmax over the top-k logits only
        return tf.GptOssForCausalLM(tf.GptOssConfig(intermediate_size=16, num_local_experts=4, head_dim=8,
                                                    sliding_window=4, **common))
    if family == "deepseek_v3":  # sigmoid grouped routing balanced by a correction bias: no aux loss in its code
        common.update(num_key_value_heads=4)
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, head_dim=4, **common))
    if family == "qwen3moe":  # no shared expert; its router renormalises the top-k weights
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                         head_dim=8, norm_topk_prob=True, **common))
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                     shared_expert_intermediate_size=48, **common))


def transformers_aux(model, router_logits, mask=None) -> torch.Tensor:
    """The model's own load_balancing_loss_func (its modeling module's)."""
    func = model_balance_loss(model)
    assert func is not None and func.__module__ == type(model).__module__
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    return func(router_logits, experts, model.config.num_experts_per_tok, mask)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # left padding on two rows
    mask[2, :5] = 0
    return ids, mask


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sum_form_over_the_scored_targets_is_transformers_loss(family, masked):
    model = tiny(family)
    ids, mask = batch()
    attention = mask if masked else None
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention)
    scored = torch.tensor(29)  # any count: the term is aux times the targets the token loss scores
    ours = aux_loss_sum(model, out.router_logits, scored, attention) / scored
    theirs = transformers_aux(model, out.router_logits, attention)
    assert torch.allclose(out.aux_loss, theirs)  # the model's own aux_loss is that function's
    print(f"{family} {'mask' if masked else 'no mask'}: ours {ours.item():.8f}, transformers {theirs.item():.8f}")
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("family", FAMILIES[:3])  # the sum form's algebra: the same for every family
def test_two_ranks_terms_add_up_to_the_whole_batchs_loss_and_gradient(family, masked):
    """Ranks a and b hold halves of the batch; their counts are summed (as the all-reduce does), each
    keeps its own probabilities. Their terms add up to aux x K of the whole batch, and so do the
    gradients of its router logits."""
    model = tiny(family)
    ids, mask = batch()
    with torch.no_grad():
        logits = [t.detach() for t in model(input_ids=ids).router_logits]
    layers, experts = len(logits), logits[0].shape[-1]
    whole = [torch.randn(BATCH * SEQ, experts, generator=torch.Generator().manual_seed(3 + i)) * 2 + t
             for i, t in enumerate(logits)]  # skewed routing: the shares are far from uniform
    whole = [t.clone().requires_grad_(True) for t in whole]
    attention = mask if masked else None
    scored = {"a": torch.tensor(13), "b": torch.tensor(11)}
    total = scored["a"] + scored["b"]
    (transformers_aux(model, tuple(whole), attention) * total).backward()

    half = BATCH * SEQ // 2
    rows = {"a": slice(0, half), "b": slice(half, None)}
    masks = {"a": None if attention is None else attention[:BATCH // 2],
             "b": None if attention is None else attention[BATCH // 2:]}
    parts = {r: [t.detach()[rows[r]].clone().requires_grad_(True) for t in whole] for r in rows}
    own = {}
    for r in rows:  # each rank's own counts, as it would send them
        set_count_reduction(model, lambda counts, r=r: own.__setitem__(r, counts.clone()))
        aux_loss_sum(model, tuple(parts[r]), scored[r], masks[r])
    terms = []
    for r, other in (("a", "b"), ("b", "a")):
        set_count_reduction(model, lambda counts, other=other: counts.add_(own[other]))
        terms.append(aux_loss_sum(model, tuple(parts[r]), scored[r], masks[r]))
    sum(terms).backward()
    expected = transformers_aux(model, tuple(t.detach() for t in whole), attention) * total
    assert layers >= 2 and abs(sum(terms).item() - expected.item()) <= 1e-5 * expected.item()
    for i, t in enumerate(whole):
        got = torch.cat([parts["a"][i].grad, parts["b"][i].grad])
        assert torch.allclose(got, t.grad, rtol=1e-5, atol=1e-9), (family, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_loss_sum_is_the_models_own_loss_with_the_aux_term(family):
    """mean CE over the scored targets + coef x aux_loss, as the model's ``labels=`` loss computes it
    (targets already shifted, so passed as transformers' ``shift_labels``); some targets ignored."""
    model = tiny(family)
    ids, _ = batch()
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    targets[1, :4] = -100
    with torch.no_grad():
        total, count = hf_loss_sum(model, ids, targets)
        out = model(input_ids=ids, labels=targets, shift_labels=targets)
        plain = model(input_ids=ids, labels=targets, shift_labels=targets, output_router_logits=False)
    assert router_aux_coef(model) == model.config.router_aux_loss_coef > 0
    gap = out.loss.item() - plain.loss.item()
    print(f"{family}: ours {(total / count).item():.7f}, transformers {out.loss.item():.7f} (aux adds {gap:.4f})")
    assert gap > 1e-3
    assert abs((total / count).item() - out.loss.item()) <= 1e-6


def test_no_aux_loss_unless_the_config_asks():
    model = tiny("mixtral")
    model.config.output_router_logits = False
    assert router_aux_coef(model) == 0.0
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.0
    assert router_aux_coef(model) == 0.0


def test_pipeline_stages_refuse_a_config_asking_for_the_aux_loss():
    from zeroshard.parallel.pipeline.layout import refuse_router_loss

    model = tiny("mixtral")
    with pytest.raises(ValueError, match="output_router_logits to false in its config or use pp=1"):
        refuse_router_loss(model)
    model.config.output_router_logits = False
    refuse_router_loss(model)


def test_no_aux_loss_where_the_models_code_has_none():
    """DeepSeek-V3 balances its routing with a correction bias; its forward adds no load-balancing
    loss whatever the config says, so neither does ours."""
    model = tiny("deepseek_v3")
    model.config.router_aux_loss_coef = 0.1
    assert model.config.output_router_logits and model_balance_loss(model) is None
    assert router_aux_coef(model) == 0.0

"""Model specs: zeroshard's GPT's written by hand, every transformers model's derived from its config,
a user's own; the tensor-parallel plan each gives the runtime; no model class named outside the specs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import zeroshard as zs
from zeroshard.models.spec import ModelSpec
from zeroshard.models.specs import spec_of
from zeroshard.parallel.tp import check_tensor_parallel

tf = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, pad_token_id=0)


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config)


def test_gpt_spec_keeps_its_hand_written_plan():
    with zs.meta_init():
        model = zs.models.GPT(zs.models.GPTConfig.named("tiny", vocab_size=64))
    plan = spec_of(model).tp()
    assert (plan.blocks, dict(plan.styles), dict(plan.chunks)) == (
        "blocks", {"attn.qkv": "colwise", "attn.proj": "rowwise", "mlp.fc": "colwise", "mlp.proj": "rowwise"},
        {"attn.qkv": 3})
    assert plan.sequence_norms == ("ln1", "ln2") and not plan.stream_inputs


def test_a_transformers_spec_is_its_configs_plans_under_the_base_prefix():
    spec = spec_of(_meta(tf.Qwen3Config(**SMALL)))
    assert (spec.blocks, spec.before, spec.after, spec.shared) == (
        "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), ("model.rotary_emb",))
    plan = spec.tp()
    assert plan.styles["self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert dict(plan.divides) == {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}
    assert plan.sequence_norms == ("input_layernorm", "post_attention_layernorm")


def test_moe_experts_stay_whole_under_tp_and_their_ep_plan_is_held_as_data():
    spec = spec_of(_meta(tf.MixtralConfig(**SMALL, num_local_experts=4)))
    assert spec.experts == ("model.layers.*.mlp.experts",)
    assert spec.ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    assert not any("experts" in k for k in spec.tp().styles)  # moe_tp_experts / packed_colwise left out
    with pytest.raises(ValueError, match="sequence parallelism with MixtralForCausalLM is not supported: its "
                                         "blocks' mlp"):
        check_tensor_parallel(_meta(tf.MixtralConfig(**SMALL, num_local_experts=4)), 2, sequence_parallel=True)


@pytest.mark.parametrize("config, message", [
    (lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64),
     "GPT2LMHeadModel declares no tensor-parallel plan"),
    (lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64),
     "FalconForCausalLM declares no tensor-parallel plan"),
    (lambda: tf.MistralConfig(**{**SMALL, "num_key_value_heads": 1}), "tp=2 does not divide num_key_value_heads=1"),
    (lambda: tf.MistralConfig(**{**SMALL, "intermediate_size": 63}), "tp=2 does not divide intermediate_size=63"),
])
def test_what_tp_cannot_split_is_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        check_tensor_parallel(_meta(config()), 2)
    assert "\n" not in str(err.value)


def test_a_style_zeroshard_does_not_honour_is_refused_by_name():
    model = _meta(tf.MistralConfig(**SMALL))
    spec = ModelSpec(blocks="model.layers", tp_plan={"model.layers.*.self_attn.q_proj": "packed_rowwise"})
    zs.models.spec.attach(model, spec)
    with pytest.raises(ValueError, match="style 'packed_rowwise' .*self_attn.q_proj.* is not supported"):
        check_tensor_parallel(model, 2)


def test_a_model_without_a_spec_is_told_how_to_write_one():
    with pytest.raises(ValueError, match=r"zeroshard has no spec for Linear.*pass spec=zs.ModelSpec\(blocks="):
        spec_of(torch.nn.Linear(2, 2))


MODEL_CLASS = re.compile(r"\b[A-Z][A-Za-z0-9]*(?:ForCausalLM|LMHeadModel|ForConditionalGeneration)\b")
ROOMS = ("runtime", "trainer", "parallel", "checkpoint", "tools", "cli")


def test_no_model_class_is_named_outside_the_specs():
    """The runtime and its tools key on specs, not on class names: none outside the models room
    (AutoModelForCausalLM, transformers' own factory, is not a model class)."""
    root = Path(zs.__file__).parent
    found = {}
    for room in ROOMS:
        for path in sorted((root / room).rglob("*.py")):
            rel = str(path.relative_to(root.parent))
            names = {n for n in MODEL_CLASS.findall(path.read_text()) if not n.startswith("AutoModel")}
            if names:
                found[rel] = sorted(names)
    assert found == {}

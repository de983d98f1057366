"""The pipeline planner on a model that is not zeroshard's GPT (a transformers model, through its
spec): each stage's activations from one traced forward, against the same bytes counted on a real
forward of the model (saved storages charged to the block running, the rest before or after them)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.tools.planner.pipeline import plan_pipeline
from zeroshard.trainer.adapter import loss_sum

MICRO, SEQ = 2, 16


def _mistral():
    tf = pytest.importorskip("transformers")
    config = tf.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def _real_saved(model) -> dict:
    """Bytes a real forward and loss save: per block index, and "before" / "after" the blocks."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, where, out = set(), ["before"], {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            out[where[0]] = out.get(where[0], 0) + t.untyped_storage().nbytes()
        return t

    handles = []
    for i, block in enumerate(model.model.layers):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)))
        handles.append(block.register_forward_hook(lambda m, a, o: where.__setitem__(0, "after")))
    ids = torch.randint(0, 96, (MICRO, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum(model, ids, ids)
    for h in handles:
        h.remove()
    return out


def test_each_stage_is_charged_its_blocks_and_the_first_its_embeddings():
    model = _mistral()
    real = _real_saved(model)
    pplan = plan_pipeline(model, world=4, pp=2, microbatches=2, batch=2 * 2 * MICRO, seq=SEQ, device="cpu")
    first, last = pplan.ranks
    assert pplan.gpt is None and pplan.layers == 4 and first.blocks == ((0, 1),) and last.blocks == ((2, 3),)
    hidden = MICRO * SEQ * 32 * 4  # one microbatch's hidden state: what stage 0 keeps for torch's backward
    # 1f1b at pp 2 with 2 microbatches: rank 0 holds both before its first backward, rank 1 one.
    assert first.in_flight == {0: 2} and last.in_flight == {1: 1}
    # A 0-dim constant (fake tensors' scalars) is a few bytes apart, nothing more.
    assert first.activation_bytes == pytest.approx(2 * (real["before"] + real[0] + real[1] + hidden), abs=64)
    # The last stage: its blocks (the first one's input is the received buffer's), the head's and
    # the loss's saves, and the logits torch keeps for the stage's backward.
    received = MICRO * SEQ * 32 * 4
    logits = MICRO * SEQ * 96 * 4
    assert last.activation_bytes == pytest.approx(real[2] + real[3] - received + real["after"] + logits, abs=64)
    assert first.buffer_bytes == 2 * hidden  # one receive buffer per microbatch for the grads coming back
    assert any("traced" in n for n in pplan.notes)


def test_a_module_without_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot tell where Linear keeps its blocks"):
        plan_pipeline(torch.nn.Linear(4, 4), world=2, pp=2, device="cpu")


def test_a_tp_rank_saves_what_a_model_of_its_heads_and_mlp_columns_saves():
    """At tp 2 the trace follows Mistral's plan through the forward: a rank's blocks save what a
    Mistral of half the heads (each as wide) and half the MLP columns saves on a real forward, its
    residual stream, norms and head whole."""
    from zeroshard.parallel.pipeline.layout import layout_of
    from zeroshard.tools.planner.tp import TensorParallel
    from zeroshard.tools.planner.traced import trace

    tf = pytest.importorskip("transformers")
    model = _mistral()
    half = tf.MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    real = _real_saved(tf.AutoModelForCausalLM.from_config(half).train())
    blocks = [(f"model.layers.{i}", b) for i, b in enumerate(model.get_submodule(layout_of(model).blocks))]
    plan = TensorParallel.of_model(model, 2).plan
    t = trace(model, blocks, micro_batch=MICRO, seq=SEQ, compute=torch.float32, tp=2, tp_plan=plan)
    whole = trace(model, blocks, micro_batch=MICRO, seq=SEQ, compute=torch.float32)
    for i in range(4):
        assert t.per_block[i] == pytest.approx(real[i], abs=64)
        assert t.per_block[i] < 0.8 * whole.per_block[i]
    assert (t.before, t.after) == (whole.before, whole.after)


def test_the_trace_takes_the_causal_kernel_a_real_run_takes():
    """Run as the runtime runs a transformers model (use_cache=False, no cache to read the offsets
    from), a real forward takes the causal kernel without a mask; the trace must too, or it counts an
    explicit mask and GQA's expanded keys and values (16 kB a block here) that no real step holds."""
    from zeroshard.models.hf import HFSpec
    from zeroshard.tools.planner.traced import trace

    model = _mistral()
    model.cfg = HFSpec("mistral", model.config.to_dict())  # the runtime's hf_loss_sum path
    real = _real_saved(model)
    blocks = [(f"model.layers.{i}", b) for i, b in enumerate(model.model.layers)]
    t = trace(model, blocks, micro_batch=MICRO, seq=SEQ, compute=torch.float32)
    for i in range(4):
        assert t.per_block[i] == pytest.approx(real[i], abs=64)


def test_a_stage_holds_its_own_experts_split_over_ep():
    """pp 2 x ep 2 at world 4: each stage's expert params are halved (its ep group of 2 holds half
    the experts each), its dense ones whole at ddp; the all-to-all buffers of one MoE layer call are
    in the stage's backward workspace."""
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.parallel.experts import check_ep

    cfg = GPTConfig.named("tiny-moe")
    with torch.device("meta"):
        model = GPT(cfg)
    experts = {f"{layer.name}.{p}" for layer in check_ep(model, 2) for p in layer.params}
    kw = dict(world=4, pp=2, microbatches=2, batch=8, seq=32, device="cpu", stage=0)
    whole, split = plan_pipeline(model, ep=1, **kw), plan_pipeline(model, ep=2, **kw)
    for r, w, s in zip(range(2), whole.ranks, split.ranks):
        names = {n for blocks in s.blocks for b in blocks for n in experts if n.startswith(f"blocks.{b}.")}
        expert_bytes = sum(dict(model.named_parameters())[n].numel() for n in names) * 4
        assert expert_bytes > 0
        assert w.plan["ddp"].device.params - s.plan["ddp"].device.params == pytest.approx(expert_bytes / 2, abs=64)
        assert s.plan["ddp"].experts["all_to_all_buffers"] > 0 and not w.plan["ddp"].experts
    assert split.ep == 2 and split.to_dict()["ep"] == 2

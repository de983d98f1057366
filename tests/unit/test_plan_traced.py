"""The planner's traced activations (zeroshard/tools/planner/traced.py) against a real forward.

Each model runs its real forward and the runtime's loss under ``saved_tensors_hooks``, counting
every saved storage once, params excluded (the rule ``plan measure`` reads a real step with); the
trace on fake tensors must count the same bytes, per block and at the root.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.runtime.wrap import find_blocks
from zeroshard.tools.planner.spec import Checkpointing
from zeroshard.tools.planner.traced import traced_activations
from zeroshard.trainer.adapter import loss_sum

B, T = 2, 32


def _real_saved(model: nn.Module) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    ids = torch.randint(0, 100, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum(model, ids, ids)
    return sum(seen.values())


class NanoBlock(nn.Module):
    """nanoGPT's block layout: fused qkv ``c_attn``, ``c_proj``, an MLP of ``c_fc`` and ``c_proj``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 32, heads: int = 4, layers: int = 3):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, width), wpe=nn.Embedding(T, width),
                                              h=nn.ModuleList(NanoBlock(width, heads) for _ in range(layers)),
                                              ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as nanoGPT ties them

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _hf(name: str) -> nn.Module:
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
    config = {"gemma2": lambda: tf.Gemma2Config(intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                                sliding_window=16, **common),
              "olmoe": lambda: tf.OlmoeConfig(intermediate_size=16, num_experts=4, num_experts_per_tok=2, **common),
              "opt": lambda: tf.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                          num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)}[name]()
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["nanogpt", "gemma2", "opt", "olmoe"])
def test_traced_saved_bytes_equal_a_real_forward(name):
    """OLMoE's stacked experts run grouped_mm, whose fake kernel takes bf16 only: traced through
    transformers' fallback op, which saves the same tensors."""
    model = NanoGPT() if name == "nanogpt" else _hf(name)
    model.train()
    blocks = find_blocks(model)
    estimate = traced_activations(model, blocks, micro_batch=B, seq=T, compute=torch.float32, policy=Checkpointing())
    # A 0-dim scalar made from a Python number (Gemma's embedding scale) is a constant to fake
    # tensors, not a saved storage: a few bytes apart, nothing more. grouped_mm saves its int32
    # offsets (4 B an expert per MoE layer); transformers' fallback keeps them off the saved tensors.
    offsets = 4 * 4 * len(blocks) if name == "olmoe" else 0
    assert abs(estimate.saved + offsets - _real_saved(model)) <= 8
    # per_layer is the blocks' mean (Gemma2's sliding and global layers save different masks), floored
    assert 0 <= estimate.saved - estimate.root - estimate.per_layer * len(blocks) < len(blocks)
    assert estimate.block_names == tuple(n for n, _ in blocks)
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())  # the model is untouched


def test_traced_checkpointing_keeps_one_input_per_segment():
    model = NanoGPT(layers=4)
    blocks = find_blocks(model)
    plain = traced_activations(model, blocks, micro_batch=B, seq=T, compute=torch.float32, policy=Checkpointing())
    every2 = traced_activations(model, blocks, micro_batch=B, seq=T, compute=torch.float32,
                                policy=Checkpointing("every:2"))
    block_input = B * T * 32 * 4
    assert every2.boundary == block_input
    assert every2.saved == plain.root + 2 * block_input
    assert every2.recompute == 2 * plain.per_layer


def test_plan_of_a_folder_model_counts_traced_activations():
    from zeroshard.tools.planner.api import plan

    model = _hf("opt")
    result = plan(model, world=2, stage=3, batch=4, seq=T, device="cpu")
    assert result.activations is not None and result.activations.saved > 0
    assert any("traced" in n for n in result.notes)


def test_plan_of_a_folder_model_at_tp2_splits_its_declared_plan():
    """A transformers model at tp 2 is planned with its own declared plan: every projection the plan
    splits holds half its elements per rank, the embeddings, head and norms whole; a plan-less
    model (GPT-2) is refused in one line."""
    tf = pytest.importorskip("transformers")
    from zeroshard.tools.planner.api import plan

    config = tf.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = tf.AutoModelForCausalLM.from_config(config)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    split = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-2] in projections)
    whole = plan(model, world=4, stage=0, batch=4, seq=T, device="cpu").layouts["ddp"].device.params
    halved = plan(model, world=4, tp=2, stage=0, batch=4, seq=T, device="cpu").layouts["ddp"].device.params
    assert whole - halved == pytest.approx(split // 2 * 4, abs=4 * 64 * 16)  # alignment padding aside
    gpt2 = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128))
    with pytest.raises(ValueError, match="tensor-parallel plan"):
        plan(gpt2, world=4, tp=2, device="cpu")

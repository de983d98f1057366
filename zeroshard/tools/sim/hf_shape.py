"""The simulator's transformer shape of a Hugging Face causal LM (a folder's, an hf: model's).

The widths, heads and layer count are the config's, and so are an MoE config's experts (each of its
expert width) and top-k; whether the MLP is gated (three matmuls) and whether the layers have biases
are chosen so that one block's params come closest to the model's own (a shared expert next to the
routed ones, as Qwen2-MoE has, is not in the shape). A
module without a Hugging Face config has no shape to read: it is planned for memory only.
"""

from __future__ import annotations

from torch import nn

from zeroshard.tools.sim.workload import Shape


def _blocks(model: nn.Module, layers: int) -> nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of {layers} blocks (num_hidden_layers) to read its shape")
    return lists[0]


def hf_shape(model: nn.Module, name: str) -> Shape:
    """The simulator's transformer shape of a Hugging Face causal LM, from its config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        raise ValueError(f"plan time simulates a transformer's shape, read from a Hugging Face config; {name} has none: "
                         "plan its memory without --time")
    hidden, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or (1 if getattr(config, "multi_query", False) else heads)
    # An MoE config (Mixtral's num_local_experts, Qwen-MoE's num_experts): each expert's width.
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) if experts else 0
    widths = ("moe_intermediate_size", "intermediate_size") if experts else ("intermediate_size", "n_inner", "ffn_dim")
    ffn = next((v for v in (getattr(config, k, None) for k in widths) if v), 4 * hidden)
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    tied = head is not None and head.weight is embeddings.weight
    block = sum(p.numel() for p in _blocks(model, layers)[0].parameters())
    fits = [Shape(name=name, n_layer=layers, hidden=hidden, ffn=ffn, n_head=heads, kv_dim=hidden // heads * kv_heads,
                  vocab=config.vocab_size, gated=gated, tied=tied, bias=bias, n_expert=int(experts), top_k=int(top_k))
            for gated in (True, False) for bias in (False, True)]
    return min(fits, key=lambda s: abs(s.block_params - block))

"""Small random transformers configs, each a way of writing a decoder that zeroshard has no code for:
the pipeline tests cut them in one process and scripts/pp_archs.py verifies them at pp 2. One builder,
so the suite's subset and the script's matrix are the same models."""

from __future__ import annotations

VOCAB = 96


def pp_arch_configs() -> dict:
    """name -> a 4-block config of that architecture (transformers imported here, so a caller without it
    can skip first)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {
        # Embedding scale, final-logit soft-capping, sliding-window layers alternating with global ones.
        "gemma2": tf.Gemma2Config(**common, head_dim=8, sliding_window=4, final_logit_softcapping=3.0),
        "mistral": tf.MistralConfig(**common, sliding_window=4),
        "phi3": tf.Phi3Config(**common),
        "olmo2": tf.Olmo2Config(**common),
        "qwen3": tf.Qwen3Config(**common, head_dim=8),
        "cohere": tf.CohereConfig(**common, logit_scale=0.5),
        # Embedding, residual and logit multipliers.
        "granite": tf.GraniteConfig(**common, embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5),
        "starcoder2": tf.Starcoder2Config(**common),
        # Blocks under transformer.h, learned positions, no pp plan.
        "gpt2": tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=1,
                              eos_token_id=2),
        # Blocks returning tuples, parallel attention.
        "falcon": tf.FalconConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
                                  new_decoder_architecture=False, parallel_attn=True, bos_token_id=1, eos_token_id=2),
        "qwen2_moe": tf.Qwen2MoeConfig(**{**common, "intermediate_size": 32}, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
        "olmoe": tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2),
    }

"""Workers for the third-party architecture tests: save_pretrained folders of models written in
other ways than Llama (Conv1D weights, fused qkv, learned absolute positions, parallel attention
and MLP, ALiBi, buffers set in __init__), trained by `zeroshard train`'s own step at stage 3.

Module level so spawned ranks can import it; one process group runs every architecture.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

from pathlib import Path

import torch

import buffer_model  # noqa: F401 - registers the buffer-in-__init__ architecture with transformers
import zeroshard as zs
from zeroshard.trainer.config import TrainConfig
from zeroshard.checkpoint.hf import export_pretrained

VOCAB = 96
STEPS = 3
SHARD_BYTES = "20KB"  # every tiny model spans >= 3 safetensors files


def configs() -> dict:
    """Small random configs, each a way of writing a decoder that Llama is not."""
    import transformers as tf

    return {
        # Conv1D weights, fused c_attn, learned absolute positions; dropout in the config (verify turns it off).
        "gpt2": tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=VOCAB,
                              resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1),
        # Learned positions with an offset, separate q/k/v with biases, a final projection-free head.
        "opt": tf.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                            max_position_embeddings=32, word_embed_proj_dim=32, vocab_size=VOCAB),
        # Fused query_key_value and ALiBi position biases.
        "bloom": tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB),
        # Fused query_key_value, attention and MLP in parallel off one layer norm.
        "falcon": tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                  new_decoder_architecture=False, parallel_attn=True),
        # Parallel attention/MLP with rotary dims on part of each head.
        "gptj": tf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32, vocab_size=VOCAB),
        # Parallel attention/MLP, partial rotary, dense biases.
        "phi": tf.PhiConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=32, partial_rotary_factor=0.5, vocab_size=VOCAB),
        # Fused query_key_value, parallel residual, and a head stored as embed_out (renamed lm_head on load).
        "gpt_neox": tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, use_parallel_residual=True, vocab_size=VOCAB),
        # MoE: each expert's projections stored apart in the files, stacked into one param on load.
        "mixtral": tf.MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=32, vocab_size=VOCAB),
        # Buffers set in a module's __init__, one saved and one not.
        "buffers": buffer_model.BufferLMConfig(vocab_size=VOCAB, hidden_size=64),
    }


def make_folders(root: Path) -> dict[str, Path]:
    import transformers as tf

    out = {}
    for name, config in configs().items():
        torch.manual_seed(0)
        out[name] = root / name
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(out[name], max_shard_size=SHARD_BYTES)
    return out


def train_config(folder: str, **overrides) -> TrainConfig:
    """What `zeroshard verify --model FOLDER --stage 3 --nproc 2 --steps 3` runs."""
    return TrainConfig(**{**dict(model=folder, stage=3, nproc=2, batch=4, seq_len=16, steps=STEPS, warmup=1,
                                 num_samples=64, dropout=False, profile=False), **overrides})


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(99))


def suite(folders: dict[str, str], root: str) -> dict:
    """Per architecture: 3 training steps at stage 3 (losses, full params), the trained model's
    logits on a probe batch, and a live export of it."""
    from zeroshard.trainer.train import setup, train_step

    mesh = zs.init()
    out = {}
    for name, folder in folders.items():
        run = setup(train_config(folder), mesh)
        losses = [train_step(run, step).loss for step in range(STEPS)]
        state = zs.full_state_dict(run.model)  # collective
        with torch.no_grad():
            logits = run.model(input_ids=probe()).logits
        exported = export_pretrained(run.model, Path(root) / f"{name}-trained", max_shard_size=SHARD_BYTES)
        out[name] = {"losses": losses, "params": {k: v.detach().float().clone() for k, v in state.items()},
                     "logits": logits, "exported": str(exported) if exported else None}
    zs.shutdown()
    return out if mesh.rank == 0 else {}

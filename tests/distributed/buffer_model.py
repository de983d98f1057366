"""A causal LM whose blocks set buffers in ``__init__``: one persistent (saved in the weights), one
not (saved nowhere, covered by no ``_init_weights``), as custom architectures write them.

Importing this module registers it with transformers' Auto classes, so ``from_pretrained`` and
zeroshard's folder loader both open its ``save_pretrained`` folders.
"""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn
from transformers.modeling_outputs import CausalLMOutput


class BufferLMConfig(tf.PretrainedConfig):
    model_type = "zeroshard_test_buffer_lm"

    def __init__(self, vocab_size: int = 96, hidden_size: int = 32, num_hidden_layers: int = 2,
                 max_position_embeddings: int = 32, **kwargs) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.max_position_embeddings = num_hidden_layers, max_position_embeddings
        super().__init__(**kwargs)


class Block(nn.Module):
    def __init__(self, config: BufferLMConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size)
        # Set here, from the config: a per-channel gain nobody saves and a position table that is saved.
        self.register_buffer("gain", torch.linspace(0.5, 1.5, config.hidden_size), persistent=False)
        self.register_buffer("position_bias", torch.arange(config.max_position_embeddings, dtype=torch.float32) / 10)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h))) * self.gain + self.position_bias[: h.shape[1], None]


class BufferLM(tf.PreTrainedModel):
    config_class = BufferLMConfig

    def __init__(self, config: BufferLMConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, **kwargs) -> CausalLMOutput:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return CausalLMOutput(logits=self.lm_head(h))


tf.AutoConfig.register(BufferLMConfig.model_type, BufferLMConfig)
tf.AutoModelForCausalLM.register(BufferLMConfig, BufferLM)

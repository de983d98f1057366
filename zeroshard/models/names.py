"""The models zeroshard builds by name: its GPT presets and the small HF configs written in code.

The trainer's config validates `--model` against these; the builders in this room read them.
"""

MODEL_NAMES = ("tiny", "small", "medium", "tiny-moe")
MOE_MODEL_NAMES = ("tiny-moe",)
"""The presets with MoE MLPs (zeroshard's GPT with n_expert > 0): what `ep` > 1 can split by name."""
HF_PREFIX = "hf:"
HF_MODEL_NAMES = ("hf:gpt2-tiny", "hf:llama-tiny")
"""Hugging Face models built from small configs in code (zeroshard/models/hf.py); need the `hf` extra."""
HF_TINY_LAYERS = 4
"""The blocks of each HF_MODEL_NAMES config: what pp > 1 divides without building one."""

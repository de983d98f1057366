"""A chat data set and a model folder whose tokenizer has a chat template, built in the test.

The tokenizer is a small byte-level BPE trained on the dialogues themselves (the `tokenizers`
library), wrapped in transformers' PreTrainedTokenizerFast with a ChatML template, and saved with a
random tiny Llama into one save_pretrained folder: what a user's fine-tuning folder looks like.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
SEED = 3

_WORDS = ("the cat sat on a mat while red birds sing over green hills and blue rivers run far away "
          "what is two plus three five why does rain fall because clouds grow heavy").split()


def dialogues(n: int, seed: int = SEED) -> list[dict]:
    """``n`` conversations: a system turn, then one to three user/assistant exchanges each."""
    import random

    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "you are " + sentence()}]
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_tokenizer(texts: list[str]):
    """A byte-level BPE fitted to ``texts``, with the chat template, as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_chat_folder(root: Path, records: list[dict] | None = None, *, layers: int = 2) -> Path:
    """A save_pretrained folder: a random tiny Llama and a tokenizer with a chat template."""
    import torch
    import transformers as tf

    records = dialogues(16) if records is None else records
    texts = [m["content"] for r in records for m in r["messages"]] + ["system user assistant"]
    tok = make_tokenizer(texts)
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = tf.AutoModelForCausalLM.from_config(config)
    folder = root / "chat-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

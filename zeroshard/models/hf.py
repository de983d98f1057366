"""Hugging Face causal LMs (GPT-2, Llama) from small configs built in code, and the adapter the
training loop runs them through.

Nothing is downloaded: the configs are written here, and ``transformers`` is an optional extra
(``pip install -e '.[hf]'``). ``zs.shard`` needs no hints for these models: ``find_blocks`` takes
the children of ``transformer.h`` / ``model.layers`` (``GPT2Block`` / ``LlamaDecoderLayer``) as
units, and the tied embedding / LM head is one Parameter, so it is one ``ParamRef`` owned by the
root unit.

[Note: HF initialisation]
A plain ``Cls(config)`` draws random numbers twice: every layer's torch default init inside the
constructors (interleaved with nested ``post_init()`` calls), then the model's ``_init_weights``
over every module, which overwrites all of it. The constructor draws depend on construction order
and on which sub-model runs ``post_init`` first, so they cannot be replayed exactly on a meta
model. We therefore define the init of an ``hf:`` model as *the model's own ``_init_weights``
only*, which is also what ``from_pretrained`` does for missing weights in transformers 5:

1. construct under ``torch.device("meta")`` (transformers then skips ``initialize_weights`` but
   still ties the LM head to the embedding), so the constructor draws nothing;
2. ``init_weights(model)`` below: give every tied *target* (``lm_head.weight``) a scratch tensor
   for the duration of the init, run ``model.init_weights()``, re-tie.

Step 2 is the same call for the full build (after ``to_empty``) and for the meta build (as the
``init_fn`` that ``zs.shard`` replays), so both consume the global RNG identically and a sharded
meta init is bitwise the full build. The scratch tensor matters: without it the LM head's own draw
would land in the embedding it is tied to, while a model whose head is still separate when
``_init_weights`` runs (as in transformers' own flow) keeps the embedding's draw.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.models.names import HF_MODEL_NAMES, HF_PREFIX, HF_TINY_LAYERS
from zeroshard.models.router_aux import aux_loss_sum, router_aux_coef

IGNORE_INDEX = -100

__all__ = ["HF_MODEL_NAMES", "HFSpec", "build_hf_model", "hf_config", "hf_loss_sum", "init_weights", "is_hf_model",
           "is_hf_name", "require_transformers"]


def is_hf_name(name: str) -> bool:
    return name.startswith(HF_PREFIX)


def require_transformers() -> Any:
    """The ``transformers`` module, or an error that says how to install it."""
    try:
        module = importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError("hf: models need the 'transformers' package, which is not installed; "
                          "install the extra with: pip install -e '.[hf]'") from e
    major = int(module.__version__.split(".")[0])
    if major < 5:
        # Before 5, init_weights() also runs on meta and ties are listed differently, so the
        # init replay below would not match a full build.
        raise ImportError(f"hf: models need transformers>=5, found {module.__version__}; "
                          "upgrade with: pip install -e '.[hf]'")
    # The default warnings (token ids, loss_type) are about configs we wrote on purpose.
    module.logging.set_verbosity_error()
    return module


@dataclasses.dataclass(frozen=True)
class HFSpec:
    """What ``model.cfg`` is for an hf: model: the zeroshard name and the HF config, JSON-able."""

    name: str
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "hf_config": self.config}


def hf_config(name: str, *, vocab_size: int, seq_len: int) -> Any:
    """The small config behind ``hf:<name>``. Widths are multiples of 64, so the flat buffers carry
    no padding; dropout is off, so a sharded run and one process see the same function."""
    tf = require_transformers()
    if name not in HF_MODEL_NAMES:
        raise ValueError(f"unknown hf model {name!r}; use one of {HF_MODEL_NAMES}")
    common = dict(vocab_size=vocab_size, tie_word_embeddings=True, use_cache=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if name == "hf:gpt2-tiny":
        return tf.GPT2Config(n_layer=HF_TINY_LAYERS, n_head=4, n_embd=64, n_positions=seq_len, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, **common)
    return tf.LlamaConfig(num_hidden_layers=HF_TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                          hidden_size=64, intermediate_size=256, max_position_embeddings=seq_len, attention_dropout=0.0,
                          **common)


def _model_class(config: Any) -> type[nn.Module]:
    tf = require_transformers()
    return tf.GPT2LMHeadModel if config.model_type == "gpt2" else tf.LlamaForCausalLM


def _tied_targets(model: nn.Module) -> list[str]:
    """Names of params that ``tie_weights`` points at another param ({target: source} in HF)."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {}
    return list(keys) if isinstance(keys, dict) else []


def init_weights(model: nn.Module) -> None:
    """The init of an hf: model (see the note above); also the ``init_fn`` for ``zs.shard``."""
    device = next(model.parameters()).device
    if device.type == "meta":  # replayed by zs.shard: scratch tensors go where the shards live
        from zeroshard.comm.mesh import get_mesh

        device = get_mesh().device
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    for target in _tied_targets(model):
        module_name, _, attr = target.rpartition(".")
        module = model.get_submodule(module_name)
        param = dict(module.named_parameters(recurse=False, remove_duplicate=False)).get(attr)
        if param is None:
            continue
        saved.append((module, attr, param))
        # Drawn into and then dropped, as a model whose head is not tied yet would do.
        module._parameters[attr] = nn.Parameter(  # noqa: SLF001 (swaps a registered param; no public API)
            torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    try:
        # nn.Module's __getattr__ is typed for params and submodules; this is the HF model's method.
        cast(Callable[[], None], model.init_weights)()
    finally:
        for module, attr, param in saved:
            module._parameters[attr] = param  # noqa: SLF001 (swaps a registered param; torch has no public API)


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Meta buffers (rotary ``inv_freq``) become empty real tensors; ``_init_weights`` fills them
    (transformers 5 computes every buffer there, because ``from_pretrained`` builds on meta too)."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buf.is_meta:
                setattr(module, name, torch.empty(buf.shape, dtype=buf.dtype, device=device))


def build_hf_model(name: str, *, vocab_size: int, seq_len: int, seed: int, device: torch.device,
                   meta: bool = False) -> nn.Module:
    """``hf:<name>`` seeded with ``seed``. ``meta=True`` leaves the params on meta for ``zs.shard``
    (pass ``init_fn=init_weights``); buffers are real either way."""
    config = hf_config(name, vocab_size=vocab_size, seq_len=seq_len)
    with torch.device("meta"):
        model: Any = _model_class(config)(config)  # a transformers PreTrainedModel (loosely typed)
    model.cfg = HFSpec(name, config.to_dict())  # what checkpoints and config.json record
    _materialize_buffers(model, device)
    torch.manual_seed(seed)
    if meta:
        return model
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each place its own tensor
    init_weights(model)
    return model


def is_hf_model(model: nn.Module) -> bool:
    return isinstance(getattr(model, "cfg", None), HFSpec)


def hf_loss_sum(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, tokens counted)``, the contract of ``GPT.loss_sum``.

    Our batches carry already-shifted targets. HF's ``labels=`` loss shifts again inside the model
    (dropping the last position), so we take the output's ``logits`` and apply the same fp32
    cross-entropy as zeroshard's GPT. An MoE config with ``output_router_logits`` adds its
    load-balancing loss, ``router_aux_loss_coef`` times transformers' ``aux_loss`` of the global
    micro-batch, in sum form (zeroshard/models/router_aux.py). ``position_ids`` that restart at 0 mark
    packed samples, which transformers keeps apart (its masks read them when no attention mask is given).
    """
    coef = router_aux_coef(model)
    # Only passed when given: the call without them is the one every other path makes.
    extra = {} if position_ids is None else {"position_ids": position_ids}
    if not coef:
        return token_loss_sum(model(input_ids=idx, use_cache=False, **extra).logits, targets)
    out = model(input_ids=idx, use_cache=False, output_router_logits=True, **extra)
    total, count = token_loss_sum(out.logits, targets)
    return total + coef * aux_loss_sum(model, out.router_logits, count), count


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, tokens counted)`` of ``logits`` (batch, seq, vocab) against shifted
    targets: zeroshard's GPT's fp32 cross-entropy, targets of -100 left out."""
    total = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total, (targets != IGNORE_INDEX).sum()

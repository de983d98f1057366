"""LoRA checkpoints out: the merged model as a `from_pretrained` folder, or the adapter folder that
`peft.PeftModel.from_pretrained(base, folder)` opens.

A run with adapters (zeroshard/trainer/lora.py) holds peft's layers in place: `q_proj.base_layer.weight`
(frozen) beside `q_proj.lora_A.default.weight` and `q_proj.lora_B.default.weight`. Its checkpoint's
model record carries the adapter's LoraConfig. Merging is peft's own rule for a linear layer,
W + scaling·(B @ A) with scaling = alpha / r (alpha / sqrt(r) with rsLoRA), transposed for a
fan_in_fan_out layer (GPT-2's Conv1D); the merged params take the base model's names. The adapter
folder is what `PeftModel.save_pretrained` writes: adapter_config.json and adapter_model.safetensors,
its tensors named `base_model.model.<module>.lora_A.weight` (the adapter's name dropped).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.hf.errors import PretrainedError
from zeroshard.checkpoint.staging import fresh_partial, refuse_existing

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_BASE = ".base_layer"
_NAME = "default"


def adapter_record(model: nn.Module) -> dict[str, Any] | None:
    """The model's LoraConfig as JSON values, for the checkpoint's model record; None without adapters."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    values = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in configs[_NAME].to_dict().items()}
    return json.loads(json.dumps(values, default=str))


def base_name(fqn: str) -> str | None:
    """The base model's name of a param of an adapted model; None for an adapter's own param."""
    if ".lora_" in fqn:
        return None
    return fqn.replace(_BASE + ".", ".")


def _scaling(record: dict[str, Any]) -> float:
    r, alpha = record["r"], record["lora_alpha"]
    return alpha / math.sqrt(r) if record.get("use_rslora") else alpha / r


def merged_value(fqn: str, value: torch.Tensor, record: dict[str, Any], read: Any) -> torch.Tensor:
    """`value` of base param `fqn` with its layer's adapter merged in (a weight of a LoRA layer);
    `read(name)` gives another param's saved value (the adapter's A and B)."""
    if not fqn.endswith(_BASE + ".weight"):
        return value
    module = fqn[: -len(_BASE + ".weight")]
    a, b = read(f"{module}.lora_A.{_NAME}.weight"), read(f"{module}.lora_B.{_NAME}.weight")
    delta = (b.double() @ a.double()) * _scaling(record)
    if record.get("fan_in_fan_out"):
        delta = delta.T
    return (value.double() + delta).to(value.dtype)


def adapter_tensors(names: list[str], read: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (what get_peft_model_state_dict returns)."""
    return {"base_model.model." + n.replace(f".{_NAME}.", "."): read(n).contiguous()
            for n in names if ".lora_" in n}


def write_adapter_folder(out: str | Path, record: dict[str, Any], tensors: dict[str, torch.Tensor],
                         source: str | None, overwrite: bool = False) -> Path:
    """adapter_config.json and adapter_model.safetensors, built under a temporary name and renamed."""
    from safetensors.torch import save_file

    out = Path(out)
    refuse_existing(out, overwrite, error=PretrainedError, choose="output folder")
    tmp = fresh_partial(out)
    try:
        config = {**record, "base_model_name_or_path": source or record.get("base_model_name_or_path")}
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

"""FLOPs per token and peak FLOP/s, for MFU (model FLOPs utilisation).

MFU counts the FLOPs the model needs (6N per token plus attention, causal: half the score matrix,
see ``GPT.flops_per_token``), so it does not change when recompute is switched on. Recompute runs
the blocks' forward again in backward: those are *hardware* FLOPs, reported apart as HFU. Counting
them as useful work, or counting causal attention in full, is how MFU ends up above 100%
(torchtitan#341).

The peak is configurable (``--peak-flops``, per rank). Left unset, a short matmul calibration
measures what this rank's device sustains, which on a CPU is the only honest number: the datasheet
peak assumes every core for one process and every vector unit busy.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def gpt_flops(model_cfg: Any, recompute: bool) -> dict[str, int] | None:
    """Model and hardware FLOPs per trained token of a zeroshard GPT (None for other models).

    Built on the meta device from the config, because at stage 3 the live model holds only this
    rank's slices and would count a fraction of its parameters.
    """
    from zeroshard.models.gpt import GPT, GPTConfig

    if not isinstance(model_cfg, GPTConfig):
        return None
    with torch.device("meta"):
        model = GPT(model_cfg)
    per_token = model.flops_per_token()
    block_params = sum(p.numel() for p in model.blocks.parameters())
    # One more forward of every block: 2 FLOPs per weight, plus causal attention's forward
    # (2 * seq_len * n_embd per layer: half of QK^T and of AV).
    forward_blocks = 2 * block_params + 2 * model_cfg.n_layer * model_cfg.seq_len * model_cfg.n_embd
    return {"model": per_token, "hardware": per_token + (forward_blocks if recompute else 0)}


def calibrate_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.25) -> float:
    """FLOP/s of a square matmul on ``device``, sustained for about ``seconds``."""
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: thread pool, kernels
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        iters += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return 2.0 * n**3 * iters / elapsed


def utilisation(flops_per_token: int | None, tokens_per_s: float, world: int, peak_flops: float | None) -> float | None:
    """Fraction of ``world`` ranks' peak that ``tokens_per_s`` (global) at that cost per token uses."""
    if not flops_per_token or not peak_flops or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (world * peak_flops)

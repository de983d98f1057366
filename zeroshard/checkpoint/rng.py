"""Per-rank RNG state (torch CPU and CUDA, numpy, python ``random``) as plain JSON.

Saved per rank because ranks may draw different random numbers (dropout masks on different data).
On a resume at the same world size rank r gets rank r's state back, so the run continues bitwise.
At another world size there is no right answer for a rank that did not exist: ranks below the
saved world size take their own saved state, and a new rank r derives a fresh state from rank 0's
saved state and r (a hash), so the result is deterministic and no two ranks share a stream.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": [int(k) for k in np_state["state"]["key"]],
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "python": _python_state(random.getstate()),
        "torch_cuda": None,
    }
    # Only when CUDA is already in use: asking for the state would otherwise initialise CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _python_state(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch_cpu"]), dtype=torch.uint8))
    np_state = state["numpy"]
    np.random.set_state({
        "bit_generator": np_state["bit_generator"],
        "state": {"key": np.array(np_state["key"], dtype=np.uint32), "pos": np_state["pos"]},
        "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"],
    })
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("torch_cuda")
    if state.get("cuda_seed") is not None and torch.cuda.is_available():
        torch.cuda.manual_seed_all(state["cuda_seed"])
    if cuda and torch.cuda.is_available():
        for index, hex_state in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(hex_state), dtype=torch.uint8), index)


def derive(base: dict[str, Any], rank: int) -> dict[str, Any]:
    """A state for ``rank`` (one that did not exist when saving), seeded from rank 0's saved state."""
    seed = int.from_bytes(hashlib.sha256(f"{base['torch_cpu']}/{rank}".encode()).digest()[:8], "little") >> 1
    torch_state = torch.Generator().manual_seed(seed).get_state()
    mt = np.random.RandomState(seed % 2**32).get_state(legacy=False)
    state = {
        "torch_cpu": torch_state.numpy().tobytes().hex(),
        "numpy": {"bit_generator": mt["bit_generator"], "key": [int(k) for k in mt["state"]["key"]],
                  "pos": int(mt["state"]["pos"]), "has_gauss": 0, "gauss": 0.0},
        "python": _python_state(random.Random(seed).getstate()),
        "torch_cuda": None,
        # A CUDA generator state cannot be built without CUDA; the seed is applied on restore.
        "cuda_seed": seed if base.get("torch_cuda") else None,
    }
    return state

"""Workers for the torch.compile tests: compiled against eager at every stage, in one process group.

Module level so spawned ranks can import it. Every run goes through zeroshard.trainer.step (the one
training step) with the same config; only ``zs.shard``'s ``compile=`` differs. The backend is
aot_eager: inductor works too, but compiling one tiny block with it takes minutes on a loaded CPU.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hf: configs are built in code; nothing is fetched

import torch
from torch._dynamo.utils import counters

import zeroshard as zs
from zeroshard.trainer import step as step_mod
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import collate
from zeroshard.trainer import adapter
from zeroshard.runtime import CompileError

BACKEND = "aot_eager"
STEPS = 5


def _config(model: str = "tiny", stage: int = 0, checkpointing: str = "none") -> TrainConfig:
    return TrainConfig(model=model, stage=stage, nproc=2, batch=4, seq_len=32, steps=STEPS, lr=3e-3, warmup=1,
                       num_samples=64, vocab_size=16, seed=3, checkpointing=checkpointing, init="full")


def _losses(cfg: TrainConfig, whole: bool = False, **shard_overrides) -> tuple[list[float], list[int]]:
    """Per-step mean losses, and after each step how many graphs dynamo has compiled so far.
    ``whole``: the user compiles the whole sharded model (``model.compile()`` after zs.shard)."""
    run = step_mod.build(cfg, zs.get_mesh(), **shard_overrides)
    if whole:
        run.model.compile(backend=BACKEND)
    losses, frames = [], []
    for _ in range(STEPS):
        x, y = collate(run.dataset, run.sampler.next_indices())
        out = step_mod.step(run, x, y)
        both = torch.stack([out.loss_sum, (y != step_mod.IGNORE_INDEX).sum().double()])
        zs.comm.collectives.all_reduce(both, op="sum", phase="metrics")
        losses.append(float(both[0] / both[1]))
        frames.append(counters["stats"]["unique_graphs"])
    return losses, frames


_EAGER: dict[str, list[float]] = {}


def _pair(cfg: TrainConfig, **compiled) -> dict:
    """The same run eager (once per config) and compiled."""
    key = repr(cfg)
    if key not in _EAGER:
        _EAGER[key], _ = _losses(cfg)
    torch._dynamo.reset()  # noqa: SLF001 (each case starts from an empty compile cache)
    counters.clear()
    got, graphs = _losses(cfg, **compiled)
    return {"eager": _EAGER[key], "compiled": got, "graphs": graphs}


def graph_breaks(cfg: TrainConfig, whole: bool = True) -> dict:
    """``torch._dynamo.explain`` of one block's forward (what compile= compiles) and of the whole model,
    both with full params (stage 3 gathers them inside ``zs.unsharded``)."""
    run = step_mod.build(cfg, zs.get_mesh())
    model = run.model
    x, y = collate(run.dataset, run.sampler.next_indices())
    blocks = [m for m in model.modules() if type(m).__name__ in ("Block", "LlamaDecoderLayer", "GPT2Block")]
    seen: list[tuple] = []
    handle = blocks[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append((args, kwargs)),
                                                 with_kwargs=True)
    with torch.no_grad():
        adapter.loss_sum(model, x, y)
    handle.remove()
    explain = torch._dynamo.explain  # noqa: SLF001 (torch has no public explain)
    torch._dynamo.reset()  # noqa: SLF001 (a clean cache, so explain counts this model's frames only)
    args, kwargs = seen[0]
    with torch.no_grad(), zs.unsharded(model):
        block = explain(type(blocks[0]).forward)(blocks[0], *args, **kwargs)
    out = {"block": block.graph_break_count, "block_graphs": block.graph_count,
           "block_reasons": [str(b.reason) for b in block.break_reasons]}
    if whole:
        torch._dynamo.reset()  # noqa: SLF001
        with torch.no_grad():
            model_wide = explain(adapter.loss_sum)(model, x, y)
        out.update(whole=model_wide.graph_break_count, whole_graphs=model_wide.graph_count)
    return out


def refused() -> dict:
    """Uses the runtime cannot support end in a CompileError naming the fix, not in a silent fallback
    to eager or a dynamo traceback: a checkpointed block compiled by the user after zs.shard, and
    compiled autograd (which would trace the runtime's grad hooks)."""
    out = {}
    run = step_mod.build(_config(stage=3, checkpointing="all"), zs.get_mesh())
    for block in run.model.blocks:  # type: ignore[union-attr]
        block.compile(backend=BACKEND)
    x, y = collate(run.dataset, run.sampler.next_indices())
    out["checkpointed"] = _error_of(lambda: step_mod.step(run, x, y))
    run = step_mod.build(_config(stage=3), zs.get_mesh(), compile=BACKEND)
    loss, _ = adapter.loss_sum(run.model, x, y)
    torch._dynamo.config.compiled_autograd = True  # noqa: SLF001 (the switch users flip; no public API)
    try:
        out["compiled_autograd"] = _error_of(torch.compile(lambda: loss.backward(), backend=BACKEND))
    finally:
        torch._dynamo.config.compiled_autograd = False  # noqa: SLF001
    return out


def _error_of(fn) -> str | None:
    try:
        fn()
    except CompileError as e:
        return str(e)
    return None


def compile_suite() -> dict:
    zs.init()
    cases = {("tiny", stage): (lambda stage=stage: _pair(_config(stage=stage), compile=BACKEND)) for stage in (0, 1, 2, 3)}
    cases.update({
        "checkpointed": lambda: _pair(_config(stage=3, checkpointing="every:2"), compile=BACKEND),
        "llama": lambda: _pair(_config(model="hf:llama-tiny", stage=3), compile=BACKEND),
        ("whole", 3): lambda: _pair(_config(stage=3), whole=True),
        # A Llama decoder layer's breaks show in its run's graph count (one graph for all four).
        "breaks": lambda: {"tiny": graph_breaks(_config(stage=3), whole=False)},
        "refused": refused,
    })
    out: dict = {"seconds": {}}
    for key, case in cases.items():
        start = time.perf_counter()
        out[key] = case()
        out["seconds"][key] = round(time.perf_counter() - start, 1)
    return out

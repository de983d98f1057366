"""The fake-GPU world's cases: the real runtime, built and stepped as zeroshard/trainer/step.py does it, on a
mesh whose device is an accelerator, at world sizes 2-8 in one process (tests/fakecuda/fake_world.py).

Run as ``python tests/fakecuda/world_checks.py OUT.json [CASE ...]``: every case (or the named ones)
runs in turn, each in a fresh fake process group, and OUT.json gets one result per case: the error
it raised, if any, else what the tests check (devices, shapes, ledger bytes per op, host syncs by
place, the order of stream and event calls). Numbers are never compared: fake tensors have none.
tests/fakecuda/test_fake_world.py runs it once per suite run; bench/gpu.sh runs it with
ZEROSHARD_REAL_CUDA=1 on a lent GPU.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fake_world as fw  # noqa: E402

STEPS = 2
"""Steps per case: the first records the forward order, the second is measured."""


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world: int
    cfg: dict
    extras: tuple[str, ...] = ()


def _cases() -> list[Case]:
    out = []
    for world in (2, 4, 8):
        for stage in (0, 1, 2, 3):
            out.append(Case(f"stage{stage}-w{world}", world, {"stage": stage}))
    out += [
        Case("stage3-w3", 3, {"stage": 3}),
        Case("stage3-w6-hybrid", 6, {"stage": 3, "shard_size": 3}),
        Case("stage3-w8-noclip", 8, {"stage": 3, "clip": 0.0}),
        Case("stage3-w8-fp16-accum", 8, {"stage": 3, "mp": "fp16", "accum": 2}),
        Case("stage2-w4-bf16-accum", 4, {"stage": 2, "mp": "bf16", "accum": 2}),
        Case("stage3-w4-quant", 4, {"stage": 3, "mp": "fp16", "comm_quant": "weights,grads+ef", "clip": 0.0}),
        Case("offload-w4-noclip", 4, {"stage": 3, "offload": "cpu", "clip": 0.0}),
        Case("offload-w2-fp16-accum-noclip", 2, {"stage": 2, "offload": "cpu", "mp": "fp16", "accum": 2,
                                                 "clip": 0.0}),
        Case("offload-w4-clip", 4, {"stage": 3, "offload": "cpu"}),
        Case("state-dict-w8", 8, {"stage": 3}, ("state_dict",)),
        Case("state-dict-offload-w4", 4, {"stage": 3, "offload": "cpu", "clip": 0.0}, ("state_dict",)),
        Case("desync-w8", 8, {"stage": 3}, ("desync",)),
        Case("profile-summary-w4", 4, {"stage": 3}, ("profile",)),
        Case("tp2-w4", 4, {"stage": 3, "tp": 2}),
        Case("tp2-w8", 8, {"stage": 2, "tp": 2}),
        Case("pp2-w4", 4, {"stage": 1, "pp": 2, "microbatches": 2}),
        Case("pp2-w8", 8, {"stage": 3, "pp": 2, "microbatches": 2}),
        Case("ep2-w4", 4, {"stage": 3, "model": "tiny-moe", "ep": 2}),
        Case("ep4-w8", 8, {"stage": 2, "model": "tiny-moe", "ep": 4}),
    ]
    return out


CASES = {c.name: c for c in _cases()}

DEFECT = "defect {} of issue 46: {}"
EXPECTED_FAILURES: dict[str, str] = {}
"""Cases a known defect still fails (none: defects 1-3 of issue 46 are fixed, and their cases run)."""
CANNOT_RUN = {
    "pp2-w4": "torch.distributed.pipelining's schedule reads its peers' vote on the host at its first step "
              "(schedules.py _warmup_p2p: result.item()); the fake process group delivers no peer's data",
    "pp2-w8": "torch.distributed.pipelining's schedule reads its peers' vote on the host at its first step "
              "(schedules.py _warmup_p2p: result.item()); the fake process group delivers no peer's data",
    "ep2-w4": "each rank runs the experts module's own forward on its experts, which routes with torch.where: "
              "an output shape set by the data, which fake tensors cannot size",
    "ep4-w8": "each rank runs the experts module's own forward on its experts, which routes with torch.where: "
              "an output shape set by the data, which fake tensors cannot size",
}
"""Cases that cannot run in this world, and why (the tests mark both kinds strict xfail, so each
flips the day it passes)."""

REAL_CUDA_SKIPS = {
    "ep2-w4": "the fake process group never writes the exchanged expert counts, and a real tensor's "
              "garbage counts size the row exchange",
    "ep4-w8": "the fake process group never writes the exchanged expert counts, and a real tensor's "
              "garbage counts size the row exchange",
}
"""With real CUDA tensors (bench/gpu.sh) data is read for real: cases whose shapes come from data
that the fake process group never delivers are left out, with why."""


# --------------------------------------------------------------------------- one case


def config_of(case: Case):
    TrainConfig = fw.module("zeroshard.trainer.config", "zeroshard.trainer.config").TrainConfig

    base = {"model": "tiny", "nproc": case.world, "batch": 4 * case.world, "seq_len": 16, "steps": STEPS,
            "vocab_size": 16, "num_samples": 64, "warmup": 1, "profile": False, "check_schedule": True}
    cfg = {**base, **case.cfg}
    if cfg.get("pp", 1) > 1 or cfg.get("ep", 1) > 1:
        # The step schedule models one engine's collectives on one mesh: not a pipeline rank's
        # stages, nor expert params on the expert mesh (their all-to-alls and reductions).
        cfg["check_schedule"] = False
    return TrainConfig(**cfg)


def _model(cfg, dev: torch.device) -> torch.nn.Module:
    """The model as zeroshard/trainer/step.py builds it, but first on the meta device outside the fake mode:
    ``GPT.__init__`` moves a model built under FakeTensorMode with ``Module.to_empty``, which swaps
    the fake meta params and fails on the fake mode's weak references to them."""
    from zeroshard.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.named(cfg.model, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len))
    return model


def _materialise(model: torch.nn.Module, cfg, dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(cfg.seed)
    model.to_empty(device=dev)
    model.init_weights()
    return model


def _one_host(world_mesh):
    """The topology gather at zs.init sends every rank's facts through ``all_gather_object``; on the
    fake process group the peers' objects never arrive, so the world is declared one host."""
    from zeroshard.comm.topology import Topology

    return Topology.from_hosts(["localhost"] * world_mesh.world)


def _devices(run, dev: torch.device, offloaded: bool) -> list[str]:
    """Every tensor of the run that is not where it belongs, by name."""
    get_engine = fw.module("zeroshard.runtime", "zeroshard.runtime").get_engine

    wrong = []
    modules = run.pipeline.modules if run.pipeline is not None else [run.model]
    for module in modules:
        for name, p in module.named_parameters():
            # Stage 3 with offload shows the modules 1-D pieces of the host masters between uses.
            if p.device.type != dev.type and not (offloaded and p.device.type == "cpu"):
                wrong.append(f"param {name} on {p.device}")
        engine = get_engine(module)
        for group in engine.groups:
            want = "cpu" if offloaded and group.trainable else dev.type
            if group.shard.device.type != want:
                wrong.append(f"master of {group.unit} on {group.shard.device}, want {want}")
    opts = run.opt.items if hasattr(run.opt, "items") else [run.opt]
    for opt in opts:
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    want = "cpu" if offloaded else dev.type
                    if value.device.type != want:
                        wrong.append(f"optimizer state {key} on {value.device}, want {want}")
    return wrong


def _bytes_by_op(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.op] = out.get(r.op, 0) + r.bytes
    return out


def _count_by_op(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.op] = out.get(r.op, 0) + 1
    return out


def _mark_reads() -> None:
    """Put every hand-out of a grad shard to a reader (the scaler, clipping, the optimizer) into
    CALLS, so the tests can check that the offload copies' event was waited on before it."""
    FlatGroup = fw.module("zeroshard.runtime.flat", "zeroshard.runtime.flat").FlatGroup

    plain = FlatGroup.grad_shard
    if getattr(plain.fget, "marked", False):
        return

    def read(group):
        value = plain.fget(group)
        if value is not None:
            fw.CALLS.append(("read", group.unit))
        return value

    marked = property(read, plain.fset)
    marked.fget.marked = True  # type: ignore[attr-defined]
    FlatGroup.grad_shard = marked  # type: ignore[method-assign]


def _state_dict(run, dev, model_shapes) -> dict:
    import zeroshard as zs

    sd = zs.full_state_dict(run.model)
    wrong = [k for k, v in sd.items() if k in model_shapes and tuple(v.shape) != model_shapes[k]]
    return {"keys": len(sd), "wrong_shapes": wrong, "missing": sorted(set(model_shapes) - set(sd)),
            "devices": sorted({v.device.type for v in sd.values()})}


def _desync(run, dev, model_shapes) -> dict:
    desync = fw.module("zeroshard.observing.desync", "zeroshard.observing.desync")

    return {"bytes": desync.check(STEPS)}


def _profile(run, dev, model_shapes) -> dict:
    zstep = fw.module("zeroshard.trainer.step", "zeroshard.trainer.step")
    for_model = fw.module("zeroshard.observing.profile.step", "zeroshard.observing.profile.step").for_model

    profiler = for_model(run.model, run.mesh, batch=run.cfg.batch, tokens_per_step=run.cfg.batch * run.cfg.seq_len,
                         peak_flops=1e12)
    x, y = _batch(run, dev)
    profiler.begin(0)
    zstep.step(run, x, y)
    profiler.end(0)
    summary = profiler.summary()
    return {"keys": sorted(summary)}


EXTRAS: dict[str, Callable[..., dict]] = {"state_dict": _state_dict, "desync": _desync, "profile": _profile}


def _batch(run, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = run.cfg.batch // run.mesh.dp_size
    shape = (rows, run.cfg.seq_len)
    return (torch.randint(0, run.cfg.vocab_size, shape, device=dev),
            torch.randint(0, run.cfg.vocab_size, shape, device=dev))


def run_case(case: Case) -> dict[str, Any]:
    import zeroshard as zs
    zstep = fw.module("zeroshard.trainer.step", "zeroshard.trainer.step")
    from zeroshard.comm import host_sync
    from zeroshard.comm import devices as devices_mod
    from zeroshard.comm import world as world_mod
    get_engine = fw.module("zeroshard.runtime", "zeroshard.runtime").get_engine

    started = time.perf_counter()
    _mark_reads()
    dev = fw.device()
    fw.start_fake_world(case.world)
    devices_mod.declare_backend_device("fake", dev.type)
    world_mod.gather_topology = _one_host  # module attribute world.py's _join_topology calls
    out: dict[str, Any] = {"world": case.world}
    try:
        cfg = config_of(case)
        model = _model(cfg, dev)
        model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        n_params = sum(p.numel() for p in model.parameters())  # the tied embedding/head once
        # The mesh is built from ints, outside the fake mode: torch's DeviceMesh reads its own rank
        # table on the host, which fake tensors cannot give.
        mesh = zs.init(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, shard_size=cfg.shard_size)
        out["mesh_device"] = str(mesh.device)
        with fw.fake_tensors():
            run = zstep.build(cfg, mesh, model=_materialise(model, cfg, dev))
            x, y = _batch(run, dev)
            zstep.step(run, x, y)  # the first step records the order prefetch follows
            host_sync.reset()
            fw.CALLS.clear()
            fw.COPIES.clear()
            seq = zs.ledger().next_seq
            outcome = zstep.step(run, x, y)
            out["syncs"] = host_sync.counts()
            out["calls"] = [list(c) for c in fw.CALLS]
            out["copies"] = [list(c) for c in fw.COPIES]
            records = zs.ledger().since(seq)
            out["bytes"], out["ops"] = _bytes_by_op(records), _count_by_op(records)
            out["params"] = n_params
            out["loss_device"] = str(outcome.loss_sum.device)
            modules = run.pipeline.modules if run.pipeline is not None else [run.model]
            out["units"] = sum(len(get_engine(m).units) for m in modules)
            out["groups"] = sum(len(get_engine(m).trainable_groups) for m in modules)
            out["flat_numel"] = sum(g.layout.numel for m in modules for g in get_engine(m).trainable_groups)
            out["wrong_devices"] = _devices(run, dev, cfg.engine.offload.kind != "none")
            for extra in case.extras:
                out[extra] = EXTRAS[extra](run, dev, model_shapes)
    except Exception as exc:  # the test names the case and shows this
        out["error"] = f"{type(exc).__name__}: {exc}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "zeroshard" in f.filename or "fakecuda" in f.filename]
        out["trace"] = "".join(traceback.format_list(frames[-8:]))
    finally:
        zs.shutdown()
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def main(argv: list[str]) -> int:
    path, names = argv[0], argv[1:] or list(CASES)
    skips = REAL_CUDA_SKIPS if fw.REAL_CUDA else {}
    results = {name: ({"skipped": skips[name]} if name in skips else run_case(CASES[name])) for name in names}
    Path(path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

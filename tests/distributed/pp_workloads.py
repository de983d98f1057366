"""Workers for the pipeline tests: world 4 = pp 2 x shard 2, the built-in GPT and HF Llama (tied heads).

Module level so spawned ranks can import it; one process group runs every case, each built from a
`TrainConfig` through `zeroshard.trainer.step.build` exactly as `zeroshard train --pp 2` builds it.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched; the configs are built in code


import torch

import zeroshard as zs
from zeroshard.trainer import step as step_mod
from zeroshard.trainer.config import TrainConfig
from zeroshard.parallel.experts import ep_forwards
from zeroshard.runtime import get_engine
from zeroshard.trainer.train import train_step

WORLD = 4
STEPS = 5
"""Steps of every suite case (each one a world-4 run and its reference); `zeroshard verify --pp 2` runs 20."""
MODELS = {"gpt": "tiny", "llama": "hf:llama-tiny"}
SCHEDULES = ("1f1b", "interleaved-1f1b")
CASES = [("gpt", stage, sched) for sched in SCHEDULES for stage in (1, 2, 3)]
# Llama differs from the GPT in its model, not in how a stage reduces: its tied head and rotary
# forward are held at stage 3 under each schedule, and at stage 1 (its compiled twin below).
CASES += [("llama", 3, sched) for sched in SCHEDULES] + [("llama", 1, "interleaved-1f1b")]
CASES += [("gpt", 3, "gpipe"), ("gpt", 2, "looped-bfs")]  # torch's other two schedules, one case each
# The zero-bubble schedule splits each backward into input and weight halves that run no grad hook.
CASES += [("gpt", 1, "interleaved-zero-bubble"), ("gpt", 3, "interleaved-zero-bubble"),
          ("llama", 3, "interleaved-zero-bubble")]
STAGE0_CASES = [("gpt", 0, "1f1b")]
"""Our own stage 0 (DDP inside each stage) under the pipeline, held against our stage 0 without one."""
TP_CASE = ("gpt", 3, "1f1b")
"""pp 2 x tp 2 (shard 1) at stage 3, on a second mesh of the same world."""
GRAD_REDUCE_CASES = [("gpt", stage, sched, "microbatch") for sched in SCHEDULES for stage in (2, 3)]
GRAD_REDUCE_CASES += [("gpt", 3, "interleaved-zero-bubble", "microbatch")]  # grads taken after each weight half
# pp_grad_reduce="microbatch": stages 2-3 reduce-scatter after every microbatch into the grad shard.
# Each is held to one process and to its CASES twin, which reduces once per step.


EP_CASES = [("moe", stage, sched) for sched in SCHEDULES for stage in (1, 3)] + [("moe", 0, "1f1b"), ("moe", 2, "1f1b")]
EP_CASES += [("mixtral", 3, sched) for sched in SCHEDULES] + [("mixtral", 1, "1f1b")]
"""pp 2 x ep 2 (shard 2 inside each stage, each stage's experts split over its 2 ranks, edp 1):
tiny-moe with its per-layer load-balancing loss, and HF Mixtral without router logits. 4
microbatches under both schedules: tiny-moe's loss is defined per microbatch, so one reference
(cut the same way) serves every case."""


def ep_config(name: str, stage: int, schedule: str = "1f1b", **kw: Any) -> TrainConfig:
    """An EP_CASES run: tiny-moe by name; Mixtral is a test model (``mixtral``) given to the run, so
    its config names tiny-moe, which has the same 4 blocks and MoE layers for the config's checks."""
    return TrainConfig(**{"model": "tiny-moe", "nproc": WORLD, "pp": 2, "ep": 2, "stage": stage,
                          "pp_schedule": schedule, "microbatches": 4, "steps": STEPS, "batch": 8, "seq_len": 32,
                          "clip": 0.5 if name == "mixtral" else 1.0, "num_samples": 256, **kw})  # both clip


def mixtral(cfg: TrainConfig) -> torch.nn.Module:
    """A tiny HF Mixtral (4 layers, 4 experts, top 2, tied head; no router logits), seeded: the same
    on every rank and in the reference."""
    import transformers as tf

    from zeroshard.models.hf import HFSpec

    torch.manual_seed(cfg.seed)
    config = tf.MixtralConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=cfg.seq_len, vocab_size=cfg.vocab_size, tie_word_embeddings=True,
                              use_cache=False, attention_dropout=0.0, bos_token_id=None, eos_token_id=None,
                              pad_token_id=None, output_router_logits=False)
    model = tf.MixtralForCausalLM(config).train()
    model.cfg = HFSpec("test:mixtral", config.to_dict())  # read as an HF model: its loss is transformers' logits'
    return model


def _ep_train(name: str, stage: int, schedule: str, mesh) -> dict:
    cfg = ep_config(name, stage, schedule)
    return _train(cfg, mesh, model=mixtral(cfg) if name == "mixtral" else None)


def config(name: str, stage: int, schedule: str = "1f1b", pp_grad_reduce: str = "step", *, pp: int = 2,
           **kw: Any) -> TrainConfig:
    return TrainConfig(**{"model": MODELS[name], "nproc": WORLD, "pp": pp, "stage": stage, "pp_schedule": schedule,
                          "pp_grad_reduce": pp_grad_reduce, "steps": STEPS, "batch": 8, "seq_len": 32, "clip": 1.0,
                          "num_samples": 256, **kw})


CHECKPOINTING_CASES = [("gpt", 3, "1f1b", "all"), ("gpt", 2, "interleaved-1f1b", "sqrt")]
"""Activation checkpointing inside each stage (the engine's own), held to one process."""
QUANT_CASES = [("gpt", 3, "1f1b", "step", "weights"), ("gpt", 3, "1f1b", "step", "grads"),
               ("gpt", 3, "1f1b", "microbatch", "grads")]
"""comm_quant inside each stage (qwZ weights, qgZ grads), held to their unquantized CASES twin."""
OFFLOAD_CASES = [("gpt", 3, "1f1b"), ("gpt", 2, "interleaved-1f1b"), ("gpt", 3, "interleaved-zero-bubble")]
"""offload="cpu" inside each stage: masters and optimizer state in host memory, the CPU optimizer step."""
COMPILE_CASES = [("gpt", 3, "1f1b", 1), ("llama", 1, "interleaved-1f1b", 1), ("gpt", 3, "1f1b", 2)]
"""Each stage's block forwards compiled (aot_eager: inductor takes minutes a block on a loaded CPU),
held to one process and to their eager twin (CASES, or pp-tp at tp 2: DTensor's collectives inside
the compiled blocks still reach the ledger)."""


def _count_block_runs(run) -> list[int]:
    """Counts every run of the first block of this rank's first stage, a recompute included: the
    checkpointed block's own forward, which torch's checkpoint calls again in backward."""
    block = run.pipeline.modules[0].block_modules()[0]
    segment = block.forward.__self__  # the checkpoint segment the engine installed as its forward
    original, runs = segment.forwards[0], [0]

    def counted(*args, **kwargs):
        runs[0] += 1
        return original(*args, **kwargs)

    segment.forwards[0] = counted
    return runs


def _train(cfg: TrainConfig, mesh, model: torch.nn.Module | None = None) -> dict:
    ledger = zs.ledger()
    run = step_mod.build(cfg, mesh, model=model)
    block_runs = _count_block_runs(run) if cfg.engine.checkpointing != "none" else None
    records, traffic, counts, tp_counts, a2a = [], [], [], {}, []
    forwards = {n: f for m in (run.pipeline.modules if run.pipeline else [run.model]) for n, f in ep_forwards(m).items()}
    for i in range(cfg.steps):
        seq = ledger.next_seq
        marks = {name: len(f.sent_rows) for name, f in forwards.items()}
        records.append(train_step(run, i))
        last_step = ledger.since(seq)
        traffic.append(_traffic(ledger.since(seq)))
        counts.append(_traffic(ledger.since(seq), count=True))
        for r in ledger.since(seq):  # DTensor's own collectives, as the ledger's dispatch mode saw them
            if str(r.group) == "tp":
                tp_counts[f"{r.op}:{r.phase}"] = tp_counts.get(f"{r.op}:{r.phase}", 0) + 1
        if forwards:
            a2a.append(_a2a(ledger.since(seq), forwards, marks, mesh, hidden=run.pipeline.hidden))
    state = run.pipeline.full_state_dict() if run.pipeline is not None else zs.full_state_dict(run.model)
    facts = {}
    if run.pipeline is not None:
        pipe = run.pipeline
        facts = {"stages": pipe.stage_indices, "replicate": mesh.replicate_size, "shard": mesh.shard_size,
                 "num_stages": pipe.num_stages, "microbatches": pipe.microbatches,
                 "act_bytes": cfg.batch // mesh.dp_size // pipe.microbatches * cfg.seq_len * pipe.hidden * 4,
                 "tied": [(t.owner_fqn, t.copy_fqn) for t in pipe.tied],
                 "names": sorted({n for m in pipe.modules for n, _ in m.named_parameters()}),
                 "offloaded": [get_engine(m).memory_snapshot().offloaded for m in pipe.modules],
                 # What one reduction of each of this rank's flat groups carries: its padded grads.
                 "group_grad_bytes": [g.layout.numel * g.reduce_dtype.itemsize for m in pipe.modules
                                      for g in get_engine(m).trainable_groups]}
    if block_runs is not None:
        facts["block_runs"] = block_runs[0]
    if forwards:
        facts["a2a"] = a2a
        facts["moe_layers"] = sorted(forwards)
    if run.pipeline is not None and cfg.tp == 1 and cfg.ep == 1:
        facts["schedule_vs_ledger"] = _schedule_vs_ledger(run.pipeline, last_step)
    return {"params": {k: v.detach().float().cpu() for k, v in state.items()} if mesh.rank == 0 else None,
            "losses": [r.loss for r in records], "norms": [r.grad_norm for r in records], "bytes": traffic,
            "counts": counts, "tp_counts": tp_counts, **facts}


def _a2a(records, forwards: dict, marks: dict, mesh, *, hidden: int) -> dict:
    """One step's ep all-to-alls as the ledger has them (bytes, and the layers named as units) and
    the bytes this rank's routing counts say they carry: per layer call, the counts (one int64 per
    expert) and the rows sent and received, there and back, forward and backward."""
    mine = [r for r in records if r.op == "all_to_all" and r.group == "ep" and r.mesh == mesh.experts.ledger_name]
    expected = 0
    for name, fwd in forwards.items():
        for sent, received in zip(fwd.sent_rows[marks[name]:], fwd.received_rows[marks[name]:]):
            expected += fwd.layer.num_experts * 8 + 2 * (sent + received) * hidden * 4
    return {"ledger": sum(r.bytes for r in mine), "routed": expected, "units": sorted({r.unit for r in mine}),
            "received": sum(sum(f.received_rows[marks[n]:]) for n, f in forwards.items())}


def _schedule_vs_ledger(pipe, records) -> dict[str, Any]:
    """The steady step's collectives of this rank's stage engines as the step schedule derives them
    in torch's order (one ``pipeline_order`` per stage), against the ledger's for that step: each
    (op, group, unit, phase, numel) and how often. The pipeline's own sends, tied-param sums and
    clipping all-reduce are not an engine's, and left out."""
    import collections

    from zeroshard.parallel.pipeline.order import schedule_order, stage_order
    from zeroshard.runtime.schedule import engine_schedule

    order = schedule_order(pipe.spec, pp=pipe.mesh.pp_size, stages_per_rank=len(pipe.stage_indices),
                           microbatches=pipe.microbatches)[pipe.mesh.pp_rank]
    planned: collections.Counter = collections.Counter()
    units = set()
    for stage, module in zip(pipe.stage_indices, pipe.modules):
        engine = get_engine(module)
        units |= {u.name for u in engine.units}
        for e in engine_schedule(engine, pipeline_order=stage_order(order, stage)).collectives:
            planned[(e.op, e.group, e.unit, e.phase, e.numel)] += 1
    recorded = collections.Counter((str(r.op), str(r.group), r.unit, str(r.phase), r.numel) for r in records
                                   if r.unit in units and str(r.phase) in ("forward", "backward", "param_sync"))
    return {"planned": dict(planned), "recorded": dict(recorded)}


def _traffic(records, *, count: bool = False) -> dict[str, int]:
    """Bytes (or records) per group:op:phase of the pp groups and the stage's shard group."""
    out: dict[str, int] = {}
    for r in records:
        if str(r.group) in ("pp", "pp_ends", "shard"):
            key = f"{r.group}:{r.op}:{r.phase}"
            out[key] = out.get(key, 0) + (1 if count else r.bytes)
    return out


def _fp16_overflow(mesh, cfg: TrainConfig | None = None, param: str = "pos_emb.weight", ranks=(0, 1)) -> dict:
    """fp16 at stage 2 for 3 steps, with an inf put into ``param``'s grad on ``ranks`` alone at step 2
    (by default the first stage's embedding): every rank (both stages) must skip that step and back
    off the scale, and train on either side of it."""
    run = step_mod.build(cfg or config("gpt", 2, mp="fp16", steps=3), mesh)
    scales, skipped, moved = [], [], []
    for i in range(3):
        before = [g.shard.clone() for m in run.pipeline.modules for g in get_engine(m).trainable_groups]
        handle = None
        if i == 1 and mesh.rank in ranks:
            handle = run.pipeline.modules[0].get_parameter(param).register_hook(lambda g: g * float("inf"))
        train_step(run, i)
        if handle is not None:
            handle.remove()
        after = [g.shard for m in run.pipeline.modules for g in get_engine(m).trainable_groups]
        moved.append(any(not torch.equal(a, b) for a, b in zip(after, before)))
        scales.append(run.scaler.get_scale())
        skipped.append(run.scaler.skipped_steps)
    return {"scales": scales, "skipped": skipped, "moved": moved}


def _meta_init(mesh, tp: int = 1) -> dict:
    """init="meta" under pp at stage 3: the whole model built on meta, this rank's stage cut and only
    its shards materialised. Against a plain seeded build cut the same way, bitwise; the params outside
    the stage are never given storage, and the replay holds at most one full param at a time. With
    ``tp`` the model is split over the mesh's tp dim first: every tp param, this stage's and the
    others', is drawn at its full shape, as the plain build draws it, and this rank keeps its part."""
    from zeroshard.parallel.pipeline import Pipeline
    from zeroshard.runtime.state import full_state_dict
    from zeroshard.trainer.tp_setup import apply_tensor_parallel

    cfg = config("gpt", 3, init="meta", tp=tp)
    vocab = step_mod.build_data(cfg).vocab_size
    model = step_mod.build_model(cfg, vocab, mesh.device)
    built_on_meta = all(p.is_meta for p in model.parameters())
    apply_tensor_parallel(cfg, model, mesh)
    pipe = Pipeline(model, mesh=mesh, stage=3, microbatches=2)
    kept = {n for m in pipe.modules for n, _ in m.named_parameters()}
    outside = {n: p.is_meta for n, p in model.named_parameters(remove_duplicate=False) if n not in kept}
    mine = {n: t for m in pipe.modules for n, t in full_state_dict(m).items()}
    plain = step_mod.build_model(config("gpt", 3, init="full"), vocab, torch.device("cpu")).state_dict()
    return {"built_on_meta": built_on_meta, "kept": sorted(kept), "outside_meta": outside,
            "mismatched": [n for n, t in mine.items() if not torch.equal(t.cpu(), plain[n])],
            "compared": sorted(mine), "peak_temp_bytes": get_engine(pipe.modules[0]).init_stats["peak_temp_bytes"],
            "init_path": get_engine(pipe.modules[0]).init_stats["path"],
            "largest_param_bytes": max(t.numel() * t.element_size() for t in plain.values())}


def _pretrained_folder(mesh) -> dict:
    """A save_pretrained Llama folder (tied head) under pp at stage 3: built on meta, each stage reads
    only its own shard of the files' tensors; the values are bitwise transformers' own load of them."""
    import shutil
    import tempfile

    import transformers as tf

    from zeroshard.checkpoint.hf.pretrained import build_pretrained, load_pretrained, plain_pretrained
    from zeroshard.parallel.pipeline import Pipeline
    from zeroshard.runtime.state import full_state_dict

    # Rank 0 writes the folder (transformers saves on the main process only), at a path the ranks of
    # this spawn share; the others wait for it.
    folder = os.path.join(tempfile.gettempdir(), f"zs-pp-folder-{os.getppid()}")
    if mesh.rank == 0:
        torch.manual_seed(0)
        hf = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                            intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                            tie_word_embeddings=True)
        tf.LlamaForCausalLM(hf).save_pretrained(folder, max_shard_size="100KB")
    torch.distributed.barrier()
    model = build_pretrained(folder)
    pipe = Pipeline(model, mesh=mesh, stage=3, microbatches=2, skip_init=True)
    stats = [load_pretrained(m, folder, whole=model, tied=pipe.tied_copies) for m in pipe.modules]
    kept = {n for m in pipe.modules for n, _ in m.named_parameters()}
    mine = {n: t for m in pipe.modules for n, t in full_state_dict(m).items()}
    plain = plain_pretrained(folder).state_dict()
    torch.distributed.barrier()
    if mesh.rank == 0:
        shutil.rmtree(folder)  # this test's own folder
    return {"mismatched": [n for n, t in mine.items() if not torch.equal(t.cpu(), plain[n])], "compared": sorted(mine),
            "outside_meta": [p.is_meta for n, p in model.named_parameters(remove_duplicate=False) if n not in kept],
            "bytes_read": sum(s["bytes_read"] for s in stats), "bytes_held": sum(s["bytes_held"] for s in stats),
            "folder_bytes": sum(t.numel() * t.element_size() for n, t in plain.items() if n != "lm_head.weight"),
            "tied": pipe.tied_copies, "folder": folder}


def _errors(mesh) -> dict[str, str]:
    """One line each for the layouts the runtime refuses (the config's own errors are unit-tested)."""
    from zeroshard.models.gpt import GPT, GPTConfig
    from zeroshard.parallel.pipeline import Pipeline
    from zeroshard.runtime.options import EngineOptions

    out = {}
    for key, fn in {
        "mesh_product": lambda: zs.new_mesh(mesh_shape=(2, 3), names=("pp", "shard"), name="bad"),
        "pp_world": lambda: zs.new_mesh(pp=3, name="bad3"),
        "blocks": lambda: Pipeline(GPT(GPTConfig.named("tiny", n_layer=3)), mesh=mesh, stage=1, microbatches=2),
        "microbatches": lambda: Pipeline(GPT(GPTConfig.named("tiny")), mesh=mesh, stage=1,
                                         microbatches=1).check_batch(4),
        "batch": lambda: Pipeline(GPT(GPTConfig.named("tiny")), mesh=mesh, stage=1, microbatches=4).check_batch(6),
        "grad_reduce_stage": lambda: Pipeline(GPT(GPTConfig.named("tiny")), mesh=mesh, stage=1,
                                              options=EngineOptions(pp_grad_reduce="microbatch")),
    }.items():
        try:
            fn()
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
    return out


MOE_FOLDER_STEPS = 3


def write_moe_folder(root) -> str:
    """The ep tests' random tiny Mixtral folder, with 4 layers (4 experts) so that pp 2 cuts it."""
    from ep_workloads import make_folder

    return make_folder(root, layers=4)


def moe_folder_config(folder: str) -> TrainConfig:
    """What `zeroshard train --model FOLDER --nproc 4 --pp 2 --ep 2 --stage 3` runs, for 3 steps."""
    return TrainConfig(model=folder, nproc=WORLD, pp=2, ep=2, stage=3, microbatches=2, batch=8, seq_len=16,
                       steps=MOE_FOLDER_STEPS, num_samples=64, dropout=False, profile=False)


def suite(moe_folder: str | None = None) -> dict:
    mesh = zs.init(pp=2)
    out: dict[str, Any] = {"mesh": {"pp": mesh.pp_size, "shard": mesh.shard_size, "dp": mesh.dp_size,
                                    "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "shard_rank": mesh.shard_rank}}
    times = {}
    for case in CASES + STAGE0_CASES + GRAD_REDUCE_CASES:
        t0 = time.perf_counter()
        out[case] = _train(config(*case), mesh)
        times[case] = time.perf_counter() - t0
    # Our stage 0 without a pipeline, on a mesh of the same world sharded 4 ways.
    flat = zs.new_mesh(name="flat")
    out["flat-stage0"] = _train(config("gpt", 0, pp=1), flat)
    t0 = time.perf_counter()
    pptp = zs.new_mesh(pp=2, tp=2, name="pptp")
    out["pp-tp"] = _train(config(*TP_CASE, tp=2), pptp)
    times["pp-tp"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out["pp-tp-llama"] = _train(config("llama", 3, tp=2), pptp)
    times["pp-tp-llama"] = time.perf_counter() - t0
    # A replicate dim inside each stage: 2 replicas of 1 shard rank, the hybrid path's all-reduce.
    t0 = time.perf_counter()
    pprep = zs.new_mesh(pp=2, shard_size=1, name="pprep")
    out["pp-replicate"] = _train(config("gpt", 3, shard_size=1), pprep)
    times["pp-replicate"] = time.perf_counter() - t0
    # pp_grad_reduce="microbatch" on the same two layouts (the tied sum over a shard group of 1).
    for case, layout, mesh_of_case in (("pp-tp-microbatch", {"tp": 2}, pptp),
                                       ("pp-replicate-microbatch", {"shard_size": 1}, pprep)):
        t0 = time.perf_counter()
        out[case] = _train(config("gpt", 3, "1f1b", "microbatch", **layout), mesh_of_case)
        times[case] = time.perf_counter() - t0
    for name, stage, sched, policy in CHECKPOINTING_CASES:
        t0 = time.perf_counter()
        out[("checkpointing", stage, sched, policy)] = _train(config(name, stage, sched, checkpointing=policy), mesh)
        times[("checkpointing", stage, sched, policy)] = time.perf_counter() - t0
    for name, stage, sched, grad_reduce, quant in QUANT_CASES:
        key = ("comm_quant", stage, sched, grad_reduce, quant)
        out[key] = _train(config(name, stage, sched, grad_reduce, comm_quant=quant), mesh)
    for name, stage, sched in OFFLOAD_CASES:
        t0 = time.perf_counter()
        out[("offload", stage, sched)] = _train(config(name, stage, sched, offload="cpu"), mesh)
        times[("offload", stage, sched)] = time.perf_counter() - t0
    from torch._dynamo.utils import counters

    for name, stage, sched, tp in COMPILE_CASES:
        t0 = time.perf_counter()
        counters.clear()
        key = ("compile", stage, sched, name, tp)
        out[key] = _train(config(name, stage, sched, compile=True, compile_backend="aot_eager", tp=tp),
                          pptp if tp > 1 else mesh)
        out[key]["graphs"] = counters["stats"]["unique_graphs"]
        times[key] = time.perf_counter() - t0
    out["meta-init"] = _meta_init(mesh)
    out["meta-init-tp"] = _meta_init(pptp, tp=2)
    t0 = time.perf_counter()
    out["meta-init-train-tp"] = _train(config("gpt", 3, init="meta", tp=2), pptp)
    times["meta-init-train-tp"] = time.perf_counter() - t0
    out["pretrained-folder"] = _pretrained_folder(mesh)
    t0 = time.perf_counter()
    out["meta-init-train"] = _train(config("gpt", 3, init="meta"), mesh)
    times["meta-init-train"] = time.perf_counter() - t0
    ppep = zs.new_mesh(pp=2, ep=2, name="ppep")  # experts split over ep 2 inside each stage
    out["ppep-mesh"] = {"dense": ppep.describe(), "experts": ppep.experts.describe(),
                        "ep_rank": ppep.experts.ep_rank, "edp_rank": ppep.experts.shard_rank}
    for case in EP_CASES:
        t0 = time.perf_counter()
        out[("ep",) + case] = _ep_train(*case, ppep)
        times[("ep",) + case] = time.perf_counter() - t0
    t0 = time.perf_counter()  # tiny-moe without ep: every rank holds every expert, the aux loss per stage still
    out["moe-ep1"] = _train(ep_config("moe", 3, ep=1), mesh)
    times["moe-ep1"] = time.perf_counter() - t0
    t0 = time.perf_counter()  # built on meta: each stage replays the init, drawing other stages' experts whole
    out["ep-meta"] = _train(ep_config("moe", 3, init="meta"), ppep)
    times["ep-meta"] = time.perf_counter() - t0
    # An inf in one rank's own experts (rank 0's ep block of block 0) alone: every rank skips the step.
    out["fp16-ep"] = _fp16_overflow(ppep, ep_config("moe", 2, mp="fp16", steps=3), "blocks.0.mlp.experts.fc_weight",
                                    ranks=(0,))
    if moe_folder is not None:  # a save_pretrained Mixtral, each stage reading its own experts' block
        t0 = time.perf_counter()
        out["ep-folder"] = _train(moe_folder_config(moe_folder), ppep)
        times["ep-folder"] = time.perf_counter() - t0
    out["fp16"] = _fp16_overflow(mesh)
    out["errors"] = _errors(mesh)
    out["times"] = times
    zs.shutdown()
    return out

"""Workers for the tensor-parallel tests: world 4 = 2 shard x 2 tp, the built-in GPT and HF Llama.

Module level so spawned ranks can import it; one process group runs every case.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched; the configs are built in code

import torch

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import build_dataset, collate
from zeroshard.models import GPT, GPTConfig
from zeroshard.trainer.adapter import mean_loss
from zeroshard.models.hf import build_hf_model
from zeroshard.tools.planner.measure import model_state_bytes
from zeroshard.runtime import get_engine
from zeroshard.parallel.tp import tensor_parallel
from reference_steps import plain_adamw_steps

SEED = 1234
LR = 1e-3
WEIGHT_DECAY = 0.1
CLIP = 1.0
STEPS = 5  # the suite's; `zeroshard verify --tp 2` runs 20
GLOBAL_BATCH = 8
SEQ_LEN = 32
MODELS = ("gpt", "llama")
ADAM_EPS = {"gpt": 1e-8, "llama": 1e-6}
"""Adam's first step moves a param by lr * g / (|g| + eps): for the tiny Llama, TP changes a few grads
of about 1e-9 by about 3e-10 (fp32 rounding of the split contractions, measured; DP alone does not),
which eps=1e-8 turns into 2.1e-5 of param difference. docs/tensor_parallel.md has the figures."""


def dataset():
    return build_dataset(seq_len=SEQ_LEN, num_samples=256, seed=SEED)


def build(name: str, vocab_size: int, *, meta: bool = False) -> torch.nn.Module:
    """The model as one process builds it; ``meta``: the same build with its params on the meta
    device, for ``zs.shard`` to materialise (the GPT's ``init_weights``, Llama's ``hf.init_weights``)."""
    if name == "gpt":
        torch.manual_seed(SEED)
        with zs.meta_init() if meta else contextlib.nullcontext():
            return GPT(GPTConfig.named("tiny", seq_len=SEQ_LEN, vocab_size=vocab_size))
    return build_hf_model("hf:llama-tiny", vocab_size=vocab_size, seq_len=SEQ_LEN, seed=SEED,
                          device=torch.device("cpu"), meta=meta)


def reference_run(name: str, steps: int = STEPS) -> dict:
    """Plain single-process PyTorch on the same model and batches: the numerical ground truth."""
    data = dataset()
    model = build(name, data.vocab_size)
    plain_adamw_steps(model, data, mean_loss, steps=steps, global_batch=GLOBAL_BATCH, seed=SEED, lr=LR,
                      weight_decay=WEIGHT_DECAY, clip=CLIP, eps=ADAM_EPS[name])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tp_run(name: str, stage: int, *, parallel: bool = True, sequence_parallel: bool = False, meta: bool = False,
           **shard_kwargs):
    """A `zeroshard.trainer.step.Run` of ``name`` on this mesh, tensor-parallel when ``parallel``; built on
    the meta device (parallelised there, materialised by ``zs.shard``) when ``meta``."""
    data = dataset()
    model = build(name, data.vocab_size, meta=meta)
    if parallel:
        tensor_parallel(model, sequence_parallel=sequence_parallel)
    cfg = TrainConfig(stage=stage, nproc=zs.get_mesh().world, batch=GLOBAL_BATCH, seq_len=SEQ_LEN, lr=LR, min_lr=LR,
                      warmup=0, weight_decay=WEIGHT_DECAY, clip=CLIP, seed=SEED)
    run = step.build(cfg, zs.get_mesh(), model=model, dataset=data, **shard_kwargs)
    for group in run.opt.param_groups:
        group["eps"] = ADAM_EPS[name]
    return run


def _train(run, steps: int) -> None:
    for _ in range(steps):
        x, y = collate(run.dataset, run.sampler.next_indices())
        step.step(run, x, y)


def _bytes_by_key(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.phase in (step.METRICS_PHASE, "guard"):  # the step's metrics and the non-finite guard's flag
            continue
        key = f"{r.op}:{r.group}:{r.phase}"
        out[key] = out.get(key, 0) + r.bytes
    return out


NORMS = ("ln1.", "ln2.", "input_layernorm.", "post_attention_layernorm.")
"""The blocks' norms: what sequence parallelism runs on the sequence-split stream."""


def _ledger_facts(name: str, run, records) -> dict:
    """One step's bytes per (op, dim, phase), plus the sizes the theory needs."""
    engine = get_engine(run.model)
    mesh = zs.get_mesh()
    per_rank_batch = GLOBAL_BATCH // mesh.dp_size
    cfg: Any = run.model.cfg if isinstance(run.model, GPT) else run.model.config
    width = cfg.n_embd if isinstance(run.model, GPT) else cfg.hidden_size
    layers = cfg.n_layer if isinstance(run.model, GPT) else cfg.num_hidden_layers
    plain = build(name, run.dataset.vocab_size)  # the model's own param names and sizes
    return {
        "by_key": _bytes_by_key(records),
        "activation_bytes": per_rank_batch * SEQ_LEN * width * 4,
        "layers": layers,
        "norm_bytes": sum(p.numel() * 4 for n, p in plain.named_parameters() if any(k in n for k in NORMS)),
        "padded_bytes": sum(g.layout.numel * 4 for g in engine.groups),
        "shard_bytes": sum(g.layout.shard_numel * 4 for g in engine.groups),
        "root_bytes": sum(g.layout.numel * 4 for u in engine.units if u.is_root for g in u.groups),
        "kept_bytes": sum(g.layout.numel * 4 for u in engine.kept_for_backward() for g in u.groups),
    }


def _saved_activation_bytes(run) -> int:
    """Bytes autograd keeps for backward in one forward on this rank (params excluded): what the
    planner's activation estimate predicts. A DTensor is counted by its local tensor."""
    from torch.distributed.tensor import DTensor

    engine = get_engine(run.model)
    params = {t.untyped_storage().data_ptr() for g in engine.groups for t in (g.full, g.shard)}
    sink: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        if st.nbytes() and st.data_ptr() not in params:
            sink.setdefault(st.data_ptr(), st.nbytes())
        return t

    x, y = collate(run.dataset, list(range(GLOBAL_BATCH // zs.get_mesh().dp_size)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mean_loss(run.model, x, y)
    return sum(sink.values())


def _errors() -> dict[str, str]:
    """The one-line errors for a TP degree that does not divide the heads or the hidden size."""
    import transformers

    from zeroshard.parallel.tp import check_tensor_parallel

    out = {}
    try:
        check_tensor_parallel(GPT(GPTConfig(n_layer=1, n_head=3, n_embd=48, vocab_size=64)), 2)
    except ValueError as exc:
        out["heads"] = str(exc)
    with torch.device("meta"):  # the checks read the spec and the shapes: nothing is allocated
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=91, num_hidden_layers=1,
            vocab_size=64))
    try:
        check_tensor_parallel(llama, 4)
    except ValueError as exc:
        out["kv_heads"] = str(exc)
    try:
        check_tensor_parallel(llama, 2)
    except ValueError as exc:
        out["hidden"] = str(exc)
    # Sequence parallelism with a length tp does not divide: refused before any collective (gloo
    # would abort the process on the mismatched sizes). Plain TP models, no engine: nothing to undo.
    for name in MODELS:
        model = tensor_parallel(build(name, vocab_size=dataset().vocab_size), sequence_parallel=True)
        ids = torch.zeros(2, SEQ_LEN - 1, dtype=torch.long)
        try:
            model(ids, ids) if name == "gpt" else model(input_ids=ids)
        except ValueError as exc:
            out[f"sp_{name}"] = str(exc)
    return out


SP_STEPS = 3
"""Sequence-parallel cases: enough steps for Adam's state to carry the norms' reduced grads forward."""
CASES = tuple((name, stage, sp, steps) for name in MODELS for stage, sp, steps in
              ((0, False, 2), (1, False, STEPS), (2, False, STEPS), (3, False, STEPS), (1, True, SP_STEPS),
               (3, True, SP_STEPS)))
"""(model, stage, sequence parallel, steps): the 10-step parity claim at stages 1-3, stage 0 and
sequence parallelism (stages 1 and 3) in fewer steps. One spawned group runs all of them."""


META_CASES = (("gpt", 1), ("gpt", 3), ("llama", 3))
"""(model, stage) built on meta -> zs.tensor_parallel -> zs.shard: stage 1 keeps the full tp-local
buffers, stage 3 only the shard; both fill them from the replayed full params."""
META_STEPS = 2


def _meta_cases() -> dict:
    """Each META_CASES build's params right after zs.shard, and after META_STEPS steps."""
    out = {}
    for name, stage in META_CASES:
        run = tp_run(name, stage, meta=True)
        built = zs.full_state_dict(run.model)
        _train(run, META_STEPS)
        out[(name, stage)] = {"built": built, "trained": zs.full_state_dict(run.model),
                              "init_stats": dict(get_engine(run.model).init_stats)}
    return out


def suite() -> dict:
    """Every case of CASES; each case's last step is checked against theory in the ledger."""
    mesh = zs.init(mesh_shape=(2, 2), names=("shard", "tp"))
    out: dict = {"mesh": mesh.describe(), "params": {}, "ledger": {}, "model_states": {}, "activations": {}}
    ledger = zs.ledger()
    for name, stage, sp, steps in CASES:
        key = (name, stage, sp)
        run = tp_run(name, stage, sequence_parallel=sp)
        if name == "gpt" and stage == 1:  # the planner's activation formula covers our GPT
            out["activations"][sp] = _saved_activation_bytes(run)
        _train(run, steps - 1)
        start = ledger.next_seq
        states: dict[str, int] = {}
        x, y = collate(run.dataset, run.sampler.next_indices())
        # Model states read while the step's grads still exist: what the planner predicts.
        step.step(run, x, y, before_zero_grad=lambda: states.update(model_state_bytes(run.model, run.opt)))
        out["ledger"][key] = _ledger_facts(name, run, ledger.since(start))
        out["model_states"][key] = states
        out["params"][key] = zs.full_state_dict(run.model)
    out["meta"] = _meta_cases()
    out["errors"] = _errors()
    return out


# -- checkpoints -------------------------------------------------------------------------------
CKPT_STEPS = 3
SAVED_STAGE = 2


def _save(run, path: str) -> None:
    zs.save(path, run.model, run.opt, scheduler=run.scheduler, sampler=run.sampler, step=CKPT_STEPS)


def _load(run, path: str):
    return zs.load(path, run.model, run.opt, scheduler=run.scheduler, sampler=run.sampler)


def _rejoin(world: int | None = None, **mesh) -> bool:
    """Leave this process group and join a new one with another mesh, on a fresh port, so that one
    spawned group visits several layouts; ranks >= ``world`` leave. Whether this rank is in it."""
    import torch.distributed as dist

    from zeroshard.trainer.launch import free_port

    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)  # also a barrier: rank 0 has finished what came before
    zs.shutdown()
    os.environ["MASTER_PORT"] = str(port[0])
    if world is not None:
        if int(os.environ["RANK"]) >= world:
            return False
        os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world)
    zs.init(**mesh)
    return True


def ckpt_resume(root: str, source: str, stage: int, *, parallel: bool = False) -> dict:
    """Load checkpoint ``source`` into this mesh, run the next step."""
    run = tp_run("gpt", stage, parallel=parallel)
    loaded = _load(run, f"{root}/{source}")
    params = zs.full_state_dict(run.model)
    _train(run, 1)
    return {"loaded": params, "next": zs.full_state_dict(run.model), "files": loaded.files_read}


def _reshard_offline(root: str) -> None:
    """What ``zeroshard ckpt reshard`` does, on rank 0 with no process group in use."""
    from zeroshard.checkpoint.export import reshard

    reshard(f"{root}/tp", f"{root}/r41", 4)
    reshard(f"{root}/tp", f"{root}/r12", 2, tp=2)
    reshard(f"{root}/r41", f"{root}/rt12", 2, tp=2, tp_plan="gpt")  # (2,2) -> (4,1) -> (1,2)


def ckpt_suite(root: str) -> dict | None:
    """Save at (2 shard, 2 tp) and reshard offline; resume at (4, 1) from the checkpoint and from its
    (4, 1) reshard, save there; then on 2 ranks at (1, 2) load that save and the (1, 2) reshards."""
    zs.init(mesh_shape=(2, 2), names=("shard", "tp"))
    run = tp_run("gpt", SAVED_STAGE)
    _train(run, CKPT_STEPS)
    _save(run, f"{root}/tp")
    out: dict = {"saved": zs.full_state_dict(run.model)}
    _train(run, 1)
    out["continuous"] = zs.full_state_dict(run.model)
    if zs.get_mesh().rank == 0:
        _reshard_offline(root)
    _rejoin(shard_size=4)
    out["4x1"] = ckpt_resume(root, "tp", 3)
    out["r41"] = ckpt_resume(root, "r41", SAVED_STAGE)  # the saved units: one file per rank
    run = tp_run("gpt", 1, parallel=False)
    _load(run, f"{root}/tp")
    _save(run, f"{root}/dp4")
    if not _rejoin(world=2, tp=2):
        return None
    out["dp4 at 1x2"] = ckpt_resume(root, "dp4", 1, parallel=True)
    out["r12"] = ckpt_resume(root, "r12", SAVED_STAGE, parallel=True)
    out["rt12"] = ckpt_resume(root, "rt12", SAVED_STAGE, parallel=True)
    return out


# -- the command line's path: TrainConfig(tp=2) --------------------------------------------------
CLI_CASES = (dict(stage=2), dict(stage=3, accum=2, checkpointing="all"), dict(stage=1, checkpointing="every:2"))
"""TrainConfig keys over CLI_BASE: what `zeroshard train --tp 2` builds, at (shard 2, tp 2)."""
CLI_BASE = dict(model="tiny", nproc=4, tp=2, batch=8, seq_len=SEQ_LEN, steps=2, warmup=0, seed=SEED)


def cli_suite() -> dict:
    """Each CLI_CASES run as `zeroshard train` builds it on a rank (zs.init(tp=cfg.tp),
    zeroshard.trainer.train.setup, train_step): the tp split comes from the config, not from the test.
    Returns the second step's ledger bytes per (op, dim, phase) and the mesh's sizes."""
    from zeroshard.trainer.train import setup, train_step

    out: dict = {}
    for keys in CLI_CASES:
        cfg = TrainConfig(**{**CLI_BASE, **keys})
        mesh = zs.init(timeout_s=cfg.hang_timeout_s, shard_size=cfg.shard_size, tp=cfg.tp)
        run = setup(cfg, mesh)
        train_step(run, 0)
        ledger = zs.ledger()
        start = ledger.next_seq
        train_step(run, 1)
        out[tuple(sorted(keys.items()))] = {"by_key": _bytes_by_key(ledger.since(start)), "tp_size": mesh.tp_size,
                                            "dp_size": mesh.dp_size}
    zs.shutdown()
    return out

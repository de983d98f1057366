"""Workers for the expert-parallel tests: MoE models trained with experts split over ep ranks.

One world of 4 runs every case, each on a mesh of its own (``zs.new_mesh(ep=...)``, with tp=2
for the ep-with-tp cases), through
`zeroshard.trainer.step` (accumulation 2, clipping on). The single-process reference (`reference`) trains
the same model, built by the same function under the same seed, with plain PyTorch.
Module level so spawned ranks can import it.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zeroshard as zs
from zeroshard.trainer import step
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.data import GlobalBatchSampler, build_dataset, collate
from zeroshard.parallel.experts import ep_forwards
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime import get_engine
from zeroshard.trainer.train import global_micro_batches, reference_backward

SEED = 1234
VOCAB = 64
SEQ = 16
STEPS = 5
"""Steps of every suite case (each one a world-4 run and its reference); `zeroshard verify --ep 2` runs 20."""
FROZEN = "blocks.0.mlp.experts."
"""The frozen experts of the frozen case (fine-tuning with some experts fixed)."""


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "gpt" or "mixtral"
    stage: int
    mesh: str  # a key of MESHES
    freeze: bool = False
    accum: int = 2
    meta: bool = False  # built on the meta device: zs.shard replays the init, each rank drawing its experts
    router_aux: bool = False  # an HF config with output_router_logits: transformers' load-balancing loss
    seq: int = SEQ  # the samples' length (the models hold SEQ positions)


CASES = {
    "gpt-ep2-stage1": Case("gpt", 1, "ep2"),
    "gpt-ep2-stage2-frozen": Case("gpt", 2, "ep2", freeze=True),
    "gpt-ep2-stage3": Case("gpt", 3, "ep2"),
    "gpt-ep4-stage3-accum1": Case("gpt", 3, "ep4", accum=1),
    "mixtral-ep2-stage3": Case("mixtral", 3, "ep2"),
    "qwen2moe-ep2-stage1": Case("qwen2moe", 1, "ep2"),
    "gpt-ep2-stage3-meta": Case("gpt", 3, "ep2", meta=True),
    "mixtral-ep4-stage2-meta": Case("mixtral", 2, "ep4", meta=True),
    "mixtral-ep2-stage3-router-aux": Case("mixtral", 3, "ep2", router_aux=True),
    "qwen2moe-ep2-stage3-router-aux": Case("qwen2moe", 3, "ep2", router_aux=True),
    # ep with tp: the attention tensor parallel, the experts split over ep ranks borrowed from dp x tp
    "gpt-tp2ep2-stage1": Case("gpt", 1, "tp2ep2"),
    "gpt-tp2ep2-stage3": Case("gpt", 3, "tp2ep2"),
    "mixtral-tp2ep2-stage1": Case("mixtral", 1, "tp2ep2"),
    "mixtral-tp2ep2-stage3": Case("mixtral", 3, "tp2ep2"),
    "qwen2moe-tp2ep2-stage3": Case("qwen2moe", 3, "tp2ep2"),
    "gpt-tp2ep2-stage3-meta": Case("gpt", 3, "tp2ep2", meta=True),
    # 15 tokens per micro-batch: the tp ranks' runs are 8 and 7 tokens, the gather pads the short one
    "gpt-tp2ep4-stage3-uneven": Case("gpt", 3, "tp2ep4", accum=4, seq=15),
}
MESHES = {
    "ep2": dict(mesh_shape=(2, 2), names=("shard", "ep")),
    "ep4": dict(ep=4),
    "tp2ep2": dict(tp=2, ep=2),  # (shard 2 x tp 2); ep groups = the tp groups, edp 2
    "tp2ep4": dict(tp=2, ep=4),  # (shard 2 x tp 2); one ep group of the world, edp 1
}
"""The suite's meshes (``zs.new_mesh`` keywords) by name."""


def tp_of(case: Case) -> int:
    return MESHES[case.mesh].get("tp", 1)


def ep_of(case: Case) -> int:
    kwargs = MESHES[case.mesh]
    return kwargs.get("ep") or dict(zip(kwargs["names"], kwargs["mesh_shape"]))["ep"]
ROUTER_AUX_COEF = 0.05
"""router_aux_loss_coef of the router-aux case: large enough that its term shows in the losses."""


def train_config(case: Case) -> TrainConfig:
    return TrainConfig(stage=case.stage, nproc=4, tp=tp_of(case), batch=8, accum=case.accum, seq_len=case.seq,
                       vocab_size=VOCAB, lr=1e-3, min_lr=1e-3, warmup=0, weight_decay=0.1, clip=0.5, seed=SEED,
                       num_samples=256, profile=False)


def _hf_model(name: str, meta: bool = False, router_aux: bool = False):
    """A tiny transformers 5 MoE model, initialised as zeroshard's hf: models are (models/hf.py);
    ``meta``: left on meta but for its buffers (zs.shard then replays init_weights); ``router_aux``:
    its config asks for the routers' load-balancing loss, as an HF Trainer user sets it."""
    import transformers as tf

    from zeroshard.models.hf import HFSpec, init_weights

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=SEQ, vocab_size=VOCAB, tie_word_embeddings=True, use_cache=False,
                  attention_dropout=0.0, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  output_router_logits=router_aux, router_aux_loss_coef=ROUTER_AUX_COEF)
    if name == "mixtral":
        config = tf.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    else:  # Qwen2-MoE: a shared expert next to the routed ones, top-k weights not renormalised
        config = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                   num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **common)
        cls = tf.Qwen2MoeForCausalLM
    with torch.device("meta"):
        model = cls(config)
    model.cfg = HFSpec(f"test:{name}", config.to_dict())
    for module in model.modules():  # rotary inv_freq: real buffers, filled by init_weights
        for key, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                setattr(module, key, torch.empty(buf.shape, dtype=buf.dtype))
    if meta:
        return model
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model)
    return model


def build_model(case: Case, *, balance: bool = True) -> torch.nn.Module:
    """The case's model, seeded: bitwise the same on every rank and in the reference. ``balance=False``
    drops the load-balancing loss (tiny-moe's, or the HF config's; to show the parity checks see it)."""
    torch.manual_seed(SEED)
    if case.model == "gpt":
        extra = {} if balance else {"aux_loss_coef": 0.0}
        with torch.device("meta" if case.meta else "cpu"):
            model: torch.nn.Module = GPT(GPTConfig.named("tiny-moe", n_layer=2, vocab_size=VOCAB, seq_len=SEQ,
                                                         **extra))
    else:
        model = _hf_model(case.model, meta=case.meta, router_aux=case.router_aux and balance)
    if case.freeze:
        for name, param in model.named_parameters():
            if name.startswith(FROZEN):
                param.requires_grad_(False)
    return model.train()


def hidden_size(model: torch.nn.Module) -> int:
    return model.cfg.n_embd if isinstance(model, GPT) else model.config.hidden_size


def top_k(model: torch.nn.Module) -> int:
    return model.cfg.expert_top_k if isinstance(model, GPT) else model.config.num_experts_per_tok


def reference(case: Case, *, balance: bool = True, steps: int = STEPS) -> dict:
    """Plain single-process PyTorch over the whole global batch: the ground truth. tiny-moe's
    load-balancing loss is defined per micro-batch (a product of two batch means), so with
    accumulation its reference runs the distributed step's global micro-batches instead."""
    cfg = train_config(case)
    data = build_dataset(seq_len=cfg.seq_len, num_samples=cfg.num_samples, vocab_size=VOCAB, seed=SEED)
    model = build_model(dataclasses.replace(case, meta=False), balance=balance)  # a plain build
    opt = torch.optim.AdamW(zs.optim_groups(model, cfg.weight_decay), lr=cfg.lr, betas=step.BETAS)
    sampler = GlobalBatchSampler(len(data), cfg.batch, world=1, rank=0, seed=SEED)
    losses, norms = [], []
    for _ in range(steps):
        x, y = collate(data, sampler.next_indices())
        if case.router_aux and balance:
            loss = transformers_backward(model, x, y, dp=cfg.nproc // cfg.tp, accum=cfg.accum)
        else:
            loss = reference_backward(model, x, y, dp=cfg.nproc // cfg.tp, accum=cfg.accum)
        trainable = [p for p in model.parameters() if p.requires_grad]
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, cfg.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def transformers_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, dp: int,
                          accum: int) -> torch.Tensor:
    """One process's backward with transformers' own loss (mean CE + router_aux_loss_coef x
    load_balancing_loss_func), one forward per global micro-batch (the whole global batch at
    accumulation 1), each weighted by its share of the step's scored targets. Our batches carry
    shifted targets, which transformers takes as ``shift_labels``."""
    count, loss = (y != -100).sum(), torch.zeros(())
    for xm, ym in global_micro_batches(x, y, dp=dp, accum=accum):
        out = model(input_ids=xm, labels=ym, shift_labels=ym, use_cache=False)
        assert out.aux_loss is not None
        part = out.loss * ((ym != -100).sum() / count)
        part.backward()
        loss = loss + part.detach()
    return loss


def _expected_a2a_bytes(forwards: dict, marks: dict, hidden: int, elem: int) -> int:
    """What the routing counts recorded since ``marks`` say the ep all-to-alls moved: per layer
    call, the counts (one int64 per expert) plus rows sent and received, forward and backward."""
    total = 0
    for name, fwd in forwards.items():
        start = marks[name]
        for sent, received in zip(fwd.sent_rows[start:], fwd.received_rows[start:]):
            total += fwd.layer.num_experts * 8 + 2 * (sent + received) * hidden * elem
    return total


def _expected_tp_bytes(forwards: dict, marks: dict, tp: int, hidden: int, k: int, elem: int) -> int:
    """What the tp all-gathers of the MoE layers moved since ``marks`` (ep with tp): per layer call,
    forward the outputs (tp runs of ``hidden``), backward the input grads (``hidden``) and the
    routing weights' grads (``k``), each run padded to the call's run length."""
    return sum(tp * run * (2 * hidden + k) * elem for name, fwd in forwards.items()
               for run in fwd.tp_runs[marks[name]:])


class AllocationCounter(TorchDispatchMode):
    """Counts the host bytes of the storages allocated under it and still alive: their peak is what
    the code run under it held at once (views and in-place writes of existing storages add nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if func.is_view:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, storage.nbytes())
        return out

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


def count_init_allocations(model: torch.nn.Module) -> AllocationCounter:
    """Count what the model's init_weights (which zs.shard's meta replay runs) allocates."""
    counter, init = AllocationCounter(), model.init_weights

    def counted() -> None:
        with counter:
            init()

    object.__setattr__(model, "init_weights", counted)  # this instance only
    return counter


def run_case(case: Case, mesh) -> dict:
    cfg = train_config(case)
    data = build_dataset(seq_len=cfg.seq_len, num_samples=cfg.num_samples, vocab_size=VOCAB, seed=SEED)
    model = build_model(case)
    counter = count_init_allocations(model) if case.meta else None
    run = step.build(cfg, mesh, model=model, dataset=data)
    initial = zs.full_state_dict(run.model) if case.meta else None  # collective: every rank gathers
    forwards = ep_forwards(run.model)
    experts = mesh.experts
    ledger = zs.ledger()
    losses, norms, ledger_bytes, routed_bytes, router_aux, tp_bytes, tp_expected = [], [], [], [], [], [], []
    tp = mesh.tp_size
    for _ in range(STEPS):
        x, y = collate(run.dataset, run.sampler.next_indices())
        marks = {name: len(f.sent_rows) for name, f in forwards.items()}
        start = ledger.next_seq
        out = step.step(run, x, y)
        records = ledger.since(start)
        ledger_bytes.append(sum(r.bytes for r in records
                                if r.op == "all_to_all" and r.group == "ep" and r.mesh == experts.ledger_name))
        router_aux.append(sorted((r.op, r.group, r.numel, r.dtype, r.phase, r.mesh) for r in records
                                 if r.unit == "router_aux"))
        routed_bytes.append(_expected_a2a_bytes(forwards, marks, hidden_size(run.model), 4))
        tp_bytes.append(sum(r.bytes for r in records if r.op == "all_gather" and r.group == "tp" and
                            r.unit in forwards and r.mesh == mesh.ledger_name))
        tp_expected.append(_expected_tp_bytes(forwards, marks, tp, hidden_size(run.model), top_k(run.model), 4)
                           if tp > 1 else 0)
        totals = torch.stack([out.loss_sum, (y != -100).sum().double()])
        zs.comm.collectives.all_reduce(totals, op="sum", phase="metrics", mesh=mesh)
        losses.append(float(totals[0] / totals[1]))
        norms.append(out.grad_norm)
    # Under tp each token reaches its experts once per tp group: the tp ranks' dispatched rows add
    # up to the layer's tokens x top_k (every model here is dropless).
    dispatched = torch.tensor([float(sum(f.sent_rows)) for f in forwards.values()], dtype=torch.float64)
    if tp > 1:
        zs.comm.collectives.all_reduce(dispatched, group="tp", phase="metrics", mesh=mesh)
    engine = get_engine(run.model)
    expert_groups = [g for g in engine.groups if g.mesh is experts]
    layers = [f.layer for f in forwards.values()]
    frozen = [g for g in engine.groups if any(ref.fqn.startswith(FROZEN) for ref in g.refs)]
    optimized = {id(group) for _, group, _, _ in run.opt.zeroshard_state.segments.entries}
    result = {
        "losses": losses, "norms": norms, "ledger_a2a_bytes": ledger_bytes, "routed_a2a_bytes": routed_bytes,
        "router_aux_records": router_aux, "dense_ledger_name": mesh.ledger_name,
        "tp_ledger_bytes": tp_bytes, "tp_expected_bytes": tp_expected,
        "dispatched_rows_over_tp": dispatched.tolist(),
        "tokens_times_top_k": [float(sum(f.tokens) * top_k(run.model)) for f in forwards.values()],
        "params": zs.full_state_dict(run.model),  # collective: expert params gathered over ep too
        "received_from_others": sum(f.received_rows[-1] for f in forwards.values()),
        "expert_groups": len(expert_groups),
        "tp_split_params": sum(spec is not None and spec.shard_dim is not None for g in engine.groups
                               for spec in g.tp_specs),
        "expert_group_meshes": sorted({g.mesh.name for g in expert_groups}),
        # Bytes of one MoE layer's experts a rank holds in full while the layer runs (the flat
        # groups' full extent: stage 3's gathered buffer), to hold against all of the layer's experts.
        "expert_full_bytes_per_layer": sum(g.layout.param_numel for g in expert_groups) * 4 // len(layers),
        "frozen_trainable": [g.trainable for g in frozen],
        "frozen_in_optimizer": any(id(g) in optimized for g in frozen),
        "frozen_grads": any(p.grad is not None for g in frozen for p in (g.params or ())),
        "initial": initial,
        "init_stats": dict(engine.init_stats) if case.meta else None,
        "init_peak_allocated": counter.peak if counter is not None else None,
    }
    return result


FOLDER_STEPS = 3


def make_folder(root, layers: int = 2) -> str:
    """A random tiny Mixtral written by save_pretrained in >= 3 safetensors files (per-expert tensors)."""
    import transformers as tf

    config = tf.MixtralConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=32, vocab_size=96)
    torch.manual_seed(0)
    folder = f"{root}/mixtral"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="20KB")
    return folder


def folder_config(folder: str) -> TrainConfig:
    """What `zeroshard verify --model FOLDER --stage 3 --nproc 4 --ep 2 --steps 3` runs."""
    return TrainConfig(model=folder, stage=3, nproc=4, ep=2, batch=8, accum=2, seq_len=16, steps=FOLDER_STEPS,
                       warmup=1, num_samples=64, dropout=False, profile=False)


def run_folder(folder: str, mesh) -> dict:
    """The folder loaded at (shard 2, ep 2): its full tensors right after the load, 3 steps, then a
    live export of the trained model (rank 0 writes it)."""
    from zeroshard.trainer.train import train_step

    run = step.build(folder_config(folder), mesh)
    loaded = zs.full_state_dict(run.model)
    losses = [train_step(run, i).loss for i in range(FOLDER_STEPS)]
    exported = zs.export_pretrained(run.model, f"{folder}-trained", max_shard_size="20KB")
    return {"loaded": loaded, "losses": losses, "params": zs.full_state_dict(run.model),
            "exported": str(exported) if exported else None,
            "expert_groups": sum(g.mesh is mesh.experts for g in get_engine(run.model).groups)}


def suite(names: tuple[str, ...] = tuple(CASES), folder: str | None = None,
          families: dict[str, str] | None = None) -> dict:
    """The cases ``names`` (default all) on world 4, each on its mesh (MESHES): (shard 2 x ep 2), ep 4,
    or (shard 2 x tp 2) with ep 2 or ep 4;
    then, given ``folder``, a pretrained Mixtral folder loaded straight into split experts, and given
    ``families``, other MoE families' folders (moe_family_workloads) at (shard 2 x ep 2)."""
    import moe_family_workloads

    zs.init()
    meshes = {name: zs.new_mesh(**kwargs, name=name) for name, kwargs in MESHES.items()}
    described = {name: {"dense": m.describe(), "experts": m.experts.describe()} for name, m in meshes.items()}
    out = {name: run_case(CASES[name], meshes[CASES[name].mesh]) for name in names}
    loaded = run_folder(folder, meshes["ep2"]) if folder is not None else None
    others = moe_family_workloads.run_families(families, meshes["ep2"]) if families else {}
    return {"cases": out, "meshes": described, "folder": loaded, "families": others, "rank": zs.get_mesh().rank}

"""Workers for the context-parallel tests: world 4, sequences split over cp 2, against one process.

Module level so spawned ranks can import it; one process group runs every case, each on a mesh of
its own (``zs.new_mesh``), through `zeroshard train`'s own build and step.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.comm.dims import ParallelDims
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.train import setup, train_step

VOCAB = 96
SEQ = 32
BATCH = 4
STEPS = 4
"""The suite's steps (bench/context_parallel.py runs the 10-step matrix): the parity of every step is
already within the tolerances from the first."""
WORLD = 4
LAYOUTS = (("shard2", 2, 3), ("shard2", 2, 1), ("replicate2", 1, 3))
"""(name, shard size, stage) at cp 2, world 4: cp 2 x shard 2 at stages 3 and 1; cp 2 x replicate 2
at stage 3 (ZeRO over the two cp ranks of each replica: cp 2 on two ranks, twice), with 2
accumulation micro-steps (the token mean is over dp, cp and accumulation)."""
ACCUM = {"replicate2": 2}
CASES = [("gpt", "ring", LAYOUTS[0]), ("gpt", "ring", LAYOUTS[2]), ("gpt", "ulysses", LAYOUTS[0]),
         ("gpt", "ulysses", LAYOUTS[1])] + [("qwen3", scheme, LAYOUTS[0]) for scheme in ("ring", "ulysses")]
"""Each layout with one scheme at least (bench/context_parallel.py runs every pairing, 10 steps)."""
PP_CASES = [("gpt", "ring", ("pp2", None, 3)), ("gpt", "ulysses", ("pp2", None, 1))]
"""pp 2 x cp 2 at world 4: two pipeline stages, each sequence split over the cp ranks of a stage."""
PACK_CASES = [("gpt", scheme, ("packed", 2, 3)) for scheme in ("ring", "ulysses")]
"""cp 2 x shard 2, stage 3, on a token folder's documents packed into each row (doc_mask): the
attention stays inside each document across the split."""
EP_CASES = [("tiny-moe", "ulysses", ("ep2", 2, 3)), ("mixtral", "ring", ("ep2", 2, 1))]
"""ep 2 x cp 2 x shard 2: each cp rank routes its own tokens over its ep group; the routers'
load-balancing loss (the GPT's, the Mixtral config's) is the whole batch's."""
EP_LR = 2e-4
"""Top-k routing is discontinuous: at 5e-4 a near-tie in tiny-moe's routing flips after a few steps
under ring's blockwise softmax (rounding, not a fault); at this rate no tie is that close."""


def make_folder(root: Path) -> Path:
    """A small random Qwen3 (GQA: 4 heads, 2 kv heads; rotary positions) written by save_pretrained."""
    import transformers as tf

    config = tf.Qwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, max_position_embeddings=64, vocab_size=VOCAB)
    torch.manual_seed(0)
    out = root / "qwen3"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def make_moe_folder(root: Path) -> Path:
    """A small random Mixtral (4 experts, top 2; GQA, rotary) whose config asks for the routers'
    load-balancing loss, written by save_pretrained."""
    import transformers as tf

    config = tf.MixtralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=64, vocab_size=VOCAB, output_router_logits=True,
                              router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    out = root / "mixtral"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def make_tokens(root: Path) -> Path:
    """A token folder of documents of 3-13 tokens, each ended by EOS (id 0), as `data prepare` writes."""
    import json

    import numpy as np

    g = np.random.default_rng(0)
    tokens: list[int] = []
    while len(tokens) < 4000:
        tokens += [*g.integers(1, VOCAB, int(g.integers(3, 14))).tolist(), 0]
    out = root / "tokens"
    out.mkdir(parents=True, exist_ok=True)
    np.array(tokens, dtype="<u2").tofile(out / "train.bin")
    (out / "meta.json").write_text(json.dumps({"format": "zeroshard-tokens", "dtype": "uint16", "vocab_size": VOCAB,
                                               "eos_id": 0, "files": ["train.bin"]}))
    return out


def train_config(model: str, *, scheme: str = "ring", shard: int | None = None, stage: int = 3,
                 cp: int = 2, steps: int = STEPS, accum: int = 1, pp: int = 1, data: str | None = None) -> TrainConfig:
    return TrainConfig(model=model, stage=stage, nproc=WORLD, cp=cp, cp_attention=scheme, shard_size=shard, accum=accum,
                       batch=BATCH, seq_len=SEQ, steps=steps, warmup=1, num_samples=64, dropout=False, profile=False,
                       lr=5e-4, clip=1.0, pp=pp, data=data, doc_mask=data is not None)


def case_config(name: str, scheme: str, layout: tuple, folder: str) -> TrainConfig:
    """The config of one case of CASES, PP_CASES or PACK_CASES."""
    kind, shard, stage = layout
    model = model_name(name, folder)
    if kind == "pp2":
        return train_config(model, scheme=scheme, stage=stage, pp=2)
    if kind == "ep2":
        return train_config(model, scheme=scheme, shard=shard, stage=stage).replace(ep=2, lr=EP_LR)
    data = str(Path(folder).parent / "tokens") if kind == "packed" else None
    return train_config(model, scheme=scheme, shard=shard, stage=stage, accum=ACCUM.get(kind, 1), data=data)


def case_dims(layout: tuple) -> ParallelDims:
    kind, shard, _ = layout
    if kind == "pp2":
        return ParallelDims.of(WORLD, pp=2, cp=2)
    return ParallelDims.of(WORLD, shard=shard, cp=2, ep=2 if kind == "ep2" else 1)


def model_name(name: str, folder: str) -> str:
    """The model of a case: a preset, or a folder next to the Qwen3 one (``folder``)."""
    if name in ("qwen3", "mixtral"):
        return str(Path(folder).parent / name)
    return "tiny" if name == "gpt" else name


def resume_across_cp(root: str) -> dict:
    """Five steps at cp 2 x shard 2 (stage 3), saved; loaded into cp 1 over the 4 ranks (stage 3,
    ZeRO over all four) and five more steps there: cp holds no params, so the state carries over."""
    from zeroshard.checkpoint import load, save

    cfg = train_config("tiny", shard=2, stage=3)
    run = setup(cfg, zs.new_mesh(dims=ParallelDims.of(WORLD, shard=2, cp=2), name="cp-save"))
    for step in range(STEPS // 2):
        train_step(run, step)
    path = save(Path(root) / "cp2", run.model, run.opt, run.scheduler, run.sampler, step=STEPS // 2)
    again = setup(train_config("tiny", stage=3, cp=1), zs.get_mesh())  # the default mesh: cp 1, shard 4
    load(path, again.model, again.opt, scheduler=again.scheduler, sampler=again.sampler)
    losses = [train_step(again, step).loss for step in range(STEPS // 2, STEPS)]
    state = zs.full_state_dict(again.model)
    return {"losses": losses, "params": {k: v.detach().float().clone() for k, v in state.items()}}


def schedule_cp(run, scheme: str) -> list[tuple[str, str, str, int]]:
    """The cp events (op, phase, unit, bytes) the runtime's step schedule lists for one step of ``run``,
    sized from the model's widths (zeroshard/parallel/cp/volume.py ``schedule_sizes``)."""
    from zeroshard.parallel.cp.volume import schedule_sizes
    from zeroshard.runtime import get_engine
    from zeroshard.runtime.schedule import engine_schedule

    cfg, model = run.cfg, run.model
    if hasattr(run.model_cfg, "n_layer"):  # zeroshard's GPT
        blocks, width, kv = run.model_cfg.n_layer, run.model_cfg.n_embd, run.model_cfg.n_embd
    else:
        c = model.config
        head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        blocks, width, kv = c.num_hidden_layers, c.num_attention_heads * head, c.num_key_value_heads * head
    sizes = schedule_sizes(scheme, blocks=blocks, dtype=torch.float32, cp=2, rows=cfg.batch // run.mesh.dp_size // cfg.accum,
                           seq=SEQ, q_width=width, kv_width=kv)
    events = engine_schedule(get_engine(model), accum=cfg.accum, clip=cfg.clip > 0, cp=sizes).collectives
    return [(e.op, e.phase, e.unit, e.bytes) for e in events if e.group == "cp"]


def suite(folder: str) -> dict:
    zs.init()
    out: dict = {"cases": {}, "resumed": resume_across_cp(folder)}
    for index, (name, scheme, (layout, shard, stage)) in enumerate(CASES + PP_CASES + PACK_CASES + EP_CASES):
        cfg = case_config(name, scheme, (layout, shard, stage), folder)
        mesh = zs.new_mesh(dims=case_dims((layout, shard, stage)), name=f"cp{index}")
        run = setup(cfg, mesh)
        losses, cp_bytes = [], []
        for step in range(cfg.steps):
            seq = mesh.ledger.next_seq
            losses.append(train_step(run, step).loss)
            cp = [(r.op, r.phase, r.unit, r.bytes) for r in mesh.ledger.since(seq) if r.group == "cp" and r.mesh == mesh.name]
            cp_bytes.append(sum(r[-1] for r in cp))
        state = run.pipeline.full_state_dict() if run.pipeline is not None else zs.full_state_dict(run.model)
        out["cases"][(name, scheme, layout, stage)] = {
            "losses": losses, "cp_bytes": cp_bytes, "ledger_cp": cp,
            "schedule_cp": schedule_cp(run, scheme) if run.pipeline is None else [],
            "params": {k: v.detach().float().clone() for k, v in state.items()},
            "mesh": mesh.describe(), "groups": {"cp": mesh.group_size("cp"), "shard": mesh.shard_size,
                                                "dp": mesh.group_size("dp"), "batch_dp": mesh.dp_size}}
    return out

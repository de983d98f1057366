"""Context parallelism's heavier checks, on gloo at world 4, printed as figures.

    PYTHONPATH=$PWD .venv/bin/python bench/context_parallel.py [--seqs 256,512,1024,2048] [--budget-mib 256]

1. Parity against one process on whole sequences (10 steps, fp32), each scheme: cp 2 x shard 2
   (stages 3 and 1) on the GPT and (stage 3) a Qwen3 folder, cp 4 (stage 3),
   tp 2 x cp 2 (stage 3) on zeroshard's GPT; a Mistral folder with a sliding window of 8 tokens
   (cp 2 x shard 2, stage 3); pp 2 x cp 2 (stages 3 and 1) on the GPT and a Qwen3 folder; ep 2 x
   cp 2 x shard 2 (stage 3) on tiny-moe and a Mixtral folder with the routers' aux loss (lr 2e-4:
   see tests/distributed/cp_workloads.py EP_LR); packed documents (doc_mask) at cp 2 x shard 2 on
   the GPT and the Qwen3 folder. Max abs param diff (tolerance 1e-5) and loss diff (1e-6).
2. Per-rank activation bytes (the storages autograd saves in one forward, params excluded) of
   ``small`` at seq 1024 and one sequence per dp group, at cp 1, 2 and 4, against the planner.
3. The longest sequence of ``small`` whose per-rank saved activations fit ``--budget-mib``, at
   cp 1 and cp 4 (one sequence per dp group), and their ratio.

Timings are not measured: the figures are bytes and differences, valid on a loaded machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import zeroshard as zs
from zeroshard.comm.dims import ParallelDims
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.launch import spawn
from zeroshard.trainer.train import reference_train, setup, train_step

WORLD, SEQ, BATCH, STEPS, VOCAB = 4, 32, 4, 10, 96
SCHEMES = ("ring", "ulysses")
PARITY = [("tiny", scheme, dict(cp=2, shard=2), stage) for scheme in SCHEMES for stage in (3, 1)] + \
         [("qwen3", scheme, dict(cp=2, shard=2), 3) for scheme in SCHEMES] + \
         [("tiny", scheme, dict(cp=4), 3) for scheme in SCHEMES] + \
         [("tiny", scheme, dict(cp=2, tp=2), 3) for scheme in SCHEMES] + \
         [("mistral", scheme, dict(cp=2, shard=2), 3) for scheme in SCHEMES] + \
         [(name, scheme, dict(cp=2, pp=2), stage) for name in ("tiny", "qwen3") for scheme in SCHEMES
          for stage in (3, 1)] + \
         [(name, scheme, dict(cp=2, shard=2, ep=2), 3) for name in ("tiny-moe", "mixtral") for scheme in SCHEMES] + \
         [(name, scheme, dict(cp=2, shard=2, packed=1), 3) for name in ("tiny", "qwen3") for scheme in SCHEMES]
FOLDERS = ("mistral", "qwen3", "mixtral")
EP_LR = 2e-4


def make_folders(root: Path) -> None:
    """Random small HF folders (GQA, rotary): a Mistral with a sliding window of 8, a Qwen3, and a
    Mixtral (4 experts, top 2) asking for its routers' aux loss; and a token folder of documents."""
    import numpy as np
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, vocab_size=VOCAB)
    configs = {"mistral": tf.MistralConfig(head_dim=8, intermediate_size=64, sliding_window=8, **small),
               "qwen3": tf.Qwen3Config(head_dim=8, intermediate_size=64, **small),
               "mixtral": tf.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                           output_router_logits=True, router_aux_loss_coef=0.02, **small)}
    for name, config in configs.items():
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    g = np.random.default_rng(0)
    tokens: list[int] = []
    while len(tokens) < 4000:
        tokens += [*g.integers(1, VOCAB, int(g.integers(3, 14))).tolist(), 0]  # EOS 0 ends each document
    (root / "tokens").mkdir()
    np.array(tokens, dtype="<u2").tofile(root / "tokens" / "train.bin")
    (root / "tokens" / "meta.json").write_text(json.dumps({"format": "zeroshard-tokens", "dtype": "uint16",
                                                           "vocab_size": VOCAB, "eos_id": 0, "files": ["train.bin"]}))


def parity_config(root: str, name: str, scheme: str, layout: dict, stage: int) -> TrainConfig:
    model = str(Path(root) / name) if name in FOLDERS else name
    packed = bool(layout.get("packed"))
    return TrainConfig(model=model, stage=stage, nproc=WORLD, cp=layout["cp"], tp=layout.get("tp", 1),
                       pp=layout.get("pp", 1), ep=layout.get("ep", 1), shard_size=layout.get("shard"),
                       cp_attention=scheme, batch=BATCH, seq_len=SEQ, steps=STEPS, warmup=1, num_samples=64,
                       dropout=False, profile=False, lr=EP_LR if layout.get("ep") else 5e-4, clip=1.0,
                       data=str(Path(root) / "tokens") if packed else None, doc_mask=packed)


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Unique storages autograd saves in one forward of the loss, params excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum, _ = model.loss_sum(x, x)  # type: ignore[operator]
    loss_sum.backward()
    return sum(seen.values())


_MESHES = itertools.count()


def activation_bytes(cp: int, seq: int) -> int:
    """Rank 0's saved activations of one sequence per dp group of ``small`` at ``seq``, split over cp."""
    from zeroshard.parallel.cp import apply_context_parallel
    from zeroshard.models import GPT, GPTConfig

    mesh = zs.new_mesh(dims=ParallelDims.of(WORLD, cp=cp), name=f"mem{next(_MESHES)}")
    torch.manual_seed(0)
    model = GPT(GPTConfig.named("small", seq_len=seq))
    cpx = apply_context_parallel(model, mesh, "ring")
    zs.shard(model, stage=0, mesh=mesh)  # params stay put: their storages are told apart from activations
    x = torch.randint(0, model.cfg.vocab_size, (1, seq))
    x = x if cpx is None else cpx.split(x)
    return _saved_bytes(model, x)


def chosen(match: str) -> list[tuple[int, tuple]]:
    """The parity cases whose description contains ``match`` (all for "")."""
    return [(i, case) for i, case in enumerate(PARITY) if match in describe(*case)]


def describe(name: str, scheme: str, layout: dict, stage: int) -> str:
    what = " x ".join(f"{k} {v}" for k, v in layout.items() if k != "packed") + (" packed" if layout.get("packed") else "")
    return f"{name:8s} {scheme:8s} {what:22s} stage {stage}"


def worker(folder: str, seqs: list[int], budget: int, parity: bool, match: str, memory: bool) -> dict:
    zs.init()
    out: dict = {"parity": {}, "memory": {}, "longest": {}}
    for index, (name, scheme, layout, stage) in chosen(match) if parity else []:
        cfg = parity_config(folder, name, scheme, layout, stage)
        dims = ParallelDims.of(WORLD, cp=layout["cp"], tp=layout.get("tp", 1), shard=layout.get("shard"),
                               pp=layout.get("pp", 1), ep=layout.get("ep", 1))
        run = setup(cfg, zs.new_mesh(dims=dims, name=f"parity{index}"))
        losses = [train_step(run, step).loss for step in range(STEPS)]
        state = run.pipeline.full_state_dict() if run.pipeline is not None else zs.full_state_dict(run.model)
        out["parity"][index] = {"losses": losses, "params": {k: v.detach().float() for k, v in state.items()}}
    if not memory:
        return out
    for cp in (1, 2, 4):
        out["memory"][cp] = activation_bytes(cp, 1024)
    for cp in (1, 4):
        best = 0
        for seq in seqs:
            got = activation_bytes(cp, seq)
            if got > budget:
                break
            best = seq
        out["longest"][cp] = best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="256,512,1024,2048", help="sequence lengths to try, ascending")
    parser.add_argument("--budget-mib", type=int, default=256, help="per-rank saved-activation budget")
    parser.add_argument("--skip-parity", action="store_true", help="only the memory figures (2 and 3)")
    parser.add_argument("--match", default="", help="only the parity cases whose line contains this (e.g. 'pp 2')")
    parser.add_argument("--skip-memory", action="store_true", help="only the parity figures (1)")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        make_folders(Path(tmp))
        folder = tmp
        got = spawn(worker, WORLD, args=(folder, seqs, args.budget_mib * 2**20, not args.skip_parity, args.match,
                                         not args.skip_memory), timeout_s=3000)[0]
        print("1. parity against one process on whole sequences, 10 steps, fp32 (tolerances 1e-5 / 1e-6)")
        refs: dict = {}
        for index, (name, scheme, layout, stage) in chosen(args.match) if not args.skip_parity else []:
            key = (name, tuple(sorted(layout.items())))
            if key not in refs:
                refs[key] = reference_train(parity_config(folder, name, scheme, layout, stage))
            ref, run = refs[key], got["parity"][index]
            dp = max((run["params"][k] - ref["params"][k].float()).abs().max().item() for k in ref["params"])
            dl = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
            print(f"   {describe(name, scheme, layout, stage)}: |param diff| {dp:.2e}  |loss diff| {dl:.2e}  "
                  f"{'ok' if dp <= 1e-5 and dl <= 1e-6 else 'OVER'}")
    if args.skip_memory:
        return
    from zeroshard.tools.planner.api import plan

    print("2. per-rank saved activations, small, seq 1024, one sequence per dp group (rank 0), vs the planner")
    for cp in (1, 2, 4):
        planned = plan("small", world=WORLD, cp=cp, seq=1024, batch=WORLD // cp, mp="fp32", device="cpu").activations
        assert planned is not None
        measured = got["memory"][cp]
        print(f"   cp {cp}: measured {measured / 2**20:8.1f} MiB, planned {planned.saved / 2**20:8.1f} MiB "
              f"({(measured - planned.saved) / planned.saved:+.1%}), vs cp 1 {measured / got['memory'][1]:.2f}")
    longest = got["longest"]
    ratio = longest[4] / longest[1] if longest[1] else float("inf")
    print(f"3. longest seq of small within {args.budget_mib} MiB saved activations per rank (tried {args.seqs}): "
          f"cp 1 {longest[1]}, cp 4 {longest[4]}, ratio {ratio:.1f}")


if __name__ == "__main__":
    main()

"""Workers for the pretrained-folder tests: folders written by transformers' own save_pretrained,
loaded straight into shards at every stage, trained, and exported back.

Module level so spawned ranks can import it; one process group runs every case.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

import shutil
from pathlib import Path

import torch

import zeroshard as zs
from zeroshard.checkpoint.hf import PretrainedError, build_pretrained, export_checkpoint, export_pretrained, load_pretrained
from zeroshard.trainer.adapter import loss_sum

SEED = 7
VOCAB = 256
SEQ = 16
STEPS = 3
SHARD_BYTES = "48KB"  # small enough that both tiny models span >= 3 safetensors files


def make_folders(root: Path) -> dict[str, Path]:
    """A random tiny Llama (fp32, untied) and Qwen2 (bf16, tied embeddings), written by transformers."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(SEED)
    llama = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(tie_word_embeddings=False, **common))
    qwen = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(tie_word_embeddings=True, **common))
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero; give them values worth checking
        for name, p in qwen.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    qwen = qwen.to(torch.bfloat16)
    out = {"llama": root / "llama", "qwen2": root / "qwen2"}
    llama.save_pretrained(out["llama"], max_shard_size=SHARD_BYTES)
    qwen.save_pretrained(out["qwen2"], max_shard_size=SHARD_BYTES)
    return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loaded(path: Path, stage: int):
    model = build_pretrained(path)
    zs.shard(model, stage=stage, skip_init=True)
    stats = load_pretrained(model, path)
    return model, stats


def _train(model) -> None:
    """STEPS AdamW steps, each rank on its half of a fixed batch."""
    mesh = zs.get_mesh()
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(mesh.world)[mesh.rank], y.chunk(mesh.world)[mesh.rank]
        total, count = loss_sum(model, x, y)
        (total / count).backward()
        opt.step()
        opt.zero_grad()


def _bad_input(root: Path, good: Path) -> dict:
    """Broken folders: each load must fail with one line naming the file or tensor, loading nothing."""
    import json

    rank = zs.get_mesh().rank
    cases = {}
    for kind in ("missing_file", "wrong_shape", "unknown_arch"):
        bad = root / f"bad-{kind}"
        if rank == 0:
            shutil.copytree(good, bad)
            if kind == "missing_file":
                sorted(bad.glob("model-*.safetensors"))[1].unlink()
            elif kind == "wrong_shape":
                cfg = json.loads((bad / "config.json").read_text())
                cfg["intermediate_size"] = 192
                (bad / "config.json").write_text(json.dumps(cfg))
            else:
                cfg = json.loads((bad / "config.json").read_text())
                cfg["model_type"] = "no-such-architecture"
                (bad / "config.json").write_text(json.dumps(cfg))
        zs.comm.collectives.barrier(phase="test")
        try:
            model = build_pretrained(bad)
            zs.shard(model, stage=3, skip_init=True)
            load_pretrained(model, bad)
            cases[kind] = {"error": None}
        except PretrainedError as e:
            untouched = all(float(g.shard.abs().sum()) == 0 for g in zs.runtime.get_engine(model).groups) \
                if kind != "unknown_arch" else True
            cases[kind] = {"error": str(e), "untouched": untouched}
    return cases


def suite(folders: dict[str, str], root: str) -> dict:
    """Every case in one process group; rank 0's answers are compared in the test."""
    zs.init()
    mesh = zs.get_mesh()
    out: dict = {"loads": {}, "trained": {}}
    for name, path in folders.items():
        for stage in (0, 1, 2, 3):
            model, stats = _loaded(Path(path), stage)
            x, _ = batch(99)
            out["loads"][(name, stage)] = {"state": zs.full_state_dict(model), "bytes_read": stats["bytes_read"],
                                           "bytes_held": stats["bytes_held"],
                                           "logits": model(input_ids=x).logits.detach(),
                                           "buffers": {k: b.clone() for k, b in model.named_buffers()}}
        model, _ = _loaded(Path(path), 3)
        _train(model)
        live, ckpt, offline = (Path(root) / f"{name}-{kind}" for kind in ("live", "ckpt", "offline"))
        export_pretrained(model, live, max_shard_size=SHARD_BYTES)
        zs.save(ckpt, model)
        if mesh.rank == 0:
            export_checkpoint(ckpt, offline, max_shard_size=SHARD_BYTES)
        x, _ = batch(99)
        out["trained"][name] = {"logits": model(input_ids=x).logits.detach(), "live": str(live),
                                "ckpt": str(ckpt), "offline": str(offline)}
    out["bad"] = _bad_input(Path(root), Path(folders["llama"]))
    out["world"] = mesh.world
    return out


def stage3_loads(folders: dict[str, str]) -> dict:
    """Stage 3 loads only (for world 4): the state and what this rank read."""
    zs.init()
    out = {}
    for name, path in folders.items():
        model, stats = _loaded(Path(path), 3)
        out[name] = {"state": zs.full_state_dict(model), **stats}
    return out

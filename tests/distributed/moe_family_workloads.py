"""Workers for tests/distributed/test_expert_parallel.py's MoE families zeroshard has no line of code for
(OLMoE, DeepSeek-V3, GPT-OSS), each a random save_pretrained folder (scripts/moe_matrix.py builds
it: >= 3 shards, 4 blocks, 4 experts, top 2), trained as `zeroshard verify --model DIR --nproc 4
--stage 3 --ep 2` trains it: the trainer's own build and step on a (shard 2 x ep 2) mesh.

Module level so spawned ranks can import it; ep_workloads.suite runs them in its process group.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import moe_matrix  # noqa: E402

import zeroshard as zs  # noqa: E402
from zeroshard.parallel.experts import ep_forwards  # noqa: E402
from zeroshard.trainer import step  # noqa: E402
from zeroshard.trainer.config import TrainConfig  # noqa: E402

STEPS = 3
FAMILIES = {
    "olmoe": {},  # softmax routing, top-k weights not renormalised
    "deepseek_v3": {},  # sigmoid grouped top-k with the correction bias, a shared expert, block 0 dense
    # expert biases, a clamped interleaved gate, transposed weights; its routers' load-balancing loss on
    "gpt_oss": {"output_router_logits": True, "router_aux_loss_coef": 0.05},
}


def make_folders(root: Path) -> dict[str, str]:
    return {name: str(moe_matrix.make_folder(name, root, **extra)) for name, extra in FAMILIES.items()}


def train_config(folder: str) -> TrainConfig:
    """What `zeroshard verify --model FOLDER --nproc 4 --stage 3 --ep 2 --steps 3` runs (smaller data)."""
    return TrainConfig(model=folder, stage=3, nproc=4, ep=2, batch=8, seq_len=16, steps=STEPS, warmup=1,
                       num_samples=64, dropout=False, profile=False)


def run_families(folders: dict[str, str], mesh) -> dict:
    """Each folder on ``mesh`` (shard 2 x ep 2): its losses, full params, and the rows its layers routed."""
    from zeroshard.trainer.train import train_step

    out = {}
    for name, folder in folders.items():
        run = step.build(train_config(folder), mesh)
        losses = [train_step(run, i).loss for i in range(STEPS)]
        forwards = ep_forwards(run.model)
        out[name] = {"losses": losses, "params": zs.full_state_dict(run.model),
                     "layers": sorted(forwards), "sent": sum(sum(f.sent_rows) for f in forwards.values()),
                     "received": sum(sum(f.received_rows) for f in forwards.values())}
    return out

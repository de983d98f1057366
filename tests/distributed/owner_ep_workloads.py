"""Workers for per-tensor owners beside expert parallelism: tiny-moe at ep 2 x shard 2 (world 4),
the Muon recipe (Muon on the attention's matrices, AdamW on the rest, the stacked experts among
them), with torch's Muon orthogonalising in fp32 so the routing sees the same values as one process."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from owner_workloads import fp32_newton_schulz
from torch import nn

from zeroshard.runtime.recipes import muon_groups
from zeroshard.trainer import optimizers
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.train import reference_train, verify_worker


def config(nproc: int, stage: int) -> TrainConfig:
    return TrainConfig(model="tiny-moe", nproc=nproc, ep=2 if nproc > 1 else 1, stage=stage, optimizer="muon",
                       steps=4, batch=8, seq_len=16, clip=1.0, num_samples=128)


def worker(stage: int) -> dict:
    with fp32_newton_schulz():
        return verify_worker(config(4, stage))


def reference() -> dict:
    with fp32_newton_schulz():
        return reference_train(config(1, 0))


# -- Muon on the stacked expert matrices too: each expert's matrix its own unit ----------------------

EXPERT_MATRICES = ("experts.fc_weight", "experts.proj_weight")


class ExpertMuon(torch.optim.Muon):
    """torch's Muon over one process's model, each (E, out, in) stacked expert param stepped as E
    separate matrices (params viewing it), as if the experts were separate modules."""

    def __init__(self, params, **options) -> None:
        self.stacked: list[tuple[nn.Parameter, list[nn.Parameter]]] = []
        groups = []
        for group in params:
            members = []
            for p in group["params"]:
                if p.dim() == 3:  # views sharing the stack's storage: Muon's in-place update lands in it
                    views = [nn.Parameter(p.data[e]) for e in range(p.shape[0])]
                    self.stacked.append((p, views))
                    members.extend(views)
                else:
                    members.append(p)
            groups.append({**group, "params": members})
        super().__init__(groups, **options)

    def step(self, closure=None):
        for stack, views in self.stacked:
            for e, view in enumerate(views):
                view.grad = None if stack.grad is None else stack.grad[e]
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for stack, _ in self.stacked:
            stack.grad = None


def _groups_with_experts(muon_cls):
    def groups(model, **kw):
        out = muon_groups(model, **kw)
        stacked = [n for n, _ in model.named_parameters() if n.endswith(EXPERT_MATRICES)]
        for group in out:
            group["params"] = [n for n in group["params"] if n not in stacked]
        out[0]["params"] += stacked
        out[0]["optimizer"] = muon_cls
        return [g for g in out if g["params"]]
    return groups


@contextlib.contextmanager
def muon_on_experts(muon_cls):
    """The run's Muon recipe with the stacked expert matrices in the Muon group too."""
    with mock.patch.object(optimizers, "muon_groups", _groups_with_experts(muon_cls)), fp32_newton_schulz():
        yield


def worker_experts(stage: int) -> dict:
    with muon_on_experts(torch.optim.Muon):
        return verify_worker(config(4, stage))


def reference_experts() -> dict:
    with muon_on_experts(ExpertMuon):
        return reference_train(config(1, 0))

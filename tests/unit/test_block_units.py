"""Units found in a model whose blocks are a ModuleList of one: the block is the unit, never the
list. A container is never called, so a unit made of it would never gather its params: a one-block
GPT at stage 3 once failed its first forward ("mat2 must be a matrix") with its blocks' ModuleList
chosen as a unit."""

from __future__ import annotations

import pytest
import torch

import zeroshard as zs
from zeroshard.models import GPT, GPTConfig
from zeroshard.runtime.wrap import find_blocks

CFG = GPTConfig.named("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=64, seq_len=8)


@pytest.fixture(scope="module", autouse=True)
def _world():
    zs.init()
    yield
    zs.shutdown()


def test_a_one_block_list_gives_its_block_as_the_unit():
    names = [name for name, _ in find_blocks(GPT(CFG))]
    assert "blocks.0" in names and "blocks" not in names


def _train(stage: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = zs.shard(GPT(CFG), stage=stage)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for i in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(i))
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, zs.full_state_dict(model)


def test_a_one_block_gpt_trains_at_stage_3_bitwise_as_stage_0():
    losses0, params0 = _train(0)
    losses3, params3 = _train(3)
    assert losses3 == losses0
    assert params3.keys() == params0.keys()
    assert all(torch.equal(params3[k], params0[k]) for k in params0)

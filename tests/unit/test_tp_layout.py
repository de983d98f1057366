"""Tensor-parallel layouts without a process group: part cutting/joining and mesh-shape parsing."""

from __future__ import annotations

import pytest
import torch

from zeroshard.comm.dims import ParallelDims  # parses zs.init(mesh_shape=...)
from zeroshard.runtime.tp import canonical, to_local


@pytest.mark.parametrize("dim,chunks", [(0, 1), (0, 3), (1, 1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parts_join_back_to_the_full_tensor(dim, chunks, tp):
    full = torch.arange(24 * 8, dtype=torch.float32).view(24, 8)
    placement = {"dim": dim, "chunks": chunks, "tp": tp}
    parts = [to_local(full, placement, r) for r in range(tp)]
    assert all(p.shape[dim] == full.shape[dim] // tp for p in parts)
    assert torch.equal(canonical(parts, placement), full)


def test_fused_chunks_give_each_rank_its_own_part_of_every_block():
    q, k, v = (torch.full((4, 2), float(i)) for i in range(3))
    part = to_local(torch.cat([q, k, v]), {"dim": 0, "chunks": 3, "tp": 2}, 1)
    assert part[:, 0].tolist() == [0, 0, 1, 1, 2, 2]  # rows 2-3 of q, of k and of v


def _from_mesh_shape(shape, names, world):
    dims = ParallelDims.from_shape(shape, names, world)
    return dims.shard, dims.tp


def test_mesh_shape_parsing():
    assert _from_mesh_shape((2, 2), ("shard", "tp"), 4) == (2, 2)
    assert _from_mesh_shape((2, 2, 2), ("replicate", "shard", "tp"), 8) == (2, 2)
    assert _from_mesh_shape((4,), ("tp",), 4) == (1, 4)
    with pytest.raises(ValueError, match="covers 6 ranks but the world has 4"):
        _from_mesh_shape((2, 3), ("shard", "tp"), 4)
    with pytest.raises(ValueError, match="in that order"):
        _from_mesh_shape((2, 2), ("tp", "shard"), 4)


def test_placement_by_name_matches_the_runtime_plans():
    from zeroshard.models.specs import named_tp_plan
    from zeroshard.runtime.tp_plan import placement_of

    def placement_by_name(plan: str, fqn: str, ndim: int, tp: int) -> dict | None:
        return placement_of(named_tp_plan(plan), fqn, ndim, tp)

    assert placement_by_name("gpt", "blocks.3.attn.qkv.bias", 1, 2) == {"placement": "shard", "dim": 0, "chunks": 3,
                                                                         "tp": 2}
    assert placement_by_name("gpt", "blocks.0.mlp.proj.weight", 2, 2)["dim"] == 1  # type: ignore[index]
    assert placement_by_name("gpt", "blocks.0.mlp.proj.bias", 1, 2) is None  # row-wise bias: replicated
    assert placement_by_name("gpt", "blocks.0.ln1.weight", 1, 2) is None
    assert placement_by_name("llama", "model.layers.1.self_attn.k_proj.weight", 2, 2)["dim"] == 0  # type: ignore[index]
    assert placement_by_name("llama", "lm_head.weight", 2, 2) is None
    # Derived from the config like any other: Phi-3's fused projections are gathered whole (no reorder).
    assert placement_by_name("phi3", "model.layers.0.self_attn.qkv_proj.weight", 2, 2) == \
        {"placement": "shard", "dim": 0, "chunks": 1, "tp": 2}
    with pytest.raises(ValueError, match="unknown tensor-parallel plan 'bert'; use one of gpt, llama"):
        placement_by_name("bert", "x", 1, 2)
    with pytest.raises(ValueError, match="unknown tensor-parallel plan 'gpt2'"):  # GPT-2 declares none
        placement_by_name("gpt2", "x", 1, 2)


def test_cli_reshard_of_a_checkpoint_without_tp_to_tp2_and_back(tmp_path, capsys):
    """A checkpoint saved without TP has no placements: ``--tp 2`` needs ``--tp-plan``; with it the
    parts are cut by the plan, and going back to (1, 1) gives the saved tensors exactly."""
    import json

    from safetensors.torch import load_file

    import zeroshard as zs
    from zeroshard.checkpoint.export import export
    from zeroshard.cli.main import main
    from zeroshard.models import GPT, GPTConfig

    zs.init()
    try:
        torch.manual_seed(0)
        model = zs.shard(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, seq_len=8)), stage=1)
        opt = zs.optimizer(model, torch.optim.AdamW, lr=1e-3)
        zs.save(tmp_path / "ck", model, opt, step=0)
    finally:
        zs.shutdown()
    ck, tp2, back = tmp_path / "ck", tmp_path / "tp2", tmp_path / "back"
    assert main(["ckpt", "reshard", str(ck), str(tp2), "-w", "2", "--tp", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "saved without tensor parallelism" in err and "--tp-plan gpt or llama" in err and "\n" not in err
    assert main(["ckpt", "reshard", str(ck), str(tp2), "-w", "2", "--tp", "2", "--tp-plan", "gpt"]) == 0
    parts = {p["fqn"]: p["tp"] for p in json.loads((tp2 / "manifest.json").read_text())["params"] if "tp" in p}
    assert parts["blocks.0.attn.qkv.weight#tp1"]["chunks"] == 3 and parts["blocks.0.mlp.proj.weight#tp0"]["dim"] == 1
    assert main(["ckpt", "reshard", str(tp2), str(back), "-w", "1"]) == 0
    export(ck, tmp_path / "a.safetensors")
    export(back, tmp_path / "b.safetensors")
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_tensor_parallel_takes_a_meta_model_and_refuses_an_already_sharded_one():
    """A meta model passes TP's order check (zs.shard materialises its tp parts); a model zs.shard
    already built by constructor replay, or a build function returning a TP model, is refused with
    the order that works."""
    import zeroshard as zs
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from zeroshard.models import GPT, GPTConfig

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, seq_len=8)
    zs.init()
    try:
        with zs.meta_init():
            meta = GPT(cfg)
        with pytest.raises(ValueError, match="the mesh has no tp dim"):  # past the order check: world 1 has no tp
            zs.tensor_parallel(meta)
        sharded = zs.shard(lambda: GPT(cfg), stage=3)
        with pytest.raises(ValueError, match=r"already sharded .* zs.meta_init\(\), call zs.tensor_parallel\(model\), "
                                             r"then zs.shard\(model\)$"):
            zs.tensor_parallel(sharded)

        def tp_build():
            model = GPT(cfg)
            fc = model.blocks[0].mlp.fc
            fc.weight = torch.nn.Parameter(distribute_tensor(fc.weight.detach(), init_device_mesh("cpu", (1,)), [Replicate()]))
            return model

        with pytest.raises(ValueError, match=r"returned a tensor-parallel model; build it under zs.meta_init\(\)"):
            zs.shard(tp_build, stage=3)
    finally:
        zs.shutdown()

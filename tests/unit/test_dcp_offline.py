"""DCP import/export without a process group (``dcp.save``/``dcp.load`` with ``no_dist=True``): the
state-dict layouts FSDP2 users write, buffers, atomic output and one-line errors. The FSDP2 run
itself is tests/distributed/test_dcp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import zeroshard as zs
from zeroshard.checkpoint import CheckpointError
from zeroshard.cli.main import main as cli
from zeroshard.checkpoint.dcp import export_dcp, import_dcp

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _adam_state(model: nn.Module) -> dict:
    """What get_optimizer_state_dict gives for one AdamW step: state keyed by param FQN."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, model[0].in_features)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _save(path: Path, state: dict) -> Path:
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _load(path: Path, like: dict) -> dict:
    out = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def test_nested_layout_round_trip_with_buffers(tmp_path):
    model = _model()
    state = _adam_state(model)
    src = _save(tmp_path / "src", {"model": model.state_dict(), "optim": {"state": state}})
    got = import_dcp(src, tmp_path / "zs", buffers=("*.running_*", "*.num_batches_tracked"))
    assert got.buffers == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    assert got.optimizer_state == ["exp_avg", "exp_avg_sq", "step"] and got.step == 1 and not got.tied
    plain = _model(seed=1)
    zs.load(tmp_path / "zs", plain, rng=False)
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    export_dcp(tmp_path / "zs", tmp_path / "back")
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    flat |= {f"optim.state.{fqn}.{n}": v for fqn, s in state.items() for n, v in s.items()}
    back = _load(tmp_path / "back", flat)
    assert all(torch.equal(back[k], v) for k, v in flat.items())


def test_flattened_optimizer_and_top_level_model_keys(tmp_path):
    """torchtitan's layout: model keys at the top level, flatten_optimizer_state_dict's "state.<fqn>.<name>"."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    state = _adam_state(model)
    flat = dict(model.state_dict())
    flat["optimizer"] = {f"state.{fqn}.{n}": v for fqn, s in state.items() for n, v in s.items()}
    got = import_dcp(_save(tmp_path / "src", flat), tmp_path / "zs", param_groups=1)
    assert got.params == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert got.optimizer_state == ["exp_avg", "exp_avg_sq", "step"]


def test_bf16_params_cast_to_fp32_masters(tmp_path):
    model = nn.Linear(3, 2).to(torch.bfloat16)
    import_dcp(_save(tmp_path / "src", {"model": model.state_dict()}), tmp_path / "zs", dtype=torch.float32)
    plain = nn.Linear(3, 2)
    zs.load(tmp_path / "zs", plain, rng=False)
    assert torch.equal(plain.weight, model.weight.float())


def test_errors_are_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "out"
    cases = {
        "missing": (tmp_path / "nope", "does not exist"),
        "not dcp": (tmp_path, "not a torch.distributed.checkpoint directory"),
    }
    bad = {"model": {"w": torch.ones(4, 3)}, "optim": {"state": {"w": {"exp_avg": torch.ones(5)}}}}
    cases["state shape"] = (_save(tmp_path / "bad", bad),
                            "'optim.state.w.exp_avg' has shape [5] but its param 'model.w' has [4, 3]")
    truncated = _save(tmp_path / "trunc", {"model": {"w": torch.randn(64, 64)}})
    data = next(truncated.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    cases["truncated"] = (truncated, "dcp.load could not read 'model.w'")
    for name, (src, message) in cases.items():
        with pytest.raises(CheckpointError) as e:
            import_dcp(src, out)
        assert message in str(e.value) and "\n" not in str(e.value), f"{name}: {e.value}"
        assert not out.exists() and not list(tmp_path.glob(".out*")), f"{name}: something was written"


def test_wrong_shape_at_load_names_the_tensor(tmp_path):
    import_dcp(_save(tmp_path / "src", {"model": nn.Linear(3, 2).state_dict()}), tmp_path / "zs")
    with pytest.raises(CheckpointError, match=r"param 'weight' has shape \[2, 4\] in the model but \[2, 3\]"):
        zs.load(tmp_path / "zs", nn.Linear(4, 2), rng=False)


def test_cli(tmp_path, capsys):
    src = _save(tmp_path / "src", {"model": nn.Linear(3, 2).state_dict()})
    assert cli(["ckpt", "import-dcp", str(src), str(tmp_path / "zs")]) == 0
    assert cli(["ckpt", "export-dcp", str(tmp_path / "zs"), str(tmp_path / "back")]) == 0
    assert cli(["ckpt", "export-dcp", str(tmp_path / "zs"), str(tmp_path / "back")]) == 1
    assert cli(["ckpt", "import-dcp", str(tmp_path / "zs"), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "already exists" in err[0] and "no .metadata file" in err[1]


def test_export_of_a_corrupt_checkpoint_writes_nothing(tmp_path):
    import_dcp(_save(tmp_path / "src", {"model": nn.Linear(3, 2).state_dict()}), tmp_path / "zs")
    rank_file = next((tmp_path / "zs").glob("rank-*.safetensors"))
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt: sha256"):
        export_dcp(tmp_path / "zs", tmp_path / "back")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "zs"], "export left files behind"


def test_flat_keys_saved_without_flattening(tmp_path):
    """No planner_data paths: roots are read from the keys themselves."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    state = _adam_state(model)
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    flat |= {f"optim.state.{fqn}.{n}": v for fqn, s in state.items() for n, v in s.items()}
    dcp.save(flat, checkpoint_id=tmp_path / "src", planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    got = import_dcp(tmp_path / "src", tmp_path / "zs")
    assert got.params == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert got.optimizer_state == ["exp_avg", "exp_avg_sq", "step"]

"""The cross-host shard warning and the refused tp layout's cost, against the planner's own figures."""

from __future__ import annotations

import json
import shlex

import pytest

from zeroshard.cli.main import main
from zeroshard.cli.placement import failure_text
from zeroshard.comm.names import Dim
from zeroshard.comm.topology import CrossHostError, RankFacts, Topology
from zeroshard.trainer.config import TrainConfig
from zeroshard.models import GPTConfig
from zeroshard.tools.planner.placement import rank_budget, shard_group_advice

TRAIN = TrainConfig(model="tiny", stage=3, nproc=4, batch=8, seq_len=32, vocab_size=16).to_dict()
MODEL = GPTConfig.named("tiny", seq_len=32, vocab_size=16)
FULL_SHARD = {Dim.REPLICATE: 1, Dim.SHARD: 4, Dim.TP: 1}


def two_hosts(memory_bytes: int) -> dict:
    """2 hosts x 2 CPU ranks whose host has ``memory_bytes`` of RAM, described as a run records it."""
    facts = tuple(RankFacts(rank=r, host=f"h{r // 2}", memory_bytes=memory_bytes) for r in range(4))
    return Topology(facts).describe(FULL_SHARD)


def planned_total(command: str, capsys) -> int:
    """Run the `zeroshard plan` command the warning names; its total for the layout the warning names."""
    argv = shlex.split(command)
    assert argv[:2] == ["zeroshard", "plan"]
    capsys.readouterr()
    assert main([*argv[1:], "--json"]) == 0
    return json.loads(capsys.readouterr().out)["layouts"]["zero3_hybrid"]["total_bytes"]


def test_warning_names_the_host_sized_shard_and_the_planners_figure(capsys):
    advice = shard_group_advice(MODEL, TRAIN, two_hosts(64 * 2**30))
    assert advice is not None and advice.shard_size == 2 and advice.layout == "zero3_hybrid"
    assert "--shard-size 2 shards inside each host" in advice.text
    command = advice.text.split("`")[1]
    total = planned_total(command, capsys)
    print(f"warning: {advice.text}\nzeroshard plan's zero3_hybrid total: {total:,} B")
    assert advice.need_bytes == total
    assert f"{total / 1e6:,.2f} MB per rank" in advice.text


def test_no_warning_when_the_hybrid_layout_does_not_fit_or_the_shard_group_is_inside():
    advice = shard_group_advice(MODEL, TRAIN, two_hosts(64 * 2**30))
    assert advice is not None
    # A host whose RAM, split between its 2 ranks, is one byte short of the planner's figure.
    short = two_hosts(2 * advice.need_bytes - 2)
    assert rank_budget(short) == advice.need_bytes - 1
    assert shard_group_advice(MODEL, TRAIN, short) is None
    assert shard_group_advice(MODEL, TRAIN, two_hosts(2 * advice.need_bytes)) is not None
    inside = Topology.grid(1, 4).describe(FULL_SHARD)
    assert shard_group_advice(MODEL, TRAIN, inside) is None
    assert shard_group_advice(MODEL, {**TRAIN, "stage": 0}, two_hosts(64 * 2**30)) is None


def test_refused_cross_host_tp_carries_the_modelled_cost():
    with pytest.raises(CrossHostError) as err:
        Topology.grid(2, 1).check_placement({Dim.TP: 2})
    text = failure_text(err.value, {**TRAIN, "nproc": 2, "tp": 2, "stage": 0})
    print(text)
    assert text.startswith("CrossHostError: tp groups span hosts") and "--allow-cross-host" in text
    assert "modelled cost: tp's collectives move" in text and "on the host network" in text


def test_the_override_is_a_flag_and_a_toml_key(tmp_path):
    from zeroshard.cli.main import build_parser
    from zeroshard.cli.train import config_from_args

    toml = tmp_path / "run.toml"
    toml.write_text("allow_cross_host = true\n")
    assert config_from_args(build_parser().parse_args(["train", "--config", str(toml)])).allow_cross_host
    assert config_from_args(build_parser().parse_args(["train", "--allow-cross-host"])).allow_cross_host
    assert not config_from_args(build_parser().parse_args(["train"])).allow_cross_host

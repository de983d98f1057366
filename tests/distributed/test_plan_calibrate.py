"""`zeroshard plan --calibrate` end to end on 2 gloo ranks, then `plan --time` on what it wrote.

The calibration's own arithmetic (fits, medians over rounds, the replay's use of each figure) is
unit-tested in tests/unit/test_sim.py with made-up timings. This runs the real probes once, on
`tiny`, and checks that every figure the replay reads came back measured and usable, and that the
replay's compute is exactly the measured units it was given.
"""

from __future__ import annotations

import json
import math

from zeroshard.cli.main import main as cli
from zeroshard.models import GPTConfig
from zeroshard.tools.sim.hardware import load_hardware

SEQ = 32


def test_calibrate_writes_a_hardware_file_that_plan_time_replays(tmp_path, capsys):
    out = tmp_path / "host.toml"
    assert cli(["plan", "--calibrate", "--world", "2", "--model", "tiny", "--seq", str(SEQ), "--hw-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"hardware written to {out}" in printed and "slowest rank" in printed

    hw = load_hardware(str(out))
    assert sorted((m.op, m.group, m.world) for m in hw.links) == [
        ("all_gather", 2, 2), ("all_reduce", 2, 2), ("reduce_scatter", 2, 2)]
    assert all(m.alpha_s >= 0 and m.bandwidth > 0 for m in hw.links)
    (c,) = hw.compute
    assert (c.model, c.vocab, c.micro_batch, c.seq, c.world) == ("tiny", 16, 1, SEQ, 2)
    assert c.block_forward_s > 0 and c.block_backward_s > 0 and c.optimizer_s_per_param > 0
    assert c.block_forward_slowest_s is not None and c.block_backward_slowest_s is not None
    # Per repeat the slowest rank is at least each rank, and a median keeps order, so the slowest
    # rank's median is at least every rank's median and hence their mean.
    assert c.block_forward_slowest_s >= c.block_forward_s * (1 - 1e-12)
    assert c.block_backward_slowest_s >= c.block_backward_s * (1 - 1e-12)
    assert c.root_slowest_s is not None and c.root_slowest_s >= 0
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert math.isfinite(c.contention(op)) and c.contention(op) >= 0
    (k,) = hw.concurrency
    assert (k.world, k.group) == (2, 2) and k.two > 0 and k.three > 0

    assert cli(["plan", "--time", "--hw", str(out), "--model", "tiny", "--vocab-size", "16", "--seq", str(SEQ),
                "--micro-batch", "1", "--world", "2", "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    rows = replay["rows"]
    # The file records where it was measured (2 gloo ranks on this host), and the replay reads it back.
    topology = replay["topology"]
    assert (topology["hosts"], topology["ranks_per_host"], topology["source"]) == (1, 2, str(out))
    n_layer = GPTConfig.named("tiny").n_layer
    # Stages 0-2: mean blocks, the slowest rank's whole step once (on the root); stage 3 gathers per
    # block, so every block is the slowest rank's, and the root the mean.
    met_seldom = n_layer * (c.block_forward_s + c.block_backward_s) + max(c.root_slowest_s, c.root_forward_s)
    per_block = n_layer * (c.block_forward_slowest_s + c.block_backward_slowest_s) + c.root_forward_s + c.root_backward_s
    # ...plus the runtime's own host work per stage-3 unit (every block and the root), as calibrated.
    per_block += (n_layer + 1) * (c.unit_host_forward_s + c.unit_host_backward_s)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert math.isclose(r["compute_s"], per_block if r["stage"] == 3 else met_seldom, rel_tol=1e-9)
        assert r["step_s"] >= r["compute_s"] + r["optimizer_s"] - 1e-12

"""Chaos in the suite: a torchrun job whose ranks are SIGKILLed twice, once in the middle of a save
(bench/chaos.py, which runs the same with more kills and with --save-async), ends bitwise equal to
an uninterrupted run. Two torchrun jobs of 16 tiny steps."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import chaos  # noqa: E402 - bench/ is a folder of scripts, put on the path above
import pytest  # noqa: E402

STEPS, SAVE_EVERY = 16, 4


@pytest.mark.timeout(900)  # two torchrun jobs with three starts of the group: slow on a loaded machine
def test_random_kills_one_mid_save_end_bitwise_equal_to_uninterrupted(tmp_path: Path) -> None:
    plain = chaos.run(tmp_path, "plain", steps=STEPS, save_every=SAVE_EVERY, kills=0, save_async=False, seed=0)
    assert plain.returncode == 0, plain.output[-4000:]
    killed = chaos.run(tmp_path, "chaos", steps=STEPS, save_every=SAVE_EVERY, kills=2, save_async=False, seed=0)
    assert killed.returncode == 0, killed.output[-4000:]
    assert len(killed.kills) == 1, "attempt 1 was killed by the test (attempt 0 killed itself mid-save)"
    assert len(killed.resumed) == 2, killed.output[-4000:]
    assert killed.resumed[0] == SAVE_EVERY, "after the mid-save kill: the checkpoint before the one being written"
    assert all(step % SAVE_EVERY == 0 for step in killed.resumed)
    assert "skipped" in killed.output and "interrupted save" in killed.output
    params_a, files_a = chaos.final_state(tmp_path / "plain-ck", tmp_path)
    params_b, files_b = chaos.final_state(tmp_path / "chaos-ck", tmp_path)
    print(f"chaos: kills {killed.kills} (after the mid-save one), resumed from {killed.resumed}; "
          f"uninterrupted {plain.seconds:.1f} s, with kills {killed.seconds:.1f} s")
    assert chaos.bitwise(params_a, params_b), "params differ from the uninterrupted run"
    assert chaos.bitwise(files_a, files_b), "masters or optimizer state differ from the uninterrupted run"

"""Named fault points: specs are parsed and validated once, malformed ones are a one-line ValueError,
and a point fires only where its spec matches."""

from __future__ import annotations

import pytest

from zeroshard.comm import fault_points as faults
from zeroshard.comm import faults as comm_faults


def test_unset_or_empty_is_off() -> None:
    for name in faults.POINTS:
        assert faults.parse(name, None) is None
        assert faults.parse(name, "  ") is None
    assert faults.configure({}) == {}


def test_specs_parse_to_typed_fields() -> None:
    assert faults.parse("train.step", "rank=1,step=3") == {"rank": 1, "step": 3}
    assert faults.parse("ckpt.write", " rank = 0 , step = 4 ") == {"rank": 0, "step": 4}
    assert faults.parse("tune.build", "stage3-prefetch1") == {"candidate": "stage3-prefetch1"}
    comm = faults.parse("comm.unit", "kind=swap-units,rank=1,step=2,unit=blocks.1,other=blocks.2")
    assert comm == {"kind": "swap-units", "rank": 1, "step": 2, "unit": "blocks.1", "other": "blocks.2"}


@pytest.mark.parametrize("name, spec, problem", [
    ("train.step", "rank=one,step=3", "rank must be an integer"),
    ("train.step", "rank=1", "missing step"),
    ("train.step", "rank=1,step=3,when=now", "unknown key 'when'"),
    ("train.step", "rank=1,rank=2,step=3", "given twice"),
    ("ckpt.write", "rank1,step=4", "'rank1' is not key=value"),
    ("ckpt.write", "rank=1,step=", "'step=' is not key=value"),
    ("comm.unit", "kind=melt,rank=1,step=1,unit=a", "kind='melt' is unknown"),
    ("comm.unit", "kind=swap-units,rank=1,step=1,unit=a", "needs other=UNIT"),
])
def test_malformed_spec_is_one_line_value_error_naming_variable_and_fix(name: str, spec: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        faults.parse(name, spec)
    message = str(info.value)
    assert "\n" not in message
    env = faults.env_var(name)
    assert message.startswith(f"{env}={spec!r} is malformed: ") and problem in message
    assert f"use e.g. {env}='{faults.POINTS[name].example}'" in message
    # The example the message offers is itself a valid spec.
    assert faults.parse(name, faults.POINTS[name].example) is not None


def test_configure_validates_every_variable_before_a_run() -> None:
    env = {"ZEROSHARD_FAULT": "rank=1,step=3", "ZEROSHARD_TUNE_FAULT": "stage2", "UNRELATED": "x"}
    assert faults.configure(env) == {"train.step": {"rank": 1, "step": 3}, "tune.build": {"candidate": "stage2"}}
    with pytest.raises(ValueError, match="ZEROSHARD_CKPT_FAULT="):
        faults.configure({**env, "ZEROSHARD_CKPT_FAULT": "rank=1"})


def test_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault point 'train.stpe'"):
        faults.point("train.stpe", rank=0, step=1)


def test_point_fires_only_where_the_spec_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZEROSHARD_FAULT", raising=False)
    faults.point("train.step", rank=1, step=3)  # unset: nothing happens
    monkeypatch.setenv("ZEROSHARD_FAULT", "rank=1,step=3")
    faults.point("train.step", rank=0, step=3)
    faults.point("train.step", rank=1, step=2)
    with pytest.raises(RuntimeError, match=r"injected fault \(ZEROSHARD_FAULT\) at train.step: rank 1, step 3"):
        faults.point("train.step", rank=1, step=3)
    monkeypatch.setenv("ZEROSHARD_TUNE_FAULT", "stage3")
    faults.point("tune.build", candidate="stage2")
    with pytest.raises(RuntimeError, match="injected fault"):
        faults.point("tune.build", candidate="stage3")


def test_ckpt_point_ignores_a_save_without_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real hit SIGKILLs the process (covered by tests/e2e/test_ckpt_cli.py); a save that records
    # no step never matches a spec that names one.
    monkeypatch.setenv("ZEROSHARD_CKPT_FAULT", "rank=0,step=4")
    faults.point("ckpt.write", rank=0, step=None)
    faults.point("ckpt.write", rank=1, step=4)


def test_ckpt_point_with_an_attempt_fires_only_in_that_torchrun_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    # A restarted group (TORCHELASTIC_RESTART_COUNT=1) gets past the save that killed attempt 0.
    monkeypatch.setenv("ZEROSHARD_CKPT_FAULT", "rank=1,step=4,attempt=0")
    assert faults.armed("ckpt.write") == {"rank": 1, "step": 4, "attempt": 0}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    faults.point("ckpt.write", rank=1, step=4)  # would SIGKILL this process in attempt 0
    monkeypatch.setenv("ZEROSHARD_CKPT_FAULT", "rank=1,step=4,attempt=x")
    with pytest.raises(ValueError, match="attempt must be an integer"):
        faults.armed("ckpt.write")


def test_comm_faults_keep_their_variable_and_shape() -> None:
    assert comm_faults.FAULT_ENV == "ZEROSHARD_COMM_FAULT"
    assert comm_faults.parse("kind=raise,rank=1,step=2,unit=blocks.2") == {
        "kind": "raise", "rank": 1, "step": 2, "unit": "blocks.2", "other": None}

"""Every flag of `zeroshard plan memory`, `plan time`, `plan calibrate`, `tune` and `train` is read.

Given a value other than its default, a flag either changes the result (the resolved TrainConfig,
the plan's JSON, the simulated rows, what tune measures and writes) or is refused with one line
naming it. A flag that is parsed and then ignored would hand back a result that lacks what the
user asked for, silently. The flags are read off the argparse parsers themselves, so a flag added
without an entry in the tables below fails `test_every_flag_has_an_entry`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from zeroshard.cli.main import build_parser, main
from zeroshard.trainer.config import field_names

ROOT = Path(__file__).resolve().parents[2]
CHANGES, REFUSED = "changes", "refused"
Entry = tuple[list[str], "list[str] | None", str]
"""(argv with the flag, argv it is compared against (None for a refusal), what must happen)."""


def _subparser(command: str) -> argparse.ArgumentParser:
    """``command``'s parser: "train", or "plan time" for a subcommand's."""
    parser = build_parser()
    for word in command.split():
        # argparse exposes the subcommands and their options only through _actions.
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        parser = sub.choices[word]
    return parser


def flags_of(command: str) -> set[str]:
    """Each option of ``command`` by its first long name (--trace for --trace/--no-trace); not --help."""
    actions = _subparser(command)._actions  # noqa: SLF001 - argparse's only list of its options
    return {a.option_strings[0] for a in actions if a.option_strings and not isinstance(a, argparse._HelpAction)}  # noqa: SLF001


def plus(base: list[str], *tokens: str) -> list[str]:
    return [*base, *tokens]


def swap(base: list[str], flag: str, value: str) -> list[str]:
    i = base.index(flag)
    return [*base[: i + 1], value, *base[i + 2:]]


def drop(base: list[str], flag: str, values: int = 1) -> list[str]:
    i = base.index(flag)
    return [*base[:i], *base[i + 1 + values:]]


@dataclasses.dataclass(frozen=True)
class Outcome:
    rc: int
    out: str
    err: str
    extra: str = ""
    """What else the command produced that the flag may change (files written, what tune measured)."""


def _runner(capsys: pytest.CaptureFixture[str], extra: Callable[[], str] = lambda: "",
            before: Callable[[], None] = lambda: None) -> Callable[[list[str]], Outcome]:
    """``main(argv)`` in this process, memoised: most entries share the argv they are compared against."""
    seen: dict[tuple[str, ...], Outcome] = {}

    def run(argv: list[str]) -> Outcome:
        key = tuple(argv)
        if key not in seen:
            before()
            capsys.readouterr()
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's own refusals exit (2)
                rc = int(e.code or 0)
            got = capsys.readouterr()
            seen[key] = Outcome(rc, got.out, got.err, extra())
        return seen[key]

    return run


def _check(command: str, table: dict[str, list[Entry]], run: Callable[[list[str]], Outcome]) -> list[str]:
    """Every entry of ``table``; returns one line per entry that does not hold."""
    problems = []
    for flag, entries in table.items():
        for with_flag, without, expect in entries:
            got = run(with_flag)
            if expect == REFUSED:
                line = got.err.strip()
                # argparse's own refusal (rc 2: a flag the subcommand does not hold, or two that
                # exclude each other) ends its usage with the one line that names the flag.
                if got.rc == 2:
                    line = line.splitlines()[-1] if line else ""
                # Named by its flag, or by its config key (TrainConfig's errors say "tp=3 ...").
                named = flag in line or f"{flag[2:].replace('-', '_')}=" in line
                if not (got.rc in (1, 2) and got.out == "" and "\n" not in line and "Traceback" not in line
                        and re.match(rf"zeroshard {command}( \w+)?: error: ", line) and named):
                    problems.append(f"{flag}: {with_flag} should be refused in one line naming it; got rc {got.rc}, "
                                    f"stderr {got.err[-300:]!r}")
                continue
            assert without is not None
            base = run(without)
            if got.rc != 0:
                problems.append(f"{flag}: {with_flag} failed: {got.err[-300:]!r}")
            elif got == base:
                problems.append(f"{flag}: {with_flag} gives the same result as {without}: the flag is ignored")
    return problems


# --------------------------------------------------------------------------- plan (memory) and plan --time


def _plan_tables(tmp: Path) -> tuple[dict[str, list[Entry]], dict[str, list[Entry]]]:
    png, hw_out = str(tmp / "plan.png"), str(tmp / "hw.toml")
    m = ["plan", "memory", "--model", "tiny", "--world", "4", "--json"]
    moe = swap(m, "--model", "tiny-moe")
    # inter-node links only price collectives that span nodes: 16 ranks over nodes of 8
    rec = ["plan", "memory", "--model", "tiny", "--world", "16", "--device-mem", "1GB", "--json"]
    memory: dict[str, list[Entry]] = {
        "--model": [(swap(m, "--model", "small"), m, CHANGES),
                    (swap(m, "--model", "torch.nn:Linear"), None, REFUSED)],  # its arguments missing
        "--model-config": [(swap(plus(m, "--model-config", '{"in_features": 64, "out_features": 64}'), "--model",
                                 "torch.nn:Linear"),
                            swap(plus(m, "--model-config", '{"in_features": 64, "out_features": 32}'), "--model",
                                 "torch.nn:Linear"), CHANGES),
                           (plus(m, "--model-config", "{}"), None, REFUSED)],  # a preset takes no arguments
        "--params": [(["plan", "memory", "--params", "7e9", "--world", "4", "--json"], m, CHANGES)],
        "--world": [(swap(m, "--world", "8"), m, CHANGES)],
        "--tp": [(plus(m, "--tp", "2"), m, CHANGES)],
        "--sequence-parallel": [(plus(m, "--tp", "2", "--sequence-parallel"), plus(m, "--tp", "2"), CHANGES)],
        "--ep": [(plus(moe, "--ep", "2"), moe, CHANGES), (plus(m, "--ep", "2"), None, REFUSED),  # tiny has no experts
                 (plus(moe, "--pp", "2", "--ep", "2"), plus(moe, "--pp", "2"), CHANGES),  # a stage's experts split
                 (plus(moe, "--tp", "2", "--ep", "2"), plus(moe, "--tp", "2"), CHANGES)],  # ep borrowing tp ranks
        "--routing-skew": [(plus(moe, "--ep", "2", "--routing-skew", "0.5"), plus(moe, "--ep", "2"), CHANGES),
                           (plus(moe, "--routing-skew", "0.5"), None, REFUSED)],
        "--stage": [(plus(m, "--stage", "3"), m, CHANGES)],
        "--batch": [(plus(m, "--batch", "8"), m, CHANGES)],
        "--seq": [(plus(m, "--seq", "32"), m, CHANGES)],
        "--accum": [(plus(m, "--accum", "2"), m, CHANGES)],
        # train's clip (default 1.0): without clipping no float64 norm chunk in the step's workspace
        "--clip": [(plus(m, "--clip", "0"), m, CHANGES), (plus(m, "--clip", "-1"), None, REFUSED)],
        "--mp": [(plus(m, "--mp", "bf16"), m, CHANGES)],
        "--optimizer": [(plus(m, "--optimizer", "sgd"), m, CHANGES)],
        "--vocab-size": [(plus(m, "--vocab-size", "32"), m, CHANGES)],
        "--checkpointing": [(plus(m, "--checkpointing", "sqrt"), m, CHANGES)],
        "--offload": [(plus(m, "--offload", "cpu"), m, CHANGES)],
        "--shard-size": [(plus(m, "--shard-size", "2"), m, CHANGES)],
        "--prefetch": [(plus(m, "--prefetch", "2"), m, CHANGES)],
        "--bucket-mb": [(plus(m, "--bucket-mb", "0.01"), m, CHANGES)],
        "--reshard-after-forward": [(plus(m, "--no-reshard-after-forward"), m, CHANGES)],
        "--max-inflight-reductions": [(plus(m, "--max-inflight-reductions", "3"), m, CHANGES)],
        "--accumulation": [(plus(m, "--accum", "2", "--accumulation", "unsharded"), plus(m, "--accum", "2"), CHANGES)],
        "--comm-quant": [(plus(m, "--comm-quant", "weights"), m, CHANGES)],
        "--comm-quant-block": [(plus(m, "--comm-quant", "weights", "--comm-quant-block", "128"),
                                plus(m, "--comm-quant", "weights"), CHANGES),
                               (plus(m, "--comm-quant-block", "128"), None, REFUSED)],
        "--headroom": [(plus(m, "--headroom", "0.2"), m, CHANGES)],
        "--accounting": [(plus(m, "--accounting", "textbook"), m, CHANGES)],
        "--device": [(plus(m, "--device", "cpu"), m, CHANGES)],
        "--device-mem": [(plus(m, "--device-mem", "1GB"), m, CHANGES)],
        "--intra-gbps": [(plus(rec, "--intra-gbps", "100"), rec, CHANGES), (plus(m, "--intra-gbps", "100"), None, REFUSED)],
        "--inter-gbps": [(plus(rec, "--inter-gbps", "10"), rec, CHANGES), (plus(m, "--inter-gbps", "10"), None, REFUSED)],
        "--gpus-per-node": [(plus(m, "--gpus-per-node", "2"), m, CHANGES)],
        "--topology": [(plus(m, "--topology", "2x2"), m, CHANGES), (plus(m, "--topology", "2x4"), None, REFUSED)],
        "--plot": [(plus(m, "--plot", png), m, CHANGES)],
        "--json": [(m, drop(m, "--json", 0), CHANGES)],
        "--hw": [(plus(rec, "--hw", "a100"), rec, CHANGES), (plus(m, "--hw", "a100"), None, REFUSED)],
        "--pp": [(plus(m, "--pp", "2"), m, CHANGES), (plus(m, "--pp", "2", "--shard-size", "2"), None, REFUSED)],
        "--cp": [(plus(m, "--cp", "2"), m, CHANGES), (plus(m, "--cp", "3"), None, REFUSED)],
        "--cp-attention": [(plus(m, "--cp", "2", "--cp-attention", "ulysses"), plus(m, "--cp", "2"), CHANGES),
                           (plus(m, "--cp", "2", "--cp-attention", "tree"), None, REFUSED)],
        "--pp-schedule": [(plus(m, "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "4"),
                           plus(m, "--pp", "2", "--microbatches", "4"), CHANGES),
                          (plus(m, "--pp-schedule", "gpipe"), None, REFUSED)],
        "--pp-grad-reduce": [(plus(m, "--pp", "2", "--pp-grad-reduce", "microbatch"), plus(m, "--pp", "2"), CHANGES),
                             (plus(m, "--pp", "2", "--stage", "1", "--pp-grad-reduce", "microbatch"), None, REFUSED),
                             (plus(m, "--pp-grad-reduce", "microbatch"), None, REFUSED)],
        "--microbatches": [(plus(m, "--pp", "2", "--microbatches", "4"), plus(m, "--pp", "2"), CHANGES),
                           (plus(m, "--pp", "2", "--microbatches", "1"), None, REFUSED)],
        "--pp-stages-per-rank": [(plus(swap(m, "--model", "small"), "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                       "--pp-stages-per-rank", "4", "--microbatches", "4"),
                                  plus(swap(m, "--model", "small"), "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                       "--microbatches", "4"), CHANGES),
                                 (plus(m, "--pp", "2", "--pp-stages-per-rank", "2"), None, REFUSED)],
    }
    t = ["plan", "time", "--model", "tiny", "--world", "4", "--json"]
    time: dict[str, list[Entry]] = {
        "--model": [(swap(t, "--model", "llama3-8b"), t, CHANGES),
                    (swap(t, "--model", "hf:gpt2-tiny"), t, CHANGES)],
        "--world": [(swap(t, "--world", "8"), t, CHANGES), (plus(t, "--sweep", "2,4"), None, REFUSED)],
        "--tp": [(plus(t, "--tp", "2"), t, CHANGES)],
        "--ep": [(plus(swap(t, "--model", "tiny-moe"), "--ep", "2"), swap(t, "--model", "tiny-moe"), CHANGES),
                 (plus(t, "--ep", "2"), None, REFUSED),
                 (plus(swap(t, "--model", "tiny-moe"), "--tp", "2", "--ep", "2"),
                  plus(swap(t, "--model", "tiny-moe"), "--tp", "2"), CHANGES)],
        "--routing-skew": [(plus(swap(t, "--model", "tiny-moe"), "--ep", "2", "--routing-skew", "0.5"),
                            plus(swap(t, "--model", "tiny-moe"), "--ep", "2"), CHANGES),
                           (plus(swap(t, "--model", "tiny-moe"), "--routing-skew", "0.5"), None, REFUSED)],
        "--stage": [(plus(t, "--stage", "3"), t, CHANGES)],
        "--batch": [(plus(t, "--batch", "8"), t, CHANGES)],
        "--seq": [(plus(t, "--seq", "32"), t, CHANGES)],
        "--accum": [(plus(t, "--accum", "2"), t, CHANGES)],
        "--mp": [(plus(t, "--mp", "fp32"), t, CHANGES)],
        "--vocab-size": [(plus(t, "--vocab-size", "32"), t, CHANGES),
                         (plus(swap(t, "--model", "llama3-8b"), "--vocab-size", "32"), None, REFUSED)],
        "--checkpointing": [(plus(t, "--checkpointing", "sqrt"), t, CHANGES)],
        "--offload": [(plus(t, "--offload", "cpu"), t, CHANGES)],
        "--shard-size": [(plus(t, "--shard-size", "2"), t, CHANGES),
                         (plus(t, "--shard-size", "2", "--shard-sizes", "2"), None, REFUSED)],
        "--prefetch": [(plus(t, "--prefetch", "2"), t, CHANGES)],
        "--bucket-mb": [(plus(t, "--bucket-mb", "0.01"), t, CHANGES)],
        "--reshard-after-forward": [(plus(t, "--no-reshard-after-forward"), t, CHANGES)],
        "--headroom": [(plus(t, "--headroom", "0.2"), t, CHANGES)],
        "--device-mem": [(plus(t, "--device-mem", "1MB"), t, CHANGES)],
        "--topology": [(plus(t, "--topology", "2x2"), t, CHANGES), (plus(t, "--topology", "2x4"), None, REFUSED)],
        "--plot": [(plus(t, "--plot", png), t, CHANGES)],
        "--json": [(t, drop(t, "--json", 0), CHANGES)],
        "--hw": [(plus(t, "--hw", "a100"), t, CHANGES)],
        "--micro-batch": [(plus(t, "--micro-batch", "2"), t, CHANGES),
                          (plus(t, "--batch", "8", "--micro-batch", "2"), None, REFUSED)],
        "--sweep": [(["plan", "time", "--model", "tiny", "--sweep", "2,4", "--json"], t, CHANGES)],
        "--shard-sizes": [(plus(t, "--shard-sizes", "2"), t, CHANGES)],
        "--pp": [(plus(t, "--pp", "2"), t, CHANGES), (plus(t, "--pp", "2", "--shard-sizes", "2"), None, REFUSED)],
        "--cp": [(plus(t, "--cp", "2"), t, CHANGES), (plus(t, "--cp", "3"), None, REFUSED)],
        "--cp-attention": [(plus(t, "--cp", "2", "--cp-attention", "ulysses"), plus(t, "--cp", "2"), CHANGES)],
        "--pp-schedule": [(plus(t, "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "4"),
                           plus(t, "--pp", "2", "--microbatches", "4"), CHANGES),
                          (plus(t, "--pp-schedule", "gpipe"), None, REFUSED)],
        "--microbatches": [(plus(t, "--pp", "2", "--microbatches", "4"), plus(t, "--pp", "2"), CHANGES)],
        "--pp-stages-per-rank": [(plus(swap(t, "--model", "small"), "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                       "--microbatches", "4", "--pp-stages-per-rank", "4"),
                                  plus(swap(t, "--model", "small"), "--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                       "--microbatches", "4"), CHANGES),
                                 (plus(t, "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--microbatches", "2",
                                       "--pp-stages-per-rank", "1"), None, REFUSED)],
    }
    c = ["plan", "calibrate", "--world", "2"]
    one = ["plan", "calibrate", "all_reduce", "--world", "2"]
    calibrate: dict[str, list[Entry]] = {
        "--model": [(plus(c, "--model", "tiny"), c, CHANGES), (plus(one, "--model", "tiny"), None, REFUSED)],
        "--world": [(swap(c, "--world", "4"), c, CHANGES)],
        "--sweep": [(plus(c, "--sweep", "2,4"), c, CHANGES), (plus(one, "--sweep", "2,4"), None, REFUSED)],
        "--seq": [(plus(c, "--seq", "32"), c, CHANGES), (plus(one, "--seq", "32"), None, REFUSED)],
        "--micro-batch": [(plus(c, "--micro-batch", "2"), c, CHANGES), (plus(one, "--micro-batch", "2"), None, REFUSED)],
        "--vocab-size": [(plus(c, "--vocab-size", "32"), c, CHANGES), (plus(one, "--vocab-size", "32"), None, REFUSED)],
        "--hw-out": [(plus(c, "--hw-out", hw_out), c, CHANGES), (plus(one, "--hw-out", hw_out), None, REFUSED)],
        "--json": [(plus(c, "--json"), c, CHANGES)],
    }
    return memory, time, calibrate


def _plan_run(capsys, monkeypatch, tmp: Path) -> tuple[Callable[[list[str]], Outcome], dict]:
    """The runner with the two flags that would spawn ranks here (--measure, --calibrate) stubbed:
    what reaches the stub is recorded, and the stub's answer becomes part of the output."""
    from zeroshard.tools.planner import measure as plan_measure
    from zeroshard.tools.planner.result import Components
    from zeroshard.cli import plan_time as sim_cli

    called: dict[str, Any] = {}

    def measure(p, stages, **_: Any) -> list:
        called["measure"] = (p.spec.world, stages)
        return [plan_measure.ComponentCheck(layout="ddp", method="stub", predicted=Components(params=1),
                                            measured={**dict.fromkeys(plan_measure.MEASURED, 0), "params": 1, "workspace": 0},
                                            measured_total=1)]

    def print_calibration(args: argparse.Namespace) -> int:
        called["calibrate"] = args.calibrate
        print(f"calibrated {sorted((k, str(v)) for k, v in vars(args).items() if k != 'run')}")
        return 0

    monkeypatch.setattr(plan_measure, "measure", measure)
    monkeypatch.setattr(sim_cli, "print_calibration", print_calibration)

    def files() -> str:  # --plot writes a chart, whose existence is part of the result
        return ",".join(sorted(p.name for p in tmp.iterdir()))

    def clean() -> None:
        for p in tmp.iterdir():
            p.unlink()

    return _runner(capsys, extra=files, before=clean), called


def test_every_flag_has_an_entry(tmp_path: Path) -> None:
    memory, time, calibrate = _plan_tables(tmp_path)
    assert flags_of("plan memory") == flags_of("plan measure") == set(memory)
    assert flags_of("plan time") == set(time) and flags_of("plan calibrate") == set(calibrate)
    assert flags_of("tune") == set(_tune_table(tmp_path, tmp_path / "out.toml"))
    assert flags_of("train") == set(_train_table(tmp_path))


def test_every_plan_flag_changes_the_memory_plan_or_is_refused(tmp_path, capsys, monkeypatch) -> None:
    memory, _, _ = _plan_tables(tmp_path)
    run, called = _plan_run(capsys, monkeypatch, tmp_path)
    problems = _check("plan", memory, run)
    assert not problems, "\n".join(problems)
    measured = run(["plan", "measure", "--model", "tiny", "--world", "4", "--json"])
    assert measured.rc == 0 and measured != run(["plan", "memory", "--model", "tiny", "--world", "4", "--json"])
    assert called["measure"] == (4, (0, 1, 2, 3))


def test_every_plan_flag_changes_the_time_rows_or_is_refused(tmp_path, capsys, monkeypatch) -> None:
    _, time, _ = _plan_tables(tmp_path)
    run, called = _plan_run(capsys, monkeypatch, tmp_path)
    problems = _check("plan", time, run)
    assert not problems, "\n".join(problems)
    assert "measure" not in called  # refused before anything ran


def test_every_calibrate_flag_changes_what_is_timed_or_is_refused(tmp_path, capsys, monkeypatch) -> None:
    _, _, calibrate = _plan_tables(tmp_path)
    run, called = _plan_run(capsys, monkeypatch, tmp_path)
    problems = _check("plan", calibrate, run)
    assert not problems, "\n".join(problems)
    assert called["calibrate"] == "all"


def test_a_flag_a_plan_subcommand_does_not_read_is_refused_by_argparse(tmp_path, capsys, monkeypatch) -> None:
    """Each subcommand's parser holds only its own flags: any other plan flag is refused (rc 2) in one
    line that names it and the subcommands reading it, and nothing runs."""
    run, called = _plan_run(capsys, monkeypatch, tmp_path)
    modes = ("memory", "time", "calibrate", "measure")
    flags = {mode: flags_of(f"plan {mode}") for mode in modes}
    refused = 0
    for mode in modes:
        for flag in sorted(set().union(*flags.values()) - flags[mode]):
            got = run(["plan", mode, "--world", "2", f"{flag}=2"])
            readers = ", ".join(f"plan {m}" for m in modes if flag in flags[m])
            assert (got.rc, got.out) == (2, ""), (mode, flag, got)
            assert got.err == (f"zeroshard plan {mode}: error: plan {mode} does not read {flag} (it is read by "
                               f"{readers}); drop {flag}\n"), got.err
            refused += 1
    assert refused == 64 and called == {}  # 4 each for memory and measure, 16 for time, 40 for calibrate


def test_the_old_plan_spellings_are_the_subcommands(tmp_path, capsys, monkeypatch) -> None:
    """`plan ...`, `plan --time`, `plan --measure` and `plan --calibrate [OP]` run as before, as
    `plan memory`, `plan time`, `plan measure` and `plan calibrate [OP]`."""
    run, called = _plan_run(capsys, monkeypatch, tmp_path)
    base = ["--model", "tiny", "--world", "4", "--json"]
    for old, new in ((["plan", *base], ["plan", "memory", *base]),
                     (["plan", "--time", *base], ["plan", "time", *base]),
                     (["plan", *base, "--time"], ["plan", "time", *base]),
                     (["plan", "--measure", *base], ["plan", "measure", *base]),
                     (["plan", "--calibrate", "--world", "2"], ["plan", "calibrate", "--world", "2"]),
                     (["plan", "--calibrate", "all_reduce", "--world", "2"], ["plan", "calibrate", "all_reduce", "--world", "2"]),
                     (["plan", "--world", "2", "--calibrate=all_gather"], ["plan", "calibrate", "all_gather", "--world", "2"])):
        got = run(old)
        assert got.rc == 0 and got.out and got == run(new), (old, got.err)
    assert called["calibrate"] == "all_gather" and called["measure"] == (4, (0, 1, 2, 3))
    both = run(["plan", "--time", *base, "--measure"])  # two modes at once: one is refused, by name
    assert both.rc == 2 and "--measure is `plan measure`" in both.err


def test_plan_time_passes_tp_to_the_simulator(capsys) -> None:
    """`plan --time --tp 8` for Llama 3 70B on 256 GPUs: the block's matmuls split over 8 ranks of a
    node, 32 data-parallel ranks; a tp that does not divide the KV heads is refused by name."""
    import json

    argv = ["plan", "--time", "--model", "llama3-70b", "--world", "256", "--stage", "3", "--json"]
    rows = {}
    for tp in ("1", "8"):
        assert main([*argv, "--tp", tp]) == 0
        (rows[tp],) = json.loads(capsys.readouterr().out)["rows"]
    one, eight = rows["1"], rows["8"]
    assert (one["layout"], eight["layout"], eight["tp"]) == ("zero3", "zero3 tp=8", 8)
    assert eight["compute_s"] < one["compute_s"] / 2 and eight["tp_bytes"] > 0 == one["tp_bytes"]
    assert eight["peak_bytes"] < one["peak_bytes"]  # each rank holds 1/8 of every block's params
    assert main([*argv, "--tp", "16"]) == 1
    assert "--tp 16 does not divide KV heads (8) of llama3-70b" in capsys.readouterr().err
    assert main([*argv, "--tp", "3"]) == 1
    assert "--tp 3 does not divide world 256" in capsys.readouterr().err


# --------------------------------------------------------------------------- tune


def _tune_table(tmp: Path, out: Path) -> dict[str, list[Entry]]:
    (tmp / "in").mkdir(exist_ok=True)
    toml, corpus = tmp / "in" / "base.toml", tmp / "in" / "corpus.txt"
    toml.write_text("lr = 0.005\n")
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 64)
    b = ["tune", "--model", "tiny", "--nproc", "2", "--batch", "4", "--seq-len", "16", "--stages", "0,3",
         "--checkpointing", "none", "--bucket-mb", "25", "--prefetch", "1", "--reshard", "true", "--json",
         "--out", str(out)]
    pp = plus(b, "--pp", "2")
    moe = swap(b, "--model", "tiny-moe")
    return {
        "--config": [(plus(b, "--config", str(toml)), b, CHANGES)],
        "--model": [(swap(b, "--model", "small"), b, CHANGES)],
        "--nproc": [(swap(b, "--nproc", "4"), b, CHANGES)],
        "--tp": [(plus(b, "--tp", "2"), b, CHANGES), (plus(b, "--tp", "3"), None, REFUSED)],
        "--batch": [(swap(b, "--batch", "8"), b, CHANGES)],
        "--seq-len": [(swap(b, "--seq-len", "32"), b, CHANGES)],
        "--lr": [(plus(b, "--lr", "0.005"), b, CHANGES)],
        "--weight-decay": [(plus(b, "--weight-decay", "0.05"), b, CHANGES)],
        "--clip": [(plus(b, "--clip", "0.5"), b, CHANGES)],
        "--accum": [(plus(b, "--accum", "2"), b, CHANGES)],
        "--seed": [(plus(b, "--seed", "1"), b, CHANGES)],
        "--data": [(plus(b, "--data", str(corpus)), b, CHANGES)],
        "--vocab-size": [(plus(b, "--vocab-size", "32"), b, CHANGES)],
        "--mp": [(plus(b, "--mp", "bf16"), b, CHANGES)],
        "--accumulation": [(plus(b, "--accumulation", "unsharded"), b, CHANGES)],
        "--stages": [(swap(b, "--stages", "0"), b, CHANGES)],
        "--prefetch": [(swap(b, "--prefetch", "2"), b, CHANGES)],
        "--bucket-mb": [(swap(b, "--bucket-mb", "5"), b, CHANGES)],
        "--checkpointing": [(swap(b, "--checkpointing", "sqrt"), b, CHANGES)],
        "--reshard": [(swap(b, "--reshard", "false"), b, CHANGES)],
        "--comm-quant": [(plus(b, "--comm-quant", "none,weights"), b, CHANGES)],
        "--device-mem": [(plus(b, "--device-mem", "4MB"), b, CHANGES)],  # prunes stage 0 (4.4 MB), keeps 3 (2.9)
        "--steps": [(plus(b, "--steps", "2"), b, CHANGES)],
        "--rounds": [(plus(b, "--rounds", "2"), b, CHANGES)],
        "--warmup": [(plus(b, "--warmup", "1"), b, CHANGES)],
        "--resident": [(plus(b, "--no-resident"), b, CHANGES)],
        "--out": [(swap(b, "--out", str(out.with_name("other.toml"))), b, CHANGES)],
        "--json": [(b, drop(b, "--json", 0), CHANGES)],
        # The pipeline's flags, against the same tune at pp 2 (the grid axes need a pipeline).
        "--pp": [(pp, b, CHANGES), (plus(b, "--pp", "3"), None, REFUSED)],
        "--pp-schedule": [(plus(pp, "--pp-schedule", "gpipe"), pp, CHANGES)],
        "--microbatches": [(plus(pp, "--microbatches", "4"), pp, CHANGES)],
        "--pp-stages-per-rank": [(plus(pp, "--pp-stages-per-rank", "2"), None, REFUSED)],  # 1f1b runs one
        "--pp-schedules": [(plus(pp, "--pp-schedules", "1f1b,gpipe"), pp, CHANGES),
                           (plus(b, "--pp-schedules", "1f1b"), None, REFUSED)],
        "--microbatch-counts": [(plus(pp, "--microbatch-counts", "2,4"), pp, CHANGES),
                                (plus(b, "--microbatch-counts", "2"), None, REFUSED)],
        # Expert parallelism, against the same tune of tiny-moe (tiny has no experts).
        "--ep": [(plus(moe, "--ep", "2"), moe, CHANGES), (plus(b, "--ep", "2"), None, REFUSED)],
        "--cp": [(plus(b, "--cp", "2"), b, CHANGES), (plus(b, "--cp", "3"), None, REFUSED)],
        "--cp-attention": [(plus(b, "--cp", "2", "--cp-attention", "ulysses"), plus(b, "--cp", "2"), CHANGES)],
        "--cp-degrees": [(plus(b, "--cp-degrees", "1,2"), b, CHANGES), (plus(b, "--cp-degrees", "1,3"), None, REFUSED)],
        "--ep-degrees": [(plus(moe, "--ep-degrees", "1,2"), moe, CHANGES),
                         (plus(moe, "--ep-degrees", "1,4"), None, REFUSED)],  # 4 does not divide 2 ranks
    }


def test_every_tune_flag_changes_what_is_measured_or_written_or_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """tune's measurement is stubbed (it would spawn ranks); what the flags decide is what reaches it
    (the MeasureSpec: base config, candidates, steps, rounds, resident), the rows and the TOML written."""
    import importlib

    tune_measure = importlib.import_module("zeroshard.tools.tune.measure")  # the package exports a function of that name

    outdir = tmp_path / "out"
    outdir.mkdir()
    specs: list = []

    def measure(spec, **_: Any) -> list[dict]:
        specs.append(spec)
        per_rank = [[{"times": [0.01 * (i + 1)] * (spec.steps * spec.rounds), "peak_bytes": 1000 + i, "error": None}
                     for i, _ in enumerate(spec.candidates)]]
        return tune_measure.summarise(spec, per_rank)

    monkeypatch.setattr(tune_measure, "measure", measure)

    def produced() -> str:
        spec = repr(specs.pop()) if specs else "not measured"
        return spec + "".join(f"\n{p.name}:\n{p.read_text()}" for p in sorted(outdir.iterdir()))

    def clean() -> None:
        for p in outdir.iterdir():
            p.unlink()

    run = _runner(capsys, extra=produced, before=clean)
    table = _tune_table(tmp_path, outdir / "tuned.toml")
    problems = _check("tune", table, run)
    assert not problems, "\n".join(problems)
    # What the tp flag decides, spelled out: every candidate is measured and planned at it, and the
    # winner's file keeps it (and the comm_quant it was measured with) for `zeroshard train`.
    tp = run(plus(table["--tp"][0][0], "--comm-quant", "weights", "--stages", "3"))
    assert tp.rc == 0, tp.err
    assert "tp=2" in tp.extra and '[comm]\nquant = "weights"' in tp.extra and "tp = 2" in tp.extra


# --------------------------------------------------------------------------- train


def _train_table(tmp: Path) -> dict[str, list[Entry]]:
    (tmp / "in").mkdir(exist_ok=True)
    toml = tmp / "in" / "train.toml"
    toml.write_text("steps = 7\n")
    t: list[str] = ["train"]
    values = {  # a valid value other than the default, for each TrainConfig field
        "model": "small", "stage": "1", "nproc": "4", "batch": "32", "seq_len": "32", "steps": "5", "lr": "0.002",
        "min_lr": "0.00001", "warmup": "5", "warmup_shape": "log", "weight_decay": "0.0", "clip": "0.5", "accum": "2",
        "lr_schedule": "linear", "warmup_min_lr": "0.00001", "power": "2.0", "decay_steps": "3", "decay_ratio": "0.2",
        "decay_shape": "linear", "lora_r": "4", "lora_alpha": "8", "lora_dropout": "0.1", "lora_targets": "qkv",
        "seed": "1", "backend": "gloo", "optimizer": "muon",
        "data": "corpus.txt", "num_samples": "1000", "vocab_size": "32", "order": "1", "checkpointing": "sqrt",
        "offload": "cpu", "shard_size": "1", "tp": "2", "bucket_mb": "5", "prefetch": "2", "mp": "bf16",
        "accumulation": "unsharded", "comm_quant_block": "128", "compile_backend": "eager", "init": "meta",
        "run_dir": "runs/x", "log_every": "5", "hang_timeout_s": "30", "desync_check": "5", "log": "tensorboard",
        "peak_flops": "1e12", "ckpt_dir": "ckpt", "resume": "ckpt/step-00000001", "keep_last": "1",
        "backward_prefetch_at": "0.25", "max_inflight_reductions": "1",
        "pp": "2", "pp_schedule": "gpipe", "microbatches": "4", "pp_stages_per_rank": "2",
        "tokenizer": "tok", "packing": "off", "eval_data": "held-out.jsonl", "pp_blocks": "blocks",
        "max_bad_steps": "2", "rollback_window": "5", "skip_from": "runs/x", "replicas": "2",
    }
    switches = {"reshard_after_forward": "--no-reshard-after-forward", "reap_when_done": "--no-reap-when-done",
                "check_schedule": "--check-schedule", "allow_cross_host": "--allow-cross-host",
                "compile": "--compile", "dropout": "--no-dropout", "save_async": "--save-async",
                "profile": "--no-profile", "trace": "--trace", "doc_mask": "--doc-mask",
                "skip_nonfinite": "--no-skip-nonfinite"}
    switch_needs = {"replica_recovery": ["--replicas", "2"]}
    needs = {"offload_dir": (["--offload", "disk"], "/tmp/zs-offload"), "comm_quant": (["--stage", "3"], "weights"),
             "offload_slice_mb": (["--offload", "disk", "--offload-dir", "/tmp/zs-offload"], "8"),
             "save_every": (["--ckpt-dir", "ckpt"], "10"),
             "rollback_on_spike": (["--save-every", "2", "--ckpt-dir", "ckpt"], "3"),
             "ep": (["--model", "tiny-moe", "--nproc", "4"], "2"),
             "cp": (["--nproc", "4"], "2"), "cp_attention": (["--nproc", "4", "--cp", "2"], "ulysses"),
             "pp_grad_reduce": (["--pp", "2", "--stage", "2"], "microbatch"),
             "eval_every": (["--eval-data", "held-out.jsonl"], "5")}
    table: dict[str, list[Entry]] = {"--config": [(plus(t, "--config", str(toml)), t, CHANGES)],
                                     "--tp": [(plus(t, "--tp", "3"), None, REFUSED),
                                              (plus(t, "--model", "hf:gpt2-tiny", "--tp", "2"), None, REFUSED)],
                                     "--ep": [(plus(t, "--ep", "2"), None, REFUSED),  # tiny has no experts
                                              (plus(t, "--model", "tiny-moe", "--nproc", "4", "--ep", "3"), None,
                                               REFUSED)],
                                     "--pp": [(plus(t, "--pp", "3"), None, REFUSED),
                                              (plus(t, "--model", "hf:gpt2-tiny", "--pp", "3"), None, REFUSED)],
                                     "--pp-schedule": [(plus(t, "--pp", "2", "--pp-schedule", "zb"), None, REFUSED)],
                                     "--microbatches": [(plus(t, "--pp", "2", "--microbatches", "1"), None, REFUSED),
                                                        (plus(t, "--pp", "2", "--microbatches", "3"), None, REFUSED)],
                                     "--pp-stages-per-rank": [(plus(t, "--pp", "2", "--pp-stages-per-rank", "2"), None,
                                                               REFUSED)],
                                     "--pp-grad-reduce": [(plus(t, "--pp", "2", "--stage", "1", "--pp-grad-reduce",
                                                                "microbatch"), None, REFUSED),
                                                          (plus(t, "--pp", "2", "--pp-grad-reduce", "once"), None,
                                                           REFUSED)],
                                     "--backward-prefetch-at": [(plus(t, "--backward-prefetch-at", "1.5"), None,
                                                                 REFUSED)],
                                     "--packing": [(plus(t, "--packing", "maybe"), None, REFUSED)],
                                     "--eval-every": [(plus(t, "--eval-every", "5"), None, REFUSED)],
                                     "--eval-data": [(plus(t, "--pp", "2", "--eval-data", "held-out.jsonl"), None,
                                                      REFUSED)],
                                     # no checkpoint to roll back to; no replica to recover
                                     "--rollback-on-spike": [(plus(t, "--rollback-on-spike", "3"), None, REFUSED)],
                                     "--replica-recovery": [(plus(t, "--replica-recovery"), None, REFUSED),
                                                            (plus(t, "--replicas", "2", "--tp", "2", "--replica-recovery"),
                                                             None, REFUSED),
                                                            (plus(t, "--replicas", "2", "--replica-recovery",
                                                                  "--rollback-on-spike", "3", "--save-every", "2",
                                                                  "--ckpt-dir", "c"), None, REFUSED)]}
    for name in field_names():
        flag = "--" + name.replace("_", "-")
        if name in switches:
            entry: Entry = (plus(t, switches[name]), t, CHANGES)
        elif name in switch_needs:
            entry = (plus(t, *switch_needs[name], flag), plus(t, *switch_needs[name]), CHANGES)
        elif name in needs:
            companions, value = needs[name]
            entry = (plus(t, *companions, flag, value), plus(t, *companions), CHANGES)
        else:
            entry = (plus(t, flag, values[name]), t, CHANGES)
        table.setdefault(flag, []).insert(0, entry)
    return table


def _resolved(argv: list[str]) -> Outcome:
    """What `zeroshard train` resolves from ``argv`` before it launches: the TrainConfig, or the
    one-line error it would print."""
    from zeroshard.cli.train import check_before_launch, config_from_args

    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        check_before_launch(cfg)
    except ValueError as e:
        return Outcome(1, "", f"zeroshard train: error: {e}")
    return Outcome(0, repr(cfg.to_dict()), "")


def test_every_train_flag_changes_the_resolved_config_or_is_refused(tmp_path) -> None:
    problems = _check("train", _train_table(tmp_path), _resolved)
    assert not problems, "\n".join(problems)


def test_every_train_config_field_is_read_by_the_runtime() -> None:
    """The resolved config is only half of it: each field must also be read somewhere outside the
    config module (the step, the launcher, the observer, checkpoints), or its flag changes nothing."""
    from zeroshard.runtime.options import KNOB_NAMES  # the engine's, read as cfg.engine

    from zeroshard.trainer.config import table_spelling

    sources = [p.read_text() for p in (ROOT / "zeroshard").rglob("*.py") if p.name != "config.py"]

    def read(name: str) -> str:  # `cfg.lr`, or as its section spells it: `cfg.compile.backend`
        table, _, field = table_spelling(name).strip("[").partition("] ")
        return rf"\b(?:cfg|base)\.(?:{name}|{table}\.{field})\b" if field else rf"\b(?:cfg|base)\.{name}\b"

    unread = [name for name in field_names() if name not in KNOB_NAMES
              and not any(re.search(read(name), text) for text in sources)]
    assert not unread, f"TrainConfig fields nothing reads: {unread}"


def test_tp_with_a_model_or_world_it_cannot_split_is_one_line_before_launch(capsys) -> None:
    cases = {
        ("--tp", "3"): "tp=3 does not divide world size 2",
        ("--model", "hf:gpt2-tiny", "--tp", "2"): "model='hf:gpt2-tiny' has no tensor-parallel plan",
        ("--model", "medium", "--nproc", "4", "--tp", "4", "--batch", "16"): "tp=4 does not divide n_head=14",
        ("--nproc", "4", "--tp", "2", "--shard-size", "4"): "shard_size=4 does not divide the 2 data-parallel ranks",
        ("--nproc", "4", "--batch", "6"): "does not split evenly over 4 ranks",
    }
    for argv, message in cases.items():
        for command in ("train", "verify"):
            assert main([command, *argv]) == 1
            err = capsys.readouterr().err
            assert err.startswith(f"zeroshard {command}: error: ") and message in err and err.count("\n") == 1, err
    # The batch is split over the data-parallel ranks only: 6 does not split over 4 ranks, but over
    # the 2 data-parallel ranks of 4 at tp 2 it does (each tp group shares its 3 sequences).
    from zeroshard.trainer.config import TrainConfig

    assert TrainConfig(nproc=4, tp=2, batch=6).tp == 2


def test_tp_is_a_toml_key(tmp_path) -> None:
    from zeroshard.trainer.config import config_from_sources

    path = tmp_path / "run.toml"
    path.write_text("nproc = 4\ntp = 2\nstage = 3\n")
    cfg = config_from_sources(path, {})
    assert (cfg.tp, cfg.nproc, cfg.stage) == (2, 4, 3)
    assert config_from_sources(path, {"tp": 1}).tp == 1  # a flag overrides the file


def test_the_tp_plan_models_are_the_runtimes_plans() -> None:
    """TrainConfig refuses tp > 1 for a named model without a plan, without importing torch; its list
    must be exactly the named models whose spec (zeroshard/models/spec.py) has a tensor-parallel plan."""
    import torch

    import zeroshard as zs
    from zeroshard.trainer.config import HF_MODEL_NAMES, MODEL_NAMES, TP_MODEL_NAMES
    from zeroshard.models.gpt import GPT, GPTConfig
    from zeroshard.models.hf import build_hf_model
    from zeroshard.models.specs import spec_of

    for name in MODEL_NAMES + HF_MODEL_NAMES:
        if name in HF_MODEL_NAMES:
            pytest.importorskip("transformers")
            model = build_hf_model(name, vocab_size=16, seq_len=16, seed=0, device=torch.device("cpu"), meta=True)
        else:
            with zs.meta_init():
                model = GPT(GPTConfig.named(name, vocab_size=16))
        splits = not spec_of(model).tp_refusal
        assert splits == (name in TP_MODEL_NAMES), name


def test_train_verify_and_tune_help_list_tp() -> None:
    for command in ("train", "verify", "tune"):
        text = " ".join(_subparser(command).format_help().split())
        assert "--tp TP Tensor parallelism: split each block's matmuls" in text, command


def test_rollback_or_saves_with_replica_recovery_are_one_line_naming_why() -> None:
    from zeroshard.trainer.config import TrainConfig

    with pytest.raises(ValueError, match=r"keep no checkpoint .*; drop --rollback-on-spike or --replica-recovery$"):
        TrainConfig(replica_recovery=True, replicas=2, rollback_on_spike=3.0, save_every=2, ckpt_dir="c")
    with pytest.raises(ValueError, match=r"^save_every=2 with replica_recovery: .*; drop --save-every$"):
        TrainConfig(replica_recovery=True, replicas=2, save_every=2, ckpt_dir="c")

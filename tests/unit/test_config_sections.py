"""The nested config: TOML tables, each section checking itself, the flat spellings still read (a
TOML file of flat keys with a one-line note naming each key's table), and `train --help` grouped by
section."""

from __future__ import annotations

import ast
import dataclasses
import argparse
import io
import re
from pathlib import Path

import pytest

from zeroshard.trainer import config as config_module
from zeroshard.trainer.config import (TrainConfig, field_names, field_section, load_toml, merge_config,
                                      table_spelling)
from zeroshard.trainer.sections import FLAT, SECTIONS, CompileSection, OptimSection, ParallelSection
from zeroshard.tools.tune.tomlfile import dumps

TABLES = """\
model = "tiny"
stage = 3
nproc = 4

[data]
batch = 32
seq_len = 32

[optim]
lr = 3e-3
steps = 5

[parallel]
tp = 2

[pipeline]
schedule = "gpipe"

[engine]
prefetch = 2
checkpointing = "sqrt"

[comm]
quant = "weights"

[checkpoint]
dir = "ckpt"
every = 2
background = true

[observe]
log_every = 1
"""
FLAT_FILE = """\
model = "tiny"
stage = 3
nproc = 4
batch = 32
seq_len = 32
lr = 3e-3
steps = 5
tp = 2
pp_schedule = "gpipe"
prefetch = 2
checkpointing = "sqrt"
comm_quant = "weights"
ckpt_dir = "ckpt"
save_every = 2
save_async = true
log_every = 1
"""


def test_tables_and_flat_keys_make_the_same_config(tmp_path):
    (tmp_path / "tables.toml").write_text(TABLES)
    (tmp_path / "flat.toml").write_text(FLAT_FILE)
    quiet, noted = io.StringIO(), io.StringIO()
    nested = merge_config(load_toml(tmp_path / "tables.toml", note=quiet))
    flat = merge_config(load_toml(tmp_path / "flat.toml", note=noted))
    assert nested == flat
    assert (nested.optim.lr, nested.parallel.tp, nested.pipeline.schedule, nested.engine.prefetch) == (3e-3, 2, "gpipe", 2)
    assert (nested.checkpoint.dir, nested.checkpoint.every, nested.checkpoint.background) == ("ckpt", 2, True)
    assert nested.dims.dp == 2 and nested.dims.tp == 2  # the layout comes from [parallel] and nproc
    assert quiet.getvalue() == ""
    lines = noted.getvalue().splitlines()
    assert len(lines) == 1  # one line for the whole file
    for old, new in (("pp_schedule", "[pipeline] schedule"), ("save_async", "[checkpoint] background"),
                     ("lr", "[optim] lr"), ("prefetch", "[engine] prefetch"), ("ckpt_dir", "[checkpoint] dir")):
        assert f"{old} -> {new}" in lines[0]
    assert "model ->" not in lines[0]  # top-level keys are not renamed


def test_every_flat_key_reads_through_its_section():
    cfg = TrainConfig()
    flat = cfg.to_dict()
    # 59, [comm] backend, [optim] optimizer, [parallel] cp and cp_attention, the schedules' 6 keys, [lora]'s 4,
    # 4 of [data] (packing, tokenizer, doc_mask, ...), 2 of [eval], [heal]'s 7, [pipeline] blocks
    assert list(flat) == field_names() and len(flat) == 86
    for name, value in flat.items():
        table = field_section(name)
        if table is None or table == "engine":
            continue
        section, field = FLAT[name]
        if name in ("data", "compile"):  # the flat key is the section's name: cfg.data is [data]
            assert getattr(cfg, name) is getattr(cfg, section.TABLE)
            continue
        assert getattr(cfg, name) == getattr(getattr(cfg, section.TABLE), field) == value
        assert table_spelling(name) == f"[{section.TABLE}] {field}"
    assert TrainConfig(**flat) == cfg
    # Sections given as objects or as tables; a flat key beside them wins.
    a = TrainConfig(optim=OptimSection(lr=5e-3, steps=7), compile={"enabled": True, "backend": "eager"}, steps=9)
    assert (a.optim.lr, a.optim.steps, a.compile) == (5e-3, 9, CompileSection(enabled=True, backend="eager"))
    assert dataclasses.replace(a, run_dir="r").observe.run_dir == "r"


@pytest.mark.parametrize("call, message", [
    (lambda: OptimSection(lr=-1.0), "lr=-1.0 must be > 0"),
    (lambda: TrainConfig(optim={"lr": 0.0}), "lr=0.0 must be > 0"),
    (lambda: TrainConfig(pp_schedule=3), "pp_schedule=3 has type int; expected str"),
    (lambda: TrainConfig(save_every=2), "save_every=2 needs ckpt_dir"),
    (lambda: TrainConfig(parallel={"tpp": 2}), r"unknown key 'tpp' in \[parallel\]"),
    (lambda: TrainConfig(tp=3, nproc=4), "tp=3 does not divide world size 4"),
    (lambda: ParallelSection(tp=0), "tp=0 must be >= 1"),
    (lambda: TrainConfig(lrr=1.0), "unknown keys"),
])
def test_each_section_checks_its_own_fields_in_one_line(call, message):
    with pytest.raises((ValueError, TypeError), match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_an_unknown_key_in_a_table_names_the_table(tmp_path):
    (tmp_path / "bad.toml").write_text("[optim]\nlearning_rate = 1e-3\n")
    with pytest.raises(ValueError, match=r"unknown key 'learning_rate' in \[optim\] of .*bad.toml; valid keys there"):
        load_toml(tmp_path / "bad.toml")


def test_the_written_toml_uses_tables_and_reads_back(tmp_path):
    cfg = TrainConfig(stage=2, lr=2e-3, pp_schedule="gpipe", prefetch=3, save_async=True, ckpt_dir="c")
    text = dumps(cfg.to_dict())
    assert "[optim]\n" in text and "\nschedule = \"gpipe\"" in text and "\nbackground = true" in text
    assert "pp_schedule" not in text
    (tmp_path / "out.toml").write_text(text)
    noted = io.StringIO()
    assert merge_config(load_toml(tmp_path / "out.toml", note=noted)) == cfg
    assert noted.getvalue() == ""


def _train_help() -> str:
    """What `zeroshard train --help` prints (argparse wraps at $COLUMNS; the flags start each line)."""
    from zeroshard.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["train"].format_help()


def test_train_help_groups_its_flags_by_section():
    out = _train_help()
    headers = [m.group(1) for m in re.finditer(r"^(run|\[[a-z]+\]):$", out, re.MULTILINE)]
    assert headers == ["run"] + [f"[{s.TABLE}]" for s in SECTIONS] + ["[engine]"]
    # Each flag sits under its own section's header.
    starts = {h: out.index(f"\n{h}:\n") for h in headers}
    for name in field_names():
        flag = "--" + name.replace("_", "-")
        at = re.search(rf"^  {re.escape(flag)}[ ,\n]", out, re.MULTILINE)
        assert at is not None, flag
        table = field_section(name)
        owner = max((h for h in headers if starts[h] < at.start()), key=lambda h: starts[h])
        assert owner == ("run" if table is None else f"[{table}]"), flag


def test_config_imports_no_implementation_module():
    """config.py reads names, options and dims, never a model, a schedule or a logger."""
    tree = ast.parse(Path(config_module.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
        {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    ours = sorted(m for m in imported if m.startswith("zeroshard"))
    assert ours == ["zeroshard.comm.dims", "zeroshard.models.names", "zeroshard.runtime.docstrings",
                    "zeroshard.runtime.options", "zeroshard.trainer.sections"]

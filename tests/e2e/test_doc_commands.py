"""Every `zeroshard` command in README.md and docs/*.md, checked as it is written (issue 39).

Three tiers, cheapest first (the extraction rules are tests/e2e/doc_commands.py's docstring):

- parsed: every command. Its subcommand's `--help` runs, every flag it writes is one that help
  lists, spelled in full (argparse would also take an abbreviation, which a new flag can make
  ambiguous), and the CLI's own parser accepts the whole line. A rejection fails with file:line.
- resolved: train and verify commands that name no file of the reader's (`--config`, `--data`, a
  model folder) also build their TrainConfig and run the checks made before any rank starts (a tp
  the model cannot split, an ep its experts cannot), as `zeroshard train` does; no rank is spawned.
- run: the genuinely cheap ones run for real in a temporary directory: the checkpoint commands on
  a checkpoint that the README's own `zeroshard train --save-every 50 --ckpt-dir ckpt --resume auto`
  writes (run as written, the one command here that starts ranks), the DCP round trip, every
  `plan` that neither measures nor calibrates nor reads a file of yours, and the DeepSpeed converter
  on the DeepSpeed config docs/migrate.md shows.

Every TOML file in the repository (pyproject.toml aside) loads through the train config loader.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from doc_commands import ROOT, DocCommand, all_commands, commands_in_text
from zeroshard.cli.plan_flags import subcommand_argv
from test_cli import run_cli, run_main

DOC_COMMANDS = all_commands()
READ_FILES = ("--config", "--data")
"""Flags whose value is a file the reader brings."""


def _doc(file: str, text: str) -> DocCommand:
    """The command ``text`` as ``file`` shows it; failing names it, so a doc edit updates this test."""
    for command in DOC_COMMANDS:
        if command.file == file and command.text == text:
            return command
    raise AssertionError(f"{file} no longer shows `{text}`: update the commands this test runs for real")


# --------------------------------------------------------------------------- parsed and resolved


@pytest.fixture(scope="module")
def parser():
    from zeroshard.cli.main import build_parser

    return build_parser()


_HELP: dict[tuple[str, ...], str] = {}


def _help(parser, path: tuple[str, ...]) -> str | None:
    """`zeroshard PATH --help` as a user gets it; None when PATH is not a (sub)command."""
    if path not in _HELP:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                parser.parse_args([*path, "--help"])
        except SystemExit as e:
            if e.code != 0:
                return None
        usage = " ".join(out.getvalue().split()[:len(path) + 2])  # "usage: zeroshard" and the words of PATH
        _HELP[path] = out.getvalue() if usage == " ".join(["usage:", "zeroshard", *path]) else ""
    return _HELP[path] or None


def _subcommand(parser, argv: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """The longest (sub)command path that starts ``argv`` (``ckpt verify``, ``plan``), and its help."""
    path: tuple[str, ...] = ()
    text = _help(parser, path) or ""
    for word in argv:
        if word.startswith("-"):
            break
        deeper = _help(parser, (*path, word))
        if deeper is None:
            break
        path, text = (*path, word), deeper
    return path, text


def _names_read_file(command: DocCommand) -> bool:
    argv = command.argv
    values = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    return any(flag in values for flag in READ_FILES) or "/" in values.get("--model", "")


def parse_problem(parser, command: DocCommand) -> str | None:
    """Why ``command`` would not get past the CLI's parser as written (None: it does), with its place."""
    # The old `plan` spellings (`plan --time`, a bare `plan`) are read as the subcommand the CLI
    # turns them into, with the CLI's own rewrite.
    argv = tuple(subcommand_argv(command.argv))
    path, text = _subcommand(parser, argv)
    # The options as --help lists them: each entry's invocation ("  -w WORLD, --world WORLD"), the
    # part before the help text, not flags its prose mentions.
    listed = [line.strip().split("  ")[0] for line in text.splitlines() if line.strip().startswith("-")]
    options = {flag for entry in listed for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", entry)}
    unknown = [w.split("=")[0] for w in argv[len(path):]
               if re.match(r"^--?[A-Za-z]", w) and w.split("=")[0] not in options]
    if unknown:
        return (f"{command.where}: `{command.text}`: `zeroshard {' '.join(path)} --help` lists no "
                f"{', '.join(unknown)} (an abbreviation or a flag that is gone)")
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            parser.parse_args(list(argv))
    except SystemExit as e:
        if e.code != 0:
            lines = err.getvalue().strip().splitlines()
            return f"{command.where}: `{command.text}`: {lines[-1] if lines else f'exit {e.code}'}"
    return None


def resolve_problem(parser, command: DocCommand) -> str | None:
    """What `zeroshard train` / `verify` check before they start a rank, for ``command`` (None: it passes)."""
    from zeroshard.cli.train import check_before_launch, config_from_args
    from zeroshard.cli.verify import VERIFY_DEFAULTS

    args = parser.parse_args(list(command.argv))
    defaults = VERIFY_DEFAULTS if command.argv[0] == "verify" else None
    forced = {"nproc": command.torchrun_world} if command.torchrun_world else None  # torchrun's world wins
    try:
        check_before_launch(config_from_args(args, defaults=defaults, forced=forced))
    except ValueError as e:
        return f"{command.where}: `{command.text}`: {e}"
    return None


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=[c.where for c in DOC_COMMANDS])
def test_every_doc_command_parses_and_train_verify_resolve(parser, command: DocCommand) -> None:
    problem = parse_problem(parser, command)
    assert problem is None, problem
    if command.argv[0] in ("train", "verify") and not command.synopsis and not _names_read_file(command):
        problem = resolve_problem(parser, command)
        assert problem is None, problem


def test_the_docs_show_the_commands_and_a_wrong_one_fails_with_its_place(parser) -> None:
    """The extractor finds what the docs hold (README's `ckpt verify ckpt/latest`, continuations,
    torchrun lines), and a command argparse rejects, or an abbreviated flag, is reported with file:line."""
    assert len(DOC_COMMANDS) > 100 and {c.file for c in DOC_COMMANDS} >= {"README.md", "docs/checkpoints.md"}
    assert _doc("README.md", "zeroshard ckpt verify ckpt/latest").line == _doc(
        "README.md", "zeroshard train --save-every 50 --ckpt-dir ckpt --resume auto").line
    text = "\n".join([
        "```bash",
        "zeroshard plan --model small --world 4 \\",
        "    --no-such-flag 3   # a comment with --another-flag",
        "$ zeroshard train --model tiny --seq 64",
        "torchrun --nnodes 2 --nproc-per-node 4 -m zeroshard.cli.main train --tp 3 && zeroshard ckpt inspect ck",
        "zeroshard train: error: rank 0 failed",
        "zeroshard ckpt export DIR OUT [--dtype bf16]",
        "zeroshard train ... --steps 5   # flags left out",
        "```",
        "```python",
        "zeroshard train --not-shell",
        "```",
    ])
    found = commands_in_text(text, "docs/example.md")
    assert [(c.line, c.text, c.synopsis, c.torchrun_world) for c in found] == [
        (2, "zeroshard plan --model small --world 4 --no-such-flag 3", False, None),
        (4, "zeroshard train --model tiny --seq 64", False, None),
        (5, "zeroshard train --tp 3", False, 8),
        (5, "zeroshard ckpt inspect ck", False, None),
        (7, "zeroshard ckpt export DIR OUT --dtype bf16", False, None),
        (8, "zeroshard train --steps 5", True, None),
    ]
    assert parse_problem(parser, found[0]) == (
        "docs/example.md:2: `zeroshard plan --model small --world 4 --no-such-flag 3`: `zeroshard plan memory "
        "--help` lists no --no-such-flag (an abbreviation or a flag that is gone)")
    assert "abbreviation" in parse_problem(parser, found[1])  # --seq for --seq-len: argparse alone takes it
    assert "docs/example.md:5:" in resolve_problem(parser, found[2]) and "tp=3" in resolve_problem(parser, found[2])
    bad_value = DocCommand("docs/example.md", 9, ("plan", "--world", "four"), False)
    assert parse_problem(parser, bad_value) == (
        "docs/example.md:9: `zeroshard plan --world four`: zeroshard plan memory: error: argument --world: "
        "invalid int value: 'four'")


def _repo_tomls() -> list[str]:
    try:
        listed = subprocess.run(["git", "ls-files", "*.toml"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):  # a tarball, not a clone: nothing listed to check
        return []
    return [name for name in listed.stdout.split() if name != "pyproject.toml"]


@pytest.mark.parametrize("name", _repo_tomls())
def test_every_toml_file_in_the_repo_loads_as_a_train_config(parser, name: str) -> None:
    command = DocCommand(name, 1, ("train", "--config", str(ROOT / name)), False)
    assert resolve_problem(parser, command) is None


# --------------------------------------------------------------------------- run for real


def _run(command: DocCommand, capsys) -> subprocess.CompletedProcess[str]:
    done = run_main(list(command.argv), capsys)
    assert done.returncode == 0, f"{command.where}: `{command.text}` exited {done.returncode}: {done.stderr}"
    return done


def test_checkpoint_commands_run_on_the_readme_checkpoint(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    train = _doc("README.md", "zeroshard train --save-every 50 --ckpt-dir ckpt --resume auto")
    # As written: 100 steps of the tiny GPT on 2 ranks, about 13 s of CPU in all, most of it the
    # interpreters' and ranks' start (batch 2 instead of 16 would save 3 of them).
    trained = run_cli(list(train.argv), cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-00000050", "step-00000100"]

    verified = _run(_doc("README.md", "zeroshard ckpt verify ckpt/latest"), capsys)
    assert verified.stdout.splitlines() == ["OK   ckpt/step-00000100"]
    inspected = _run(_doc("docs/checkpoints.md", "zeroshard ckpt inspect ckpt"), capsys)
    assert "step 100, saved on 2 ranks at stage 0" in inspected.stdout
    every = _run(_doc("docs/checkpoints.md", "zeroshard ckpt verify ckpt"), capsys)
    assert every.stdout.splitlines() == ["OK   ckpt/step-00000050", "OK   ckpt/step-00000100"]

    _run(_doc("docs/checkpoints.md", "zeroshard ckpt export ckpt full.safetensors --dtype bf16"), capsys)
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "full.safetensors")
    assert exported and {str(t.dtype) for t in exported.values()} == {"torch.bfloat16"}
    _run(_doc("docs/checkpoints.md", "zeroshard ckpt reshard ckpt/step-00000100 ckpt-8 --world 8"), capsys)
    assert len(list((tmp_path / "ckpt-8").glob("rank-*.safetensors"))) == 8
    _run(_doc("docs/checkpoints.md", "zeroshard ckpt export-dcp ckpt/step-00000100 back"), capsys)
    assert (tmp_path / "back" / ".metadata").is_file()
    for where in ("README.md", "docs/checkpoints.md"):
        repaired = _run(_doc(where, "zeroshard ckpt repair ckpt"), capsys)
        assert repaired.stdout.count("verifies; left as it is") == 2

    # docs/generate.md and docs/expert_parallel.md call the checkpoint root `ck`.
    (tmp_path / "ck").symlink_to("ckpt")
    generated = _run(_doc("docs/generate.md", "zeroshard generate ck --prompt-ids 1,2,3 --temperature 0.8 "
                                              "--top-k 40 --seed 7 --json"), capsys)
    out = json.loads(generated.stdout)
    assert out["prompt_ids"] == [1, 2, 3] and len(out["new_ids"]) > 0
    _run(_doc("docs/expert_parallel.md", "zeroshard ckpt reshard ck/step-00000100 ck-ep1 -w 4 --ep 1"), capsys)
    assert len(list((tmp_path / "ck-ep1").glob("rank-*.safetensors"))) == 4


@pytest.mark.filterwarnings("ignore:.*single process:UserWarning")  # dcp.save/load without a process group
def test_dcp_import_and_export_commands_run(tmp_path: Path, monkeypatch, capsys) -> None:
    """An FSDP2-style DCP directory (model and optimizer state, saved without a process group) in,
    a zeroshard checkpoint, and a DCP directory back out with the same tensors."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {"model": model.state_dict(), "optim": {"state": {names[id(p)]: s for p, s in opt.state.items()}}}
    # Both docs import `fsdp-ckpt` into `zs-ckpt`: each in a directory of its own.
    for where in ("docs/checkpoints.md", "docs/pretrained.md"):
        (tmp_path / where).mkdir(parents=True)
        monkeypatch.chdir(tmp_path / where)
        dcp.save(state, checkpoint_id="fsdp-ckpt", no_dist=True)
        imported = _run(_doc(where, "zeroshard ckpt import-dcp fsdp-ckpt zs-ckpt"), capsys)
        assert "4 params" in imported.stdout and "exp_avg, exp_avg_sq" in imported.stdout
    _run(_doc("docs/pretrained.md", "zeroshard ckpt export-dcp zs-ckpt back"), capsys)
    back = {f"model.{k}": torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(back, checkpoint_id="back", no_dist=True)
    assert all(torch.equal(back[f"model.{k}"], v) for k, v in model.state_dict().items())


def _cheap_plan(command: DocCommand) -> bool:
    """A `plan` that prices on the meta device or the simulator: no measured step or calibration
    (they start ranks and time them), no file or module of the reader's."""
    words = command.argv
    values = [w for i, w in enumerate(words) if i and words[i - 1].startswith("--")]
    reads = any("/" in v or v.endswith((".toml", ".json")) or (re.match(r"^[\w.]+:\w+$", v) and not v.startswith("hf:"))
                for v in values)
    hf = any(v.startswith("hf:") for v in values)
    return (words[0] == "plan" and not command.synopsis and not reads
            and not {"--measure", "--calibrate", "measure", "calibrate"} & set(words)
            and (not hf or importlib.util.find_spec("transformers") is not None))


PLANS = [c for c in DOC_COMMANDS if _cheap_plan(c)]


@pytest.mark.parametrize("command", PLANS, ids=[c.where for c in PLANS])
def test_cheap_plan_commands_run(command: DocCommand, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    done = _run(command, capsys)
    assert done.stdout.strip(), f"{command.where}: `{command.text}` printed nothing"
    if "--plot" in command.argv:
        assert (tmp_path / command.argv[command.argv.index("--plot") + 1]).stat().st_size > 0


def _migrate_ds_config() -> dict:
    """The DeepSpeed config docs/migrate.md's `# deepspeed: basic` example passes to deepspeed.initialize."""
    text = (ROOT / "docs" / "migrate.md").read_text()
    block = text.split("# deepspeed: basic\n", 1)[1].split("```", 1)[0]
    assign = next(node for node in ast.parse(block).body if isinstance(node, ast.Assign)
                  and getattr(node.targets[0], "id", None) == "ds_config")
    return ast.literal_eval(assign.value)


# The Hugging Face Trainer's ZeRO-3 template, "auto" wherever the Trainer fills a value in: what the
# README's "your ds_config.json as it is" block converts.
HF_AUTO = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}


def test_deepspeed_converter_commands_run_and_train_reads_their_toml(parser, tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    from zeroshard.cli.train import config_from_args

    def train_config(command: DocCommand):
        assert resolve_problem(parser, command) is None
        return config_from_args(parser.parse_args(list(command.argv)))

    (tmp_path / "migrate").mkdir()
    monkeypatch.chdir(tmp_path / "migrate")
    Path("ds_config.json").write_text(json.dumps(_migrate_ds_config()))
    for where in ("README.md", "docs/migrate.md"):
        _run(_doc(where, "zeroshard config from-deepspeed ds_config.json --world 8 --out run.toml"), capsys)
        cfg = train_config(_doc("docs/migrate.md", "zeroshard train --config run.toml"))
        assert (cfg.nproc, cfg.stage, cfg.lr, cfg.clip) == (8, 3, 1e-2, 1.0)
        Path("run.toml").unlink()  # the second conversion writes the same file

    (tmp_path / "hf").mkdir()
    monkeypatch.chdir(tmp_path / "hf")
    Path("ds_config.json").write_text(json.dumps(HF_AUTO))
    _run(_doc("README.md", "zeroshard config from-deepspeed ds_config.json --world 2 --batch 32 --lr 3e-4 "
                           "--steps 1000 --out run.toml"), capsys)
    cfg = train_config(_doc("README.md", "zeroshard train --config run.toml"))
    assert (cfg.nproc, cfg.stage, cfg.batch, cfg.lr, cfg.steps) == (2, 3, 32, 3e-4, 1000)
    assert train_config(_doc("README.md", "zeroshard train --config run.toml --steps 50")).steps == 50

"""The `zeroshard` commands that README.md and docs/*.md show in their code blocks, as argv lists.

A command starts at the word `zeroshard` followed by a subcommand (or `--version`) at the start of a
shell segment (after `;`, `&&`, `|`, `&`, a `$ ` prompt, or `env` assignments), or after
`-m zeroshard.cli.main` (torchrun lines). Line continuations are joined and `#` comments dropped, as
the shell would. Usage synopses are read as commands too: a bare `...` (flags left out) and
`TEXT...` (one or more) are placeholders, and `[--flag value]` is an optional part, kept.
Lines such as `zeroshard train: error: ...` are program output, not commands (the subcommand word
ends in a colon), and python, json and toml blocks are not shell.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SHELL = ("python", "py", "json", "toml", "yaml")
SEPARATORS = {";", "&&", "||", "|", "&"}
MODULE = "zeroshard.cli.main"


@dataclasses.dataclass(frozen=True)
class DocCommand:
    file: str
    """Relative to the repository root, e.g. docs/checkpoints.md."""
    line: int
    """1-based line of the command's first line in ``file``."""
    argv: tuple[str, ...]
    """The words after ``zeroshard``."""
    synopsis: bool
    """Written with a placeholder (``...``): a usage line, not a command to run as it stands."""
    torchrun_world: int | None = None
    """Under ``torchrun ... -m zeroshard.cli.main``: the world it makes (nodes x procs per node)."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def text(self) -> str:
        return "zeroshard " + shlex.join(self.argv)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, logical line) of every shell code block in markdown ``text``, continuations joined."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    shell = False
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if fence is None:
            match = re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if match:
                fence, shell = match.group(1), match.group(2).lower() not in NOT_SHELL
            continue
        if stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            fence, pending = None, None
            continue
        if not shell:
            continue
        if pending is not None:
            pending = (pending[0], pending[1] + " " + raw.strip())
        else:
            pending = (number, raw)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1])
            continue
        out.append(pending)
        pending = None
    return out


def _without_comment(line: str) -> str:
    """``line`` up to an unquoted ``#`` that starts a word (so `# ... with error feedback` is no placeholder)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _unplaceholder(line: str) -> tuple[str, bool]:
    """The line with usage placeholders resolved, and whether it had any that hide flags (``...``)."""
    hidden = re.search(r"(?:^|\s)\.\.\.(?=\s|$)", line) is not None
    line = re.sub(r"(?:^|(?<=\s))\.\.\.(?=\s|$)", "", line)  # a bare `...`: flags left out
    line = re.sub(r"(?<=[A-Za-z0-9_])\.\.\.(?=\s|$)", "", line)  # `TEXT...`: one or more TEXT
    line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # `[--dtype bf16]`: an optional part, kept
    return line, hidden


def _words(line: str) -> list[str]:
    """Shell words and separators; a `#` starting a word begins a comment, as in the shell."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def commands_in(path: Path) -> list[DocCommand]:
    return commands_in_text(path.read_text(), str(path.relative_to(ROOT)))


def commands_in_text(text: str, rel: str) -> list[DocCommand]:
    """The commands of markdown ``text``, located as ``rel``:line."""
    found: list[DocCommand] = []
    from zeroshard.cli.main import COMMANDS

    candidate = re.compile(rf"(?:^|[\s;&|])(?:zeroshard\s+(?:{'|'.join(COMMANDS)}|--version)(?![:\w-])"
                           rf"|-m\s+{re.escape(MODULE)}\b)")
    for number, line in shell_lines(text):
        if not candidate.search(line):  # output, prose in a block: nothing to lex
            continue
        line, synopsis = _unplaceholder(_without_comment(line))
        try:
            words = _words(line)
        except ValueError as e:  # an unclosed quote: the shell would refuse the line too
            raise ValueError(f"{rel}:{number}: cannot split {line.strip()!r} as the shell would: {e}") from None
        segment: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                segment.append(word)
                continue
            argv = _zeroshard_argv(segment, COMMANDS)
            if argv is not None:
                found.append(DocCommand(rel, number, tuple(argv), synopsis, _torchrun_world(segment)))
            segment = []
    return found


def _zeroshard_argv(segment: list[str], commands: tuple[str, ...]) -> list[str] | None:
    words = list(segment)
    if words and words[0] == "$":  # a transcript's prompt
        words = words[1:]
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if MODULE in words and words.index(MODULE) > 0 and words[words.index(MODULE) - 1] == "-m":
        rest = words[words.index(MODULE) + 1:]
    elif words and words[0] == "zeroshard":
        rest = words[1:]
    else:
        return None
    if rest and (rest[0] in commands or rest[0] == "--version"):
        return rest
    return None


def _torchrun_world(segment: list[str]) -> int | None:
    if "torchrun" not in segment or MODULE not in segment:
        return None
    launcher = segment[segment.index("torchrun") + 1:segment.index(MODULE)]

    def value(flag: str) -> int:
        for i, word in enumerate(launcher[:-1]):
            if word in (flag, flag.replace("-", "_")):
                return int(launcher[i + 1])
        return 1

    return value("--nnodes") * value("--nproc-per-node")


def all_commands() -> list[DocCommand]:
    return [c for path in doc_files() for c in commands_in(path)]

"""Run the examples of a markdown doc on every rank (used by test_migrate_doc.py)."""

from __future__ import annotations

import re
from pathlib import Path

import zeroshard as zs

BLOCK = re.compile(r"```python\n(.*?)```", re.S)
RUNNABLE = re.compile(r"# (zeroshard|fsdp2): (\w+)\n")
KEEP = ("losses", "full", "restored")


def examples(doc: Path) -> tuple[str, dict[str, str]]:
    """The `# setup` block and every `# zeroshard: NAME` / `# fsdp2: NAME` block, keyed "kind:NAME"."""
    setup, runnable = "", {}
    for code in BLOCK.findall(doc.read_text()):
        if code.startswith("# setup\n"):
            setup = code
        elif match := RUNNABLE.match(code):
            runnable[f"{match[1]}:{match[2]}"] = code
    return setup, runnable


def run_examples(doc: str) -> dict[str, dict]:
    """Each runnable example after the setup, in a fresh namespace; returns its losses and state dicts."""
    zs.init()
    setup, runnable = examples(Path(doc))
    out = {}
    for key, code in runnable.items():
        namespace: dict = {"__name__": f"migrate_doc_{key.replace(':', '_')}"}
        exec(compile(setup, f"{doc}:setup", "exec"), namespace)
        exec(compile(code, f"{doc}:{key}", "exec"), namespace)
        out[key] = {name: namespace[name] for name in KEEP if name in namespace}
    return out

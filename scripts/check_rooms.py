#!/usr/bin/env python3
"""The package's rooms import downward only: `make lint` fails on an import that points up.

A room is a top-level subpackage of zeroshard. Each room may import the rooms listed before it in
ROOMS, never one after it, counting imports inside functions (a lazy import is still a dependency:
it only moves the cycle from import time to call time). Imports under `if TYPE_CHECKING:` are not
counted, since they never run. Inside the package, `import zeroshard` and `from zeroshard import X`
are refused too (`__version__` aside): the top-level package resolves its names lazily, so such an
import would hide which room is really used.

Usage: check_rooms.py [PACKAGE_DIR]   (default: zeroshard next to this script's parent)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOMS = (
    "comm",        # process groups, collectives and the ledger: the only caller of torch.distributed
    "runtime",     # the sharding engine, units, step schedule, sharded optimizer, offload, sharded init
    "models",      # zeroshard's GPT and the HF model builders
    "parallel",    # tensor, pipeline and expert parallelism applied to a plain model
    "checkpoint",  # format, save, load, reshard; HF and DCP in and out
    "observing",   # watchdog, doctor, desync check, profiler, observers and loggers
    "trainer",     # config, data, one step, the loop, the launcher
    "tools",       # planner, simulator, tuner, benchmarks, migration, generation
    "cli",         # argparse over the library
)
"""Bottom to top: a room imports only rooms before it."""


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    skip = _type_checking_nodes(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            if base == "zeroshard":  # `from zeroshard import X`: X is a room or a lazy name
                found += [(node.lineno, f"zeroshard.{alias.name}") for alias in node.names
                          if alias.name != "__version__"]  # a constant of the package's own, imports nothing
            else:
                found.append((node.lineno, base))
    return found


def violations(package_dir: Path) -> list[str]:
    root = package_dir.resolve()
    rank = {room: i for i, room in enumerate(ROOMS)}
    problems: list[str] = []
    for room in sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if room not in rank:
            problems.append(f"{root.name}/{room}: a room missing from ROOMS in {Path(__file__).name}; "
                            "add it where its imports place it")
    for loose in sorted(root.glob("*.py")):
        if loose.name != "__init__.py":
            problems.append(f"{loose.relative_to(root.parent)}: a loose module; move it into a room")
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        parts = rel.with_suffix("").parts
        if len(parts) < 3 and path.name == "__init__.py":
            continue  # the package's own __init__ is the public face: it may name any room
        room = parts[1]
        module = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        tree = ast.parse(path.read_text(), str(path))
        for line, target in _imported_modules(tree, module, path.name == "__init__.py"):
            names = target.split(".")
            if names[0] != root.name:
                continue
            if len(names) == 1:
                problems.append(f"{rel}:{line}: `import {root.name}` inside the package; import the module that "
                                "defines the name")
                continue
            dest = names[1]
            if dest not in rank:
                problems.append(f"{rel}:{line}: `{target}` is not in a room; import the module that defines it")
            elif room in rank and rank[dest] > rank[room]:
                problems.append(f"{rel}:{line}: room {room} imports {target}, a room above it "
                                f"({' < '.join(ROOMS)})")
    return problems


def main(argv: list[str]) -> int:
    package_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "zeroshard"
    problems = violations(package_dir)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"check_rooms: {len(problems)} import(s) break the room order", file=sys.stderr)
        return 1
    print(f"check_rooms: {len(ROOMS)} rooms, every import points down")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

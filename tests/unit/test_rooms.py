"""The room order `make lint` enforces (scripts/check_rooms.py), on the package and on planted violations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_rooms.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_rooms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "zeroshard"
    for room in _checker().ROOMS:
        (root / room).mkdir(parents=True)
        (root / room / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).write_text(text)
    return root


def test_the_package_imports_downward_only():
    assert _checker().violations(REPO / "zeroshard") == []


def test_every_room_on_disk_is_in_the_order():
    on_disk = {p.name for p in (REPO / "zeroshard").iterdir() if (p / "__init__.py").exists()}
    assert on_disk == set(_checker().ROOMS)


def test_a_function_level_import_of_a_room_above_is_refused(tmp_path):
    root = _package(tmp_path, {"runtime/engine.py": "def f():\n    from zeroshard.trainer.config import X\n"})
    problems = _checker().violations(root)
    assert len(problems) == 1
    assert "runtime/engine.py:2: room runtime imports zeroshard.trainer.config, a room above it" in problems[0]


def test_downward_and_type_checking_imports_pass(tmp_path):
    root = _package(tmp_path, {
        "trainer/step.py": "from zeroshard.runtime import x\nfrom zeroshard.comm import y\n",
        "comm/mesh.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zeroshard.cli import z\n",
        "runtime/relative.py": "from . import sibling\n",
    })
    assert _checker().violations(root) == []


def test_the_lazy_top_level_package_and_loose_modules_are_refused(tmp_path):
    root = _package(tmp_path, {"tools/bench.py": "import zeroshard as zs\n", "odd.py": "", })
    (root / "extra").mkdir()
    (root / "extra" / "__init__.py").write_text("")
    problems = "\n".join(_checker().violations(root))
    assert "tools/bench.py:1: `import zeroshard` inside the package" in problems
    assert "odd.py: a loose module" in problems
    assert "zeroshard/extra: a room missing from ROOMS" in problems


def test_a_relative_import_upward_is_resolved_and_refused(tmp_path):
    root = _package(tmp_path, {"comm/mesh.py": "from ..observing import doctor\n"})
    problems = _checker().violations(root)
    assert len(problems) == 1 and "room comm imports zeroshard.observing" in problems[0]


def test_the_script_exits_non_zero_on_a_violation(tmp_path):
    root = _package(tmp_path, {"models/gpt.py": "import zeroshard.tools.planner\n"})
    bad = subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)
    assert bad.returncode == 1 and "room models imports zeroshard.tools.planner" in bad.stderr
    good = subprocess.run([sys.executable, str(SCRIPT), str(REPO / "zeroshard")], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr

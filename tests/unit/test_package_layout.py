"""The package's shape: a light ``import zeroshard``, and no subpackage hidden behind a function."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types

import pytest

import zeroshard


def test_no_subpackage_is_shadowed_by_a_function_of_the_same_name():
    # `from zeroshard.x import x` in __init__ would leave zeroshard.x the function while
    # sys.modules holds the package: `import zeroshard.x as m` then gives the function.
    for info in pkgutil.iter_modules(zeroshard.__path__):
        importlib.import_module(f"zeroshard.{info.name}")
        value = getattr(zeroshard, info.name)
        assert isinstance(value, types.ModuleType), f"zeroshard.{info.name} is a {type(value).__name__}, not the module"


def test_import_zeroshard_loads_no_tool():
    """Tools (cli, tune, sim, profile's report, benchmark, migrate) load when used, not with the package."""
    code = ("import sys, zeroshard; print(','.join(sorted(m for m in sys.modules if m.startswith('zeroshard.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(",")
    tools = ("zeroshard.cli", "zeroshard.tools.tune", "zeroshard.tools.sim", "zeroshard.tools.benchmark",
             "zeroshard.tools.migrate", "zeroshard.observing.profile.report", "zeroshard.observing.profile.render")
    assert not [m for m in loaded if m.strip().startswith(tools)], loaded


def test_dtensor_loads_only_where_a_model_is_split():
    """torch.distributed.tensor costs over a second of CPU per process: neither the package nor the
    CLI's own process loads it (tests/distributed/test_tp.py covers the split models, which do)."""
    code = ("import sys, zeroshard, zeroshard.cli.main, zeroshard.cli.train, zeroshard.tools.planner.tp; "
            "print('torch.distributed.tensor' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_every_public_name_loads_on_first_use_and_is_declared_for_type_checkers():
    import ast
    from pathlib import Path

    source = Path(zeroshard.__file__).read_text()
    guarded = next(node for node in ast.parse(source).body
                   if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    declared = {alias.asname or alias.name for node in guarded.body for alias in node.names}
    assert declared == set(zeroshard.__all__)
    for name in zeroshard.__all__:
        module, attribute = zeroshard._EXPORTS[name]  # noqa: SLF001 (the table under test)
        assert getattr(zeroshard, name) is getattr(importlib.import_module(module), attribute)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        zeroshard.not_a_name  # noqa: B018


def test_the_command_line_starts_the_rank_server_before_its_own_imports():
    """`zeroshard train` forks its ranks from a server that imports torch on the other core while
    the command itself imports and parses: nothing heavy may load before it starts."""
    code = ("import sys, zeroshard.cli.main as m; "
            "print(sorted(n for n in ('torch', 'zeroshard.runtime') if n in sys.modules), "
            "m.starts_ranks(['train', '--nproc', '2']), m.starts_ranks(['plan', '--model', 'tiny']), "
            "m.starts_ranks(['plan', 'measure']), m.model_library(['train', '--model=hf:llama-tiny']), "
            "m.model_library(['train', '--model', 'tiny']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True False True ('transformers.modeling_utils',) ()"

"""What every package carries: a version the CLI prints, a license, and a changelog entry per release."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

import zeroshard
from zeroshard.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith(f"zeroshard {zeroshard.__version__} (torch ")
    assert zeroshard.__version__ == PROJECT["version"], "pyproject.toml and zeroshard.__version__ must agree"


def test_license_is_apache_2_and_declared():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text, "the whole license text, not a pointer to it"
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]


def test_changelog_has_one_entry_per_release_and_one_for_this_version():
    entries = re.findall(r"(?m)^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text())
    assert entries, "CHANGELOG.md has no '## X.Y.Z' entry"
    assert len(entries) == len(set(entries)), f"a release has two entries: {entries}"
    assert entries[0] == zeroshard.__version__, "the newest entry is the version being built"
    ordered = sorted(entries, key=lambda v: tuple(int(p) for p in v.split(".")), reverse=True)
    assert entries == ordered, "newest first"

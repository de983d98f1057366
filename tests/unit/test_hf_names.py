"""hf: model names in the config, and the error when transformers is missing (no transformers needed)."""

from __future__ import annotations

import sys
import types

import pytest

from zeroshard.trainer.config import HF_MODEL_NAMES, TrainConfig


@pytest.mark.parametrize("name", HF_MODEL_NAMES)
def test_hf_names_are_valid_models(name: str) -> None:
    assert TrainConfig(model=name).model == name


def test_unknown_hf_name_is_refused_with_the_valid_names() -> None:
    with pytest.raises(ValueError, match="hf:gpt2-tiny"):
        TrainConfig(model="hf:gpt2-huge")


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.models.hf import require_transformers

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        require_transformers()


def test_old_transformers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.models.hf import require_transformers

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.1"))
    with pytest.raises(ImportError, match="transformers>=5, found 4.57.1"):
        require_transformers()

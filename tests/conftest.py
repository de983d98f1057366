"""Suite-wide set-up."""

import importlib.util

import pytest

from zeroshard.trainer.launch import start_rank_server


@pytest.fixture(scope="session", autouse=True)
def rank_server() -> None:
    """The worlds this suite spawns fork from one server per test process (zeroshard/trainer/launch.py).
    Start it with the first test, and with transformers' model core, which many of the worlds
    build models from and which costs each rank seconds of CPU to import on its own. (A fixture,
    so that only processes that run tests start one, not pytest-xdist's controller; and not the
    preload variable, which the suite's `zeroshard` subprocesses would inherit.)"""
    start_rank_server(*(["transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []))

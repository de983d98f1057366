"""Suite-wide set-up."""

import importlib.util

from zeroshard.launch import start_rank_server

# The worlds this suite spawns fork from one server per test process (zeroshard/launch.py). Start
# it now, so that it imports while pytest collects, and with transformers' model core, which many
# of the worlds build models from and which costs each rank seconds of CPU to import on its own.
# (Not through the preload variable: the suite's `zeroshard` subprocesses would inherit it.)
start_rank_server(*(["transformers.modeling_utils"] if importlib.util.find_spec("transformers") else []))

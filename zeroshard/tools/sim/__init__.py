"""Analytical step-time simulator: replays zeroshard's schedule on a modelled cluster.

``hardware`` holds node presets, ``network`` the alpha-beta collective costs, ``workload`` the
per-unit compute and memory of a model, ``step`` the one-step replay and ``sweep`` the tables.
"""

from zeroshard.tools.sim.hardware import Hardware, load_hardware
from zeroshard.tools.sim.network import collective_seconds
from zeroshard.tools.sim.step import StepResult, simulate
from zeroshard.tools.sim.workload import Workload

__all__ = ["Hardware", "load_hardware", "collective_seconds", "StepResult", "simulate", "Workload"]

"""The memory planner: per-rank bytes by component for DDP and ZeRO-1/2/3, a layout recommender, and
a measurement that checks the prediction against a real step. See docs/planner.md."""

from zeroshard.tools.planner.api import plan
from zeroshard.tools.planner.comm import Collective
from zeroshard.tools.planner.optim_probe import OptimStateCost, probe
from zeroshard.tools.planner.result import COMPONENTS, Components, LayoutPlan, Plan

__all__ = ["COMPONENTS", "Collective", "Components", "LayoutPlan", "OptimStateCost", "Plan", "plan", "probe"]

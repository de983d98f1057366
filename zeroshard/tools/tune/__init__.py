"""`zeroshard tune`: choose the layout by useful tokens per second, within a memory budget.

grid (the candidates) -> prune (the planner drops what cannot fit) -> measure (real steps on
spawned ranks, interleaved) -> choose (rank, and the winner as a TOML `zeroshard train` reads).
"""

from zeroshard.tools.tune.grid import Axes, Candidate, candidates, parse_axes
from zeroshard.tools.tune.measure import MeasureSpec, measure
from zeroshard.tools.tune.prune import Prediction, Pruned, predict, prune

__all__ = ["Axes", "Candidate", "MeasureSpec", "Prediction", "Pruned", "candidates", "measure", "parse_axes",
           "predict", "prune"]

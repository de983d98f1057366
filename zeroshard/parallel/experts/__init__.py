"""Expert parallelism for MoE models: experts split over ep ranks, tokens moved by all-to-all.

See docs/expert_parallel.md. ``zs.init(ep=N)`` builds the expert mesh, ``zs.expert_parallel(model)``
splits the experts (before ``zs.shard``), and the engine shards dense params over the dense mesh
and expert params over the expert mesh.
"""

from zeroshard.parallel.experts.apply import ExpertParallelError, check_ep, ep_forwards, expert_parallel, moe_layers
from zeroshard.parallel.experts.plan import LocalExperts, MoELayer, MoELayoutError, declared_ep_plan, moe_layout

__all__ = ["ExpertParallelError", "LocalExperts", "MoELayer", "MoELayoutError", "check_ep", "declared_ep_plan",
           "ep_forwards", "expert_parallel", "moe_layers", "moe_layout"]

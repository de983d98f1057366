"""A param tied across pipeline stages (the GPT's and tied Llama's embedding = LM head).

Megatron's rule: the first stage owns the param; the last stage holds a copy of it, a Parameter
of its own, made from the same initial values. After the step's last microbatch each side's
accumulated full grad is summed over the ``pp_ends`` group (the first and last rank of a pp
group) *before* the stage's own ZeRO reduction, so both stages reduce the grad of the tied whole,
step it with the same optimizer arithmetic and stay bitwise equal. Where stages 2-3 reduced every
microbatch into the grad shard (``pp_grad_reduce="microbatch"``), the two reduced grads are summed
instead (``sum_tied_reduced_grad``), and both sides again hold the same bits. The owner's name is the
param's name in checkpoints; the copy's (``lm_head.weight``) is its alias there, and clipping
counts the copy's squares zero times.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class TiedParam:
    owner_fqn: str
    """The name on the first stage (``tok_emb.weight``): the param's one name in the unsharded model."""
    copy_fqn: str
    """The name on the last stage (``lm_head.weight``)."""
    owner_stage: int
    copy_stage: int


def _stage_of_module(path: str, layout, split, num_stages: int) -> int | None:
    """The virtual stage that keeps the module at ``path`` (None: every stage, or none)."""
    def under(prefix: str) -> bool:
        return path == prefix or path.startswith(prefix + ".")

    if any(under(p) for p in layout.first):
        return 0
    if any(under(p) for p in layout.last):
        return num_stages - 1
    if under(layout.blocks) and path != layout.blocks:
        index = int(path[len(layout.blocks) + 1:].split(".")[0])
        return next(s for s, blocks in enumerate(split.blocks) if index in blocks)
    return None


def find_tied(model: nn.Module, layout, split) -> list[TiedParam]:
    """Params whose places fall on two stages; only the first and the last stage may share one."""
    places: dict[int, list[tuple[int, str]]] = {}
    for mod_name, module in model.named_modules():
        stage = _stage_of_module(mod_name, layout, split, split.num_stages)
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            if stage is not None:
                places.setdefault(id(param), []).append((stage, f"{mod_name}.{attr}" if mod_name else attr))
    tied = []
    for found in places.values():
        stages = sorted({s for s, _ in found})
        if len(stages) < 2:
            continue
        if stages != [0, split.num_stages - 1]:
            raise ValueError(f"param {found[0][1]} is shared by pipeline stages {stages}; only the first and the last "
                             "stage may share a param (a tied embedding and head)")
        owner = next(n for s, n in found if s == 0)
        copy = next(n for s, n in found if s == stages[-1])
        tied.append(TiedParam(owner_fqn=owner, copy_fqn=copy, owner_stage=0, copy_stage=stages[-1]))
    return tied


def untie_copy(stage_module: nn.Module, tied: TiedParam) -> None:
    """Give the last stage its own Parameter for ``tied``, at every place it sits in that stage."""
    original = stage_module.get_parameter(tied.copy_fqn)
    copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
    for module in stage_module.modules():
        for attr, param in list(module._parameters.items()):  # noqa: SLF001 (re-registering a param)
            if param is original:
                module._parameters[attr] = copy  # noqa: SLF001


def sum_tied_grad(grad: torch.Tensor, *, mesh, unit: str) -> None:
    """Sum one side's accumulated full grad with the other's, in place, over ``pp_ends``."""
    from zeroshard.comm import collectives
    from zeroshard.comm.names import Group, Phase

    collectives.all_reduce(grad, group=Group.PP_ENDS, unit=unit, phase=Phase.BACKWARD, mesh=mesh)


def sum_tied_reduced_grad(engine, fqn: str, *, mesh, unit: str) -> None:
    """The same sum when each side's grad is already reduced into its 1/N shard (``pp_grad_reduce=
    "microbatch"``). The two sides' flat groups lay the param out at different offsets, so their
    shards hold different pieces of it: each side rebuilds its whole reduced grad (every shard rank's
    piece in place, summed over ``shard``), the two sides are summed over ``pp_ends``, and each rank
    keeps its own piece. Both all-reduces are of the param's size, once per step."""
    from zeroshard.comm import collectives
    from zeroshard.comm.names import Group, Phase

    piece, first, numel = engine.reduced_grad_piece(fqn)
    whole = torch.zeros(numel, dtype=piece.dtype, device=piece.device)
    whole[first:first + piece.numel()] = piece
    collectives.all_reduce(whole, group=Group.SHARD, unit=unit, phase=Phase.BACKWARD, mesh=mesh)
    collectives.all_reduce(whole, group=Group.PP_ENDS, unit=unit, phase=Phase.BACKWARD, mesh=mesh)
    piece.copy_(whole[first:first + piece.numel()])

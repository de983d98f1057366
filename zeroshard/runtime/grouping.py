"""How the engine groups params: consecutive units merged into reduction buckets of about
``bucket_bytes`` (stages 0-2; the planner and the step simulator apply the same rule), and each
unit's params split into flat groups of one dtype, trainability and mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import torch

from zeroshard.comm.mesh import Mesh
from zeroshard.runtime.expert_placement import expert_mesh_of
from zeroshard.runtime.flat import FlatGroup, GroupConfig
from zeroshard.runtime.layout import decay_first
from zeroshard.runtime.wrap import ParamRef, UnitSpec


def split_groups(name: str, refs: list[ParamRef], config: GroupConfig) -> list[FlatGroup]:
    """One flat group per (dtype, trainable, mesh) so each buffer has a single dtype, grad policy
    and set of ranks: expert params (zeroshard/runtime/expert_placement.py) go to a group on their expert
    mesh, sharded over the ranks that hold the same experts. Inside a group, decaying params come
    first (layout.py's ``decay_first``)."""
    keyed: dict[tuple, list[ParamRef]] = {}
    meshes: dict[str, Mesh] = {}
    for ref in refs:
        mesh: Mesh = expert_mesh_of(ref.param) or config.mesh
        if mesh is not config.mesh and mesh is not config.mesh.experts:
            raise ValueError(f"{ref.fqn} was split by zs.expert_parallel for the mesh of {mesh.name!r}, but zs.shard "
                             f"got mesh {config.mesh.name!r}; pass the same mesh= to both")
        meshes[mesh.name] = mesh
        keyed.setdefault((ref.param.dtype, ref.param.requires_grad, mesh.name), []).append(ref)
    return [FlatGroup(unit=name, refs=decay_first(group_refs, _name_and_shape), trainable=trainable,
                      config=config if meshes[mesh] is config.mesh else dataclasses.replace(config, mesh=meshes[mesh]))
            for (dtype, trainable, mesh), group_refs in keyed.items()]


def _name_and_shape(ref: ParamRef) -> tuple[str, torch.Size]:
    return ref.fqn, ref.param.shape


def reduction_buckets(specs: list[UnitSpec], bucket_bytes: int) -> list[list[UnitSpec]]:
    """Merge consecutive units (in expected backward order) into buckets of about ``bucket_bytes``
    of params: the units of stages 0-2. The planner's inventory calls it too, so both bucket alike."""
    return merge_in_order(specs, lambda spec: sum(r.param.numel() * r.param.element_size() for r in spec.refs),
                          bucket_bytes)


T = TypeVar("T")


def merge_in_order(items: list[T], nbytes: Callable[[T], float], bucket_bytes: float) -> list[list[T]]:
    """Consecutive items merged until a bucket reaches ``bucket_bytes`` (the last may be smaller):
    the bucketing rule itself, which the step simulator also replays on sizes alone."""
    buckets: list[list[T]] = []
    current: list[T] = []
    size = 0.0
    for item in items:
        current.append(item)
        size += nbytes(item)
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0.0
    if current:
        buckets.append(current)
    return buckets

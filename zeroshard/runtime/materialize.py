"""Meta-device initialisation: materialise only this rank's shards, bitwise equal to a plain build.

[Note: seed-exact sharded init]
A model built under ``torch.device("meta")`` has shapes but no values. ``zs.shard`` allocates only
what the stage keeps (the 1/N shard at stage 3) and then *replays the model's own init code* on the
meta model under a ``TorchFunctionMode``. Every in-place call that writes a param (``normal_``,
``nn.init.trunc_normal_``, ``p.data.zero_()``, ...) is re-run on a temporary full-size real tensor
of that one param, with the same generator, shape and dtype a single-process build would use; the
rank then keeps its slice and drops the tensor (for a tensor-parallel DTensor param the full
tensor is cut to this tp rank's part first, see ``FlatGroup.load_param_values``; a split expert
param is drawn at its stacked shape one expert at a time, keeping this rank's experts, see
zeroshard/runtime/expert_init.py). Because the
replay consumes the global RNG in the same order and amounts as ``torch.manual_seed(s); Model()``,
the global tensors are bitwise equal to the single-process init at every world size and stage.

Cost: every rank generates every param once (the same compute as a plain init), but holds at most
its shards plus one full param. The init code to replay is ``model.init_weights()`` when the model
has one, otherwise every module's ``reset_parameters()`` in module order; pass ``init_fn`` to
``zs.shard`` for anything else. The model must be seeded identically on every rank. Limits: an init
that reads one param while writing another (copying a tied weight, say) is refused with a message,
and ``trunc_normal_``/``orthogonal_``/``dirac_``/``sparse_`` are caught only when called as
``nn.init.<name>`` (torch makes them no-ops on meta tensors, so they are wrapped by name).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from zeroshard.runtime import expert_init
from zeroshard.runtime.lazy_dtensor import is_dtensor

if TYPE_CHECKING:  # the engine calls this module from Engine.materialize
    from zeroshard.runtime.engine import Engine


# Init calls that overwrite every element, so a param can be re-initialised after it was flushed.
_OVERWRITES = {
    "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "trunc_normal_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "eye_", "dirac_", "sparse_",
}


@contextlib.contextmanager
def meta_init():
    """Build a model without allocating it: ``with zs.meta_init(): model = GPT(cfg)``."""
    with torch.device("meta"):
        yield


def reset_parameters(model: nn.Module) -> None:
    """What torch layers do while being constructed: each module's reset, in module order."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def reset_then_init_weights(model: nn.Module) -> None:
    """For models whose layers draw their default init while being built and whose
    ``init_weights()`` then overwrites it (the Hugging Face pattern): both draws, in that order."""
    reset_parameters(model)
    init: Callable[[], None] = getattr(model, "init_weights")  # HF models have one (see the docstring)
    init()


def default_init_fn(model: nn.Module) -> None:
    """``init_weights()`` alone if the model has one (its layers must not draw random numbers
    before it, as zeroshard's GPT guarantees by building them on meta), else every reset."""
    init = getattr(model, "init_weights", None)
    if callable(init):
        init()
    else:
        reset_parameters(model)


def _storage_key(t: torch.Tensor) -> int:
    # Meta storages all have data_ptr 0, so only the storage object's own handle tells them apart.
    return t.untyped_storage()._cdata  # noqa: SLF001 (no public API)


class _Target:
    """One meta param and where its values go."""

    def __init__(self, fqn: str, meta: torch.Tensor, sinks: list, rows: tuple[int, int] | None = None) -> None:
        self.fqn = fqn
        self.meta = meta
        self.sinks = sinks  # (flat group, slot index) pairs
        self.rows = rows  # a split expert param: (first, count) of the dim-0 rows this rank keeps
        self.done = False

    def kept(self, values: torch.Tensor) -> torch.Tensor:
        """What of the whole ``values`` this rank's sinks take (its rows, for an expert param)."""
        return values if self.rows is None else values[self.rows[0]:self.rows[0] + self.rows[1]]


class _InitReplay(TorchFunctionMode):
    def __init__(self, targets: dict[int, _Target], device: torch.device) -> None:
        super().__init__()
        self.targets = targets
        self.device = device
        self.current: _Target | None = None
        self.real: torch.Tensor | None = None
        self.real_is_block = False  # self.real holds only current's kept rows (expert_init.py)
        self.peak_temp_bytes = 0
        self.peak_expert_temp_bytes = 0  # the same, over split expert params only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        leaves, _ = tree_flatten((args, kwargs))
        touched = [self.targets.get(_storage_key(t)) for t in leaves
                   if isinstance(t, torch.Tensor) and t.is_meta and t.untyped_storage() is not None]
        touched = [t for t in touched if t is not None]
        if not touched or not name.endswith("_") or name.startswith("__"):
            return func(*args, **kwargs)  # shape queries, views and ops on non-params stay on meta
        written = touched[0]
        if len({id(t) for t in touched}) > 1:
            others = ", ".join(sorted({t.fqn for t in touched[1:]}))
            raise ValueError(f"init code {name} on {written.fqn} also reads {others}; meta-device init replays "
                             "one param at a time, so initialise params independently (or shard a real model)")
        return self.run_on_real(written, func, name, args, kwargs)

    def run_on_real(self, written: _Target, func, name: str, args, kwargs):
        if not args and "tensor" in kwargs:  # nn.init.* hands torch-function modes its tensor by keyword
            kwargs = dict(kwargs)
            args = (kwargs.pop("tensor"),)
        if written.rows is not None and (written is not self.current or self.real_is_block) and \
                expert_init.by_rows(name, written.meta, args, self.device):
            self._materialise(written, name, block=True)
            assert self.real is not None
            expert_init.run_by_rows(func, name, self.real, written.rows[0], written.meta.shape[0], args, kwargs)
            return args[0]
        if written is self.current and self.real_is_block:
            if name not in _OVERWRITES:
                raise ValueError(f"init code runs {name} on {written.fqn}, a split expert param drawn one expert "
                                 "at a time; initialise it with normal_, uniform_, trunc_normal_ or a fill, or "
                                 "build the model with values")
            self.current, self.real = None, None  # overwritten whole: drop the rows drawn so far
        self._materialise(written, name)
        real_args, real_kwargs = tree_map(self._to_real, (args, kwargs))
        func(*real_args, **real_kwargs)
        return args[0] if args else None

    def target_of(self, value) -> _Target | None:
        if isinstance(value, torch.Tensor) and value.is_meta:
            return self.targets.get(_storage_key(value))
        return None

    def _to_real(self, value):
        if isinstance(value, torch.Tensor) and value.is_meta and self.targets.get(_storage_key(value)) is self.current:
            return self.real.as_strided(value.shape, value.stride(), value.storage_offset())
        return value

    def _materialise(self, target: _Target, op: str, block: bool = False) -> None:
        if target is self.current:
            return
        self.flush()
        if target.done and op not in _OVERWRITES:
            raise ValueError(f"init code runs {op} on {target.fqn} after other params were initialised; "
                             "meta-device init replays one param at a time, so finish each param's init "
                             "before moving to the next")
        self.current = target
        shape = target.meta.shape
        if block:
            assert target.rows is not None
            shape = torch.Size((target.rows[1], *shape[1:]))
        self.real = torch.empty(shape, dtype=target.meta.dtype, device=self.device)
        self.real_is_block = block
        # (a block's replay also holds one scratch row)
        temp = self.real.numel() + (self.real[0].numel() if block and self.real.shape[0] else 0)
        self.peak_temp_bytes = max(self.peak_temp_bytes, temp * self.real.element_size())
        if target.rows is not None:
            self.peak_expert_temp_bytes = max(self.peak_expert_temp_bytes, temp * self.real.element_size())

    def flush(self) -> None:
        if self.current is None:
            return
        assert self.real is not None
        values = self.real if self.real_is_block else self.current.kept(self.real)
        for group, index in self.current.sinks:
            group.load_param_values(index, values)
        self.current.done = True
        self.current, self.real = None, None


# These nn.init functions return early on meta tensors without dispatching to torch-function
# modes, so the replay wraps them by name for the duration of the init call.
_META_SHORTCUT_INITS = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _route_meta_shortcuts(replay: _InitReplay):
    originals = {name: getattr(nn.init, name) for name in _META_SHORTCUT_INITS}

    def routed(name, original):
        def call(tensor, *args, **kwargs):
            target = replay.target_of(tensor)
            if target is None:
                return original(tensor, *args, **kwargs)
            return replay.run_on_real(target, original, name, (tensor, *args), kwargs)
        return call

    for name, original in originals.items():
        setattr(nn.init, name, routed(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def _whole_meta(param: nn.Parameter) -> nn.Parameter:
    """The param the init code writes: a tensor-parallel (DTensor) param is replayed at its full
    shape, as a plain build draws it; ``load_param_values`` then keeps this tp rank's part. A split
    expert param is replayed at its stacked shape (every expert), this rank keeping its rows."""
    split = expert_init.rows_kept(param)
    if split is not None:
        return nn.Parameter(torch.empty(split[0], dtype=param.dtype, device="meta"),
                            requires_grad=param.requires_grad)
    if not is_dtensor(param):
        return param
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)


def materialize(model: nn.Module, engine: Engine, init_fn: Callable[[nn.Module], None] | None,
                require_all: bool = True) -> dict:
    """Fill the engine's buffers by replaying ``init_fn`` (see the note above); return stats."""
    stats = replay_into(model, [engine], init_fn, require_all=require_all)
    return {"path": "meta" if require_all else "meta (values left for a checkpoint load)", **stats}


def materialize_stages(model: nn.Module, engines: list[Engine], init_fn: Callable[[nn.Module], None] | None,
                       aliases: dict[str, str]) -> dict:
    """Fill the engines of this rank's pipeline stages by replaying the *whole* model's init.

    ``model`` is the whole meta model the stages were cut from (they hold its own modules). Every
    param outside the stages is drawn too, on a temporary full tensor that is dropped at once, so
    the global RNG advances exactly as in a plain build and the stages' values are bitwise that
    build's; only the stages' shards are ever kept. ``aliases`` maps a stage's own copy of a tied
    param (the last stage's head, zeroshard/parallel/pipeline/tied.py) to the param it copies: the copy
    takes the values drawn for it, as a plain build's tied head shares them."""
    stats = replay_into(model, engines, init_fn, require_all=True, aliases=aliases, draw_rest=True)
    return {"path": "meta", **stats}


def replay_into(model: nn.Module, engines: list[Engine], init_fn: Callable[[nn.Module], None] | None, *,
                require_all: bool, aliases: dict[str, str] | None = None, draw_rest: bool = False) -> dict:
    """Replay ``init_fn(model)`` into ``engines``' buffers. ``aliases``: param name -> the name whose
    draw it takes. ``draw_rest``: the model's meta params that no engine holds are drawn and dropped."""
    aliases = aliases or {}
    named = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[int, _Target] = {}
    refs = [(group, index, ref) for engine in engines for group in engine.groups for index, ref in enumerate(group.refs)]
    whole = {id(ref.param): _whole_meta(ref.param) for _, _, ref in refs}
    for group, index, ref in refs:
        fqn = aliases.get(ref.fqn, ref.fqn)
        meta = named[fqn] if fqn != ref.fqn else whole[id(ref.param)]
        split = expert_init.rows_kept(ref.param)
        target = targets.setdefault(_storage_key(meta), _Target(fqn, meta, [], split and split[1]))
        target.sinks.append((group, index))
    if draw_rest:
        for fqn, param in named.items():
            if param.is_meta and id(param) not in whole:
                if expert_init.rows_kept(param) is not None or is_dtensor(param):
                    # Another stage's split experts (at the stacked shape) or tensor-parallel param
                    # (at its full shape): drawn whole, as a plain build draws them, then dropped.
                    param = _whole_meta(param)
                    prefix, _, attr = fqn.rpartition(".")
                    model.get_submodule(prefix)._parameters[attr] = param  # noqa: SLF001 (as below)
                targets.setdefault(_storage_key(param), _Target(fqn, param, []))
    # The replay needs the meta params registered on the modules, where the init code finds them.
    for _, _, ref in refs:
        for module, attr in ref.places:
            module._parameters[attr] = whole[id(ref.param)]  # noqa: SLF001 (swaps a registered param; torch has no public API)
    replay = _InitReplay(targets, engines[0].mesh.device)
    with replay, _route_meta_shortcuts(replay), torch.no_grad():
        (init_fn or default_init_fn)(model)
    replay.flush()
    for engine in engines:
        for unit in engine.units:
            for group in unit.groups:
                group.register(unsharded=not engine.policy.shard_params)
    missing = sorted(t.fqn for t in targets.values() if t.sinks and not t.done)
    if missing and require_all:
        raise ValueError(f"the init code never wrote {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                         "give zs.shard an init_fn that initialises every param")
    for engine in engines:
        _check_buffers(engine.model)
        engine.sync_params()
    return {"peak_temp_bytes": replay.peak_temp_bytes, "peak_expert_temp_bytes": replay.peak_expert_temp_bytes}


def _check_buffers(model: nn.Module) -> None:
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        raise ValueError(f"buffers {meta[:5]} are still on the meta device after init; build buffers "
                         "outside torch.device('meta') or set them in the model's init_weights()")

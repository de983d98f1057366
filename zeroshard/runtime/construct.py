"""Constructor replay: build any model for real, keep only this rank's shards, hold one param at a time.

[Note: constructor replay]
``zs.shard(lambda: Model(cfg), stage=3)`` runs the constructor itself, on real tensors, in the
order a plain build runs it, so every random draw happens at full size and in order, and the RNG
ends where ``torch.manual_seed(s); Model(cfg)`` leaves it. Nothing needs an ``init_fn``: the
layers' default draws, a model-level ``self.apply(self._init_weights)`` that overwrites them,
constants set in ``__init__`` and weights tied after the fact all run as written.

What keeps memory down is that a param's value is *reproducible* from a short recipe. Each param is
tracked from the moment it is registered on a module (torch's global parameter-registration hook).
An op that overwrites every element of its storage (``normal_``, ``kaiming_uniform_``, ``zero_``,
...) starts a new recipe; later in-place ops on it (``w.data[pad].zero_()``, the ops inside
``trunc_normal_``) are appended. Each op is stored with the state of the generator it draws from,
taken just before it ran. While the init code works on one param, that param is real; as soon as
an op touches another one, its storage is resized to zero bytes (the tensor object, its views and
every module that holds it stay valid). When an op later needs its value (a read, a partial write),
the recipe is replayed into the regrown storage with the generator set to each op's saved state
and restored afterwards, so the replay is bitwise what was drawn and the RNG stream is untouched.

When the constructor returns, the params are swapped for meta params, ``zs.shard`` lays out the
flat buffers, and each param is replayed once more, one at a time, copied into whatever slice of
it this rank keeps, and freed. Peak memory is the rank's shards plus one full param, plus any param
whose value cannot be replayed: one written by an op that reads another tensor (``copy_`` from a
temporary, a param computed out of place such as ``Parameter(torch.ones(d))``). Those are held
whole until the end, as a plain build would hold them; ``init_stats["held_whole_bytes"]`` counts them.
Buffers are built for real, exactly as written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zeroshard.runtime.lazy_dtensor import is_dtensor

# Ops that overwrite every element they write, whatever was there before.
_OVERWRITES = {
    "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "trunc_normal_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "eye_", "dirac_", "sparse_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "bernoulli_",
}
# Ops that read only shape, dtype or device, never the storage: safe on a param whose storage is empty.
_NO_DATA = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "element_size", "__len__", "__hash__", "get_device", "untyped_storage",
    "requires_grad_", "retain_grad", "register_hook", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
}
# Ops that make a view (torch checks a view against its storage's size, so the storage must be real).
# The init code usually writes through the view next, so the param is kept real for it.
_VIEWS = {
    "view", "view_as", "t", "transpose", "permute", "narrow", "select", "unsqueeze", "squeeze", "expand",
    "expand_as", "detach", "as_strided", "chunk", "split", "unbind", "unflatten", "movedim", "reshape", "flatten",
    "__getitem__", "diagonal", "unfold", "view_as_real", "T.__get__", "mT.__get__", "H.__get__", "mH.__get__",
    "real.__get__", "imag.__get__",
}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _storage_key(t: torch.Tensor) -> int:
    # A storage resized to zero bytes has data_ptr 0, so only the storage object's handle identifies it.
    return t.untyped_storage()._cdata  # noqa: SLF001 (no public API)


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property such as Tensor.data: name the property
        return f"{getattr(getattr(func, '__self__', None), '__name__', '')}.{name}"
    return name


def _generator_of(device: torch.device, args, kwargs) -> torch.Generator | None:
    """The generator an op on ``device`` draws from: its own ``generator=``, else the device default."""
    given = kwargs.get("generator") or next((a for a in args if isinstance(a, torch.Generator)), None)
    if given is not None:
        return given
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    defaults = getattr(module, "default_generators", None)
    if not defaults:
        return None
    index = device.index if device.index is not None else module.current_device()  # type: ignore[union-attr]
    return defaults[index]


def _covers(view: torch.Tensor, nbytes: int) -> bool:
    """Does writing every element of ``view`` write every byte of its storage?"""
    if view.storage_offset() != 0 or view.numel() * view.element_size() != nbytes:
        return False
    expected = 1  # dense and non-overlapping: sorted by stride, each stride is the product of smaller dims
    for stride, size in sorted((s, n) for s, n in zip(view.stride(), view.shape) if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclasses.dataclass
class _Op:
    func: Callable
    args: tuple
    kwargs: dict
    generator: torch.Generator | None
    state: torch.Tensor | None

    def run(self) -> None:
        if self.generator is not None and self.state is not None:
            self.generator.set_state(self.state)
        self.func(*self.args, **self.kwargs)


class _Entry:
    """One param storage: real, or emptied with the recipe that rebuilds it (``recipe`` None: held whole)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()  # keeps the storage (and its handle) alive
        self.nbytes = tensor.untyped_storage().nbytes()
        self.recipe: list[_Op] | None = None
        self.real = True

    def release(self) -> None:
        if self.real and self.recipe is not None:
            self.tensor.untyped_storage().resize_(0)
            self.real = False

    def grow(self) -> None:
        if not self.real:
            self.tensor.untyped_storage().resize_(self.nbytes)
            self.real = True

    def realise(self) -> None:
        """Regrow the storage and replay the recipe into it, leaving every generator as it was."""
        if self.real:
            return
        assert self.recipe is not None, "only a param with a recipe is ever emptied"
        self.grow()
        generators = {id(op.generator): op.generator for op in self.recipe if op.generator is not None}
        saved = {key: g.get_state() for key, g in generators.items()}
        try:
            with torch.no_grad():
                for op in self.recipe:
                    op.run()
        finally:
            for key, g in generators.items():
                g.set_state(saved[key])


class _Recorder(TorchFunctionMode):
    """Runs the constructor's ops for real, keeping at most one tracked param real at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[int, _Entry] = {}
        self.current: _Entry | None = None
        self.peak_real_bytes = 0

    def track(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        # This hook runs inside the build, so its own tensor calls pass through the mode: look the
        # storage up first, so that registering a tied param does not touch the tracked one.
        if param is not None and not param.is_meta:
            key = _storage_key(param)
            if key not in self.entries:
                self.entries[key] = _Entry(param)

    def entry_of(self, value) -> _Entry | None:
        if isinstance(value, torch.Tensor) and not value.is_meta:
            return self.entries.get(_storage_key(value))
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        hits = [(t, e) for t in leaves if (e := self.entry_of(t)) is not None]
        if not hits or self._needs_no_data(name, args):
            result = func(*args, **kwargs)
            if name == "data.__set__" and hits:  # the param now points at a new storage: track that one
                self.track(None, "", args[0])  # type: ignore[arg-type]
            return result
        written = self._written(name, args, kwargs)
        target = self.entry_of(written)
        reads = {id(e): e for t, e in hits if e is not target}
        for entry in reads.values():
            entry.realise()
        if target is None:
            result = func(*args, **kwargs)
            if name in _VIEWS and len(reads) == 1:
                self._make_current(next(iter(reads.values())))
        else:
            result = self._write(target, written, func, name, args, kwargs, others=[t for t in leaves if t is not written])
        for entry in reads.values():
            if entry is not self.current:
                entry.release()
        return result

    @staticmethod
    def _needs_no_data(name: str, args) -> bool:
        # Property getters (.data, .shape, .T, ...): .data is an alias that torch does not check
        # against the storage, the others are metadata or are caught as views when used.
        return name in _NO_DATA or (name.endswith((".__get__", ".__set__")) and name not in _VIEWS)

    def _make_current(self, entry: _Entry) -> None:
        if entry is not self.current:
            if self.current is not None:
                self.current.release()
            self.current = entry

    @staticmethod
    def _written(name: str, args, kwargs) -> torch.Tensor | None:
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor):
            return out
        if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
            first = args[0] if args else kwargs.get("tensor")
            return first if isinstance(first, torch.Tensor) else None
        return None

    def _write(self, entry: _Entry, view: torch.Tensor, func, name: str, args, kwargs, others: list) -> Any:
        self._make_current(entry)
        overwrite = name in _OVERWRITES and _covers(view, entry.nbytes)
        if overwrite:
            entry.grow()  # the old values do not matter
        else:
            entry.realise()
        self.peak_real_bytes = max(self.peak_real_bytes, sum(e.nbytes for e in self.entries.values() if e.real))
        generator = _generator_of(view.device, args, kwargs)
        op = _Op(func, args, kwargs, generator, generator.get_state() if generator is not None else None)
        result = func(*args, **kwargs)
        # A recipe may refer only to this param's own storage (any other tensor could change later),
        # and needs the generator the op drew from.
        replayable = generator is not None and all(_storage_key(t) == _storage_key(view) for t in others)
        if overwrite:
            entry.recipe = [op] if replayable else None
        elif entry.recipe is not None:
            entry.recipe = entry.recipe + [op] if replayable else None
        return result

    def restore(self) -> None:
        """Give every param its values back after the build failed: a traceback's locals may be
        printed, and printing a tensor whose storage is empty crashes the process."""
        self.current = None
        for entry in self.entries.values():
            entry.realise()
            entry.recipe = None

    def finish(self) -> None:
        if self.current is not None:
            self.current.release()
            self.current = None


@dataclasses.dataclass
class BuiltModel:
    """A model built by ``record_build``: params on meta; ``values`` maps each meta param's id to the
    recorded storage and the original param (a view of it)."""

    model: nn.Module
    values: dict[int, tuple[_Entry, torch.Tensor]]
    peak_real_bytes: int

    def move_buffers(self, device: torch.device) -> None:
        """Buffers to the mesh's device (a buffer registered in two places stays one tensor)."""
        moved: dict[int, torch.Tensor] = {}
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.device != device:
                    # Assigning to a registered buffer's name keeps it registered, persistence and all.
                    setattr(module, name, moved.setdefault(id(buf), buf.to(device)))

    def load(self, engine) -> dict:
        """Replay each param, one at a time, into the slices of it this rank keeps; return stats."""
        by_entry: dict[int, list[tuple[Any, int, torch.Tensor]]] = {}
        entries: dict[int, _Entry] = {}
        for group in engine.groups:
            for index, ref in enumerate(group.refs):
                entry, view = self.values[id(ref.param)]
                entries[id(entry)] = entry
                by_entry.setdefault(id(entry), []).append((group, index, view))
        self.values.clear()
        held = sum(e.nbytes for e in entries.values() if e.recipe is None)
        # The generator states the recipes keep (5 KB per op on CPU), alive until their param loads.
        recipe = sum(op.state.nbytes for e in entries.values() for op in e.recipe or [] if op.state is not None)
        largest = max((e.nbytes for e in entries.values()), default=0)
        with torch.no_grad():
            for key in list(entries):
                entry = entries.pop(key)
                entry.realise()
                for group, index, view in by_entry.pop(key):
                    group.load_param_values(index, view)
                entry.release()  # a param held whole is freed as its last reference goes here
        return {"path": "constructor", "peak_temp_bytes": max(largest, self.peak_real_bytes),
                "held_whole_bytes": held, "recipe_bytes": recipe}


def record_build(build: Callable[[], nn.Module]) -> BuiltModel:
    """Run ``build()`` for real under the recorder; return the model with meta params and the recipes."""
    recorder = _Recorder()
    handle = register_module_parameter_registration_hook(recorder.track)
    try:
        with recorder:
            model = build()
    except BaseException:
        recorder.restore()
        raise
    finally:
        handle.remove()
    recorder.finish()
    if not isinstance(model, nn.Module):
        raise ValueError(f"the build callable returned {type(model).__name__}, not an nn.Module; "
                         "pass zs.shard a function that returns the model, e.g. lambda: MyModel(cfg)")
    values: dict[int, tuple[_Entry, torch.Tensor]] = {}
    metas: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if is_dtensor(param):  # its flat buffer would be laid out unsplit
                raise ValueError("the build function returned a tensor-parallel model; build it under zs.meta_init(), "
                                 "call zs.tensor_parallel(model), then zs.shard(model)")
            if param.is_meta:
                raise ValueError(f"build() left param {name!r} of {type(module).__name__} on the meta device; "
                                 "the build callable must build the model for real (drop zs.meta_init inside it)")
            if id(param) not in metas:
                entry = recorder.entries.get(_storage_key(param)) or _Entry(param)  # untracked: held whole
                meta = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                    requires_grad=param.requires_grad)
                metas[id(param)], values[id(meta)] = meta, (entry, param.detach())
            setattr(module, name, metas[id(param)])
        for buf in module.buffers(recurse=False):
            shared = recorder.entries.get(_storage_key(buf)) if not buf.is_meta else None
            if shared is not None:  # a buffer that shares a param's storage keeps real values
                shared.realise()
                shared.recipe = None
    return BuiltModel(model, values, recorder.peak_real_bytes)

"""Every tensor the runtime hands a collective outside the hot path is on the group's device.

NCCL refuses host tensors, and a CPU-only suite never notices a CPU tensor handed to a collective:
gloo takes both. So these tests run the code under torch's FakeTensorMode with the mesh on "cuda"
(fake CUDA tensors need no GPU, and a CPU/CUDA mix in one op raises there as on a GPU) and record
the device of every tensor that reaches ``zeroshard.comm.collectives``. Numbers are the CPU suite's
business (tests/distributed); these check devices.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from zeroshard.comm import collectives
from zeroshard.comm import mesh as meshes

CUDA = torch.device("cuda", 0)


class Seen(Exception):
    """Raised by the spy at the first collective: what follows is a host read of fake data."""


def fake_mesh(world: int = 2, device: torch.device = CUDA, **extra) -> SimpleNamespace:
    return SimpleNamespace(device=device, rank=0, world=world, backend="nccl", pp_rank=0, name="default",
                           group_size=lambda group: world, **extra)


def spy_collectives(monkeypatch, *, stop: bool) -> list[tuple[str, str, list[torch.device]]]:
    """The devices of each collective's tensors, as (op, phase, [devices]). With ``stop`` the spy
    raises `Seen` at the first; else it moves nothing (fake tensors hold no data) and goes on."""
    seen: list[tuple[str, str, list[torch.device]]] = []

    def spy(op):
        def call(*tensors, phase="", **kwargs):
            seen.append((op, str(phase), [t.device for t in tensors if isinstance(t, torch.Tensor)]))
            if stop:
                raise Seen(op)
        return call

    for op in ("all_gather", "all_reduce", "reduce_scatter", "broadcast"):
        monkeypatch.setattr(collectives, op, spy(op))
    return seen


@pytest.fixture
def devices(monkeypatch):
    return spy_collectives(monkeypatch, stop=True)


@pytest.fixture
def all_devices(monkeypatch):
    return spy_collectives(monkeypatch, stop=False)


def test_profiler_summary_gathers_on_the_group_device(monkeypatch, devices):
    from zeroshard.observing.profile.step import StepProfiler

    monkeypatch.setattr(meshes, "_MESH", fake_mesh())
    prof = StepProfiler(rank=0, world=2, device=CUDA, batch=2, tokens_per_step=8)
    prof.steps = [{"step_s": 1.0, "comm_busy_s": 0.1, "comm_exposed_s": 0.05}]
    with FakeTensorMode(), pytest.raises(Seen):
        prof.summary()
    assert devices == [("all_gather", "metrics", [CUDA, CUDA])]


def test_desync_check_gathers_on_the_group_device(monkeypatch, devices):
    from zeroshard.observing import desync
    monkeypatch.setattr(meshes, "_MESH", fake_mesh())
    with FakeTensorMode(), pytest.raises(Seen):
        desync.check(3)
    assert devices == [("all_gather", "desync", [CUDA, CUDA])]


def offloaded_groups(n: int = 2) -> list[SimpleNamespace]:
    """Flat groups as ``--offload cpu`` leaves them on a GPU: masters and grad shards on the host."""
    return [SimpleNamespace(grad_shard=torch.ones(6), shard=torch.ones(6)) for _ in range(n)]


def test_clip_scales_host_grad_shards_by_a_host_coefficient(monkeypatch):
    from zeroshard.runtime import clip

    with FakeTensorMode():
        groups = offloaded_groups() + [SimpleNamespace(grad_shard=torch.ones(6, device=CUDA))]
        # clip_grad_norm_'s scaling, with the norm where the mesh computes it (the device):
        # before, "found at least two devices, cpu and cuda:0"
        clip.scale_grad_shards(groups, torch.full((), 4.0, device=CUDA), 1.0)
        assert [g.grad_shard.device.type for g in groups] == ["cpu", "cpu", "cuda"]


def test_pipeline_clip_scales_host_grad_shards_by_a_host_coefficient(monkeypatch):
    from zeroshard.parallel.pipeline import runtime

    with FakeTensorMode():
        groups = offloaded_groups()
        monkeypatch.setattr(runtime, "get_engine", lambda module: SimpleNamespace(trainable_groups=groups))
        pipeline = SimpleNamespace(modules=[object()], grad_norm=lambda: torch.full((), 4.0, device=CUDA))
        norm = runtime.Pipeline.clip_grad_norm_(pipeline, 1.0)
        assert norm.device == CUDA and [g.grad_shard.device.type for g in groups] == ["cpu", "cpu"]


class SliceWithoutGuard(TorchFunctionMode):
    """A CPU-only torch takes a CUDA device guard in ``Tensor.__getitem__``'s binding, before any op
    runs, and fails on a fake CUDA tensor; a basic slice is sent to its aten op instead (same view)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[1], slice) and args[1].step is None:
            t, index = args
            start, stop, _ = index.indices(t.shape[0])
            return torch.ops.aten.slice.Tensor(t, 0, start, max(start, stop))
        return func(*args, **(kwargs or {}))


def offloaded_flat_group(mesh) -> SimpleNamespace:
    slot = SimpleNamespace(offset=0, end=8, shape=(2, 4))
    return SimpleNamespace(shards=2, shard=torch.ones(4), mesh=mesh, unit="blocks.0", master_dtype=torch.float32,
                           layout=SimpleNamespace(numel=8, slots=[slot]), refs=[SimpleNamespace(aliases=["w"])],
                           tp_specs=[None])


def test_full_state_dict_gathers_host_masters_through_the_device(monkeypatch, all_devices):
    from zeroshard.runtime import state

    model = torch.nn.Linear(1, 1)  # only its (absent) buffers are read
    with FakeTensorMode(allow_non_fake_inputs=True), SliceWithoutGuard():
        group = offloaded_flat_group(fake_mesh())
        monkeypatch.setattr(state, "get_engine", lambda m: SimpleNamespace(groups=[group]))
        out = state.full_state_dict(model)
        whole = state.gathered_master(group, state.Phase.EXPORT)  # what HF export gathers, group by group
    assert all_devices == [("all_gather", "state_dict", [CUDA, CUDA]), ("all_gather", "export", [CUDA, CUDA])]
    # The copy is made where the masters live: a whole model's fp32 values stay off the device.
    assert out["w"].device.type == "cpu" and out["w"].shape == (2, 4) and whole.device == CUDA


def test_pipeline_state_dict_pickles_host_tensors_only(monkeypatch):
    from zeroshard.parallel.pipeline import runtime

    pickled: list[torch.device] = []

    def all_gather_object(obj, **kwargs):
        pickled.extend(v.device for v in obj.values())
        return [obj, {"other.w": torch.zeros(2)}]

    monkeypatch.setattr(collectives, "all_gather_object", all_gather_object)
    with FakeTensorMode(allow_non_fake_inputs=True):
        monkeypatch.setattr(runtime, "full_state_dict", lambda module: {"w": torch.ones(2, 4, device=CUDA)})
        pipeline = SimpleNamespace(modules=[object()], mesh=fake_mesh())
        out = runtime.Pipeline.full_state_dict(pipeline)
    assert pickled == [torch.device("cpu")]  # before: cuda:0, unpickled onto cuda:0 on every receiver
    assert sorted(out) == ["other.w", "w"] and {v.device.type for v in out.values()} == {"cpu"}


def test_calibration_times_collectives_on_the_group_device_and_waits_for_them(monkeypatch, all_devices):
    from zeroshard.tools.sim import calibrate

    class Stream:  # a CPU build has no CUDA stream: count the waits in the spy's order instead
        def synchronize(self) -> None:
            all_devices.append(("sync", "", []))

    monkeypatch.setattr(meshes, "_MESH", fake_mesh())
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: Stream())
    times = iter(range(1000))
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: float(next(times)))
    with FakeTensorMode():
        points = calibrate.time_rank("all_gather", (1 << 10,), repeats=2)  # zs.init() finds the fake mesh
    # barrier, gather, wait for the device, read the clock: three times (the first pays setup).
    assert [op for op, _, _ in all_devices] == ["all_reduce", "all_gather", "sync"] * 3
    assert {d for op, _, ds in all_devices if op == "all_gather" for d in ds} == {CUDA}
    assert points == [(1024.0, 1.0)]

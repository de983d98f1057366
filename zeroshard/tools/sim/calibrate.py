"""Fit the simulator's hardware model to this machine: collectives, per-unit compute, contention.

Each collective size is timed through zeroshard.comm.collectives (so it runs the way the runtime
runs it: on gloo, reduce-scatter and all-gather fan out into one rooted reduce or broadcast per
slice, the same transport as the stage 2-3 per-piece reduction), the median of a few repeats after
a barrier; then t = steps * alpha + bus_bytes / bw is fitted by least squares, with steps and bus
bytes from the ring formulas in ``network``.

``calibrate_hardware`` does that for every collective the replay uses, at each world size, and on
the same ranks times one block's forward and backward, the model's root unit (the whole model's
forward and backward less its blocks), an AdamW step per parameter, and the contention between
compute and communication (blocks' forward and backward timed with a collective in flight under
them, against alone), and how collectives in flight together share the backend (the mixes a step
overlaps, launched at once, against one after the other). All ranks time at once, so on a host
whose ranks share its cores every figure is the one a step at that world size sees.
"""

from __future__ import annotations

import statistics
import sys
import time

from typing import TYPE_CHECKING

from zeroshard.tools.harness import timed, warm_median
from zeroshard.tools.sim.network import bus_factor

if TYPE_CHECKING:
    from zeroshard.tools.sim.unit_probe import UnitProbe

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
"""Bytes gathered per call: from latency-bound to bandwidth-bound, small enough for a laptop."""
STEP_SIZES = (1 << 12, 1 << 18, 1 << 21, 1 << 23, 1 << 25)
"""For a full calibration: up to 32 MB, the size of the runtime's default 25 MB buckets, so the
fitted bandwidth is the one its reductions see rather than an extrapolation."""
OPS = ("all_gather", "reduce_scatter", "all_reduce")


def fit(points: list[tuple[float, float]], op: str, p: int) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) from (buffer bytes, seconds) pairs of ``op`` on ``p`` ranks."""
    if p < 2 or len(points) < 2:
        raise ValueError("calibration needs at least 2 ranks and 2 message sizes")
    steps = (2 if op == "all_reduce" else 1) * (p - 1)
    xs = [bus_factor(op, p) * n for n, _ in points]
    ts = [t for _, t in points]
    # t = steps*alpha + x*beta: ordinary least squares on (1, x).
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("calibration sizes must differ")
    beta = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    alpha = (mt - beta * mx) / steps
    if beta <= 0:
        raise ValueError("timings did not grow with size; rerun with larger sizes or more repeats")
    return max(alpha, 0.0), 1.0 / beta


def time_rank(op: str, sizes: tuple[int, ...], repeats: int) -> list[tuple[float, float]]:
    """Run on every rank of a spawned world; returns (buffer bytes, median seconds) per size."""
    from zeroshard.comm.world import init as zs_init

    mesh = zs_init()
    return _time_op(op, sizes, repeats, mesh.world)


def _issue(op: str, full, shard, async_op: bool = False, group: str = "world"):
    from zeroshard.comm import collectives

    if op == "all_gather":
        return collectives.all_gather(full, shard, group=group, phase="calibrate", async_op=async_op)
    if op == "reduce_scatter":
        return collectives.reduce_scatter(shard, full, group=group, phase="calibrate", async_op=async_op)
    return collectives.all_reduce(full, group=group, phase="calibrate", async_op=async_op)


def group_device():
    """The device the mesh's collectives run on (NCCL takes no host tensors); the CPU on gloo."""
    from zeroshard.comm.mesh import get_mesh

    return get_mesh().device


def settle() -> None:
    """Let the current stream's queued work finish before the clock is read: on an accelerator a
    kernel, or a collective the stream was made to wait for, returns to the host once queued. A
    no-op on the CPU, where everything has run by the time the call returns."""
    import torch

    device = group_device()
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def _time_op(op: str, sizes: tuple[int, ...], repeats: int, p: int, group: str = "world") -> list[tuple[float, float]]:
    import torch


    out, device = [], group_device()
    for nbytes in sizes:
        numel = max(p, nbytes // 4 // p * p)
        full = torch.zeros(numel, device=device)
        shard = torch.ones(numel // p, device=device)
        # The first call pays connection setup.
        out.append((float(numel * 4), warm_median(lambda: _issue(op, full, shard, group=group), repeats,
                                                  phase="calibrate", device=device)))
    return out


def calibrate(world: int = 2, op: str = "all_gather", sizes: tuple[int, ...] = DEFAULT_SIZES,
              repeats: int = 5) -> dict:
    from zeroshard.trainer.launch import spawn

    points = spawn(time_rank, world, args=(op, sizes, repeats), timeout_s=300)[0]
    alpha, bandwidth = fit(points, op, world)
    return {"op": op, "world": world, "points": points, "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth}


# --------------------------------------------------------------------------- a whole hardware description


def _once(fn) -> float:
    """Seconds of one ``fn()`` started after a barrier, so every rank runs it at once."""
    return timed(fn, 1, phase="calibrate", device=group_device())[0]


def _median_times(fn, repeats: int) -> float:
    return warm_median(fn, repeats, phase="calibrate", device=group_device())


UNIT_REPEATS = 9
"""The fewest repeats of the block and whole-model timings. The root unit is their difference (the
whole model less its blocks), small beside either, so their noise lands on it: with 5 repeats,
rounds of the same calibration gave 5 to 142 ms for the root's backward at 4 ranks."""


def _unit_times(probe: UnitProbe, repeats: int) -> dict[str, float]:
    """One block's forward and backward, the root's (whole model less its blocks) and AdamW per param."""
    import torch

    from zeroshard.trainer.step import BETAS

    block, model = probe.block, probe.model
    held: dict[str, torch.Tensor] = {}

    def block_fwd() -> None:
        # Fresh grads each backward, as model_bwd leaves them: root = model - L * block then compares
        # like with like (accumulating into kept grads adds a pass over them to every block).
        block.zero_grad(set_to_none=True)
        held["y"] = probe.block_call()

    def block_bwd() -> None:
        held.pop("y").sum().backward()

    def model_fwd() -> None:
        held["loss"] = probe.model_loss()

    def model_bwd() -> None:
        held.pop("loss").backward()
        model.zero_grad(set_to_none=True)

    out: dict = {}
    for name, fwd, bwd in (("block", block_fwd, block_bwd), ("model", model_fwd, model_bwd)):
        f, b = [], []
        for _ in range(max(repeats, UNIT_REPEATS) + 1):  # forward and backward alternate, as in a step
            f.append(_once(fwd))
            b.append(_once(bwd))
        out[f"{name}_forward_s"], out[f"{name}_backward_s"] = statistics.median(f[1:]), statistics.median(b[1:])
        # every repeat, for the slowest rank's figures (``calibrate_world``)
        out[f"{name}_forward_reps"], out[f"{name}_backward_reps"] = f[1:], b[1:]
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in block.parameters())))
    flat.grad = torch.randn_like(flat)
    opt = torch.optim.AdamW([flat], lr=1e-4, betas=BETAS, weight_decay=0.1)
    out["optimizer_s_per_param"] = _median_times(opt.step, repeats) / flat.numel()
    L = probe.n_layer
    out["root_forward_s"] = max(0.0, out.pop("model_forward_s") - L * out["block_forward_s"])
    out["root_backward_s"] = max(0.0, out.pop("model_backward_s") - L * out["block_backward_s"])
    out["block_params"] = float(flat.numel())
    out["n_layer"] = L
    return out


CONTENTION_BLOCKS = 4
"""Blocks' worth of fp32 elements the contention probe moves per collective: about one of the
runtime's default 25 MB buckets at ``small``, so its cost under compute stands well clear of the
timer's and the scheduler's jitter (one block's worth did not: repeated rounds gave 0.1 to 2.1)."""


def _contention(probe: UnitProbe, repeats: int, p: int) -> dict[str, float]:
    """Per collective: seconds of compute lost per second of collective (``m`` s alone) run under
    it, the charge the replay makes for each second of collective work its timeline puts under
    compute.

    The compute is as many blocks' forward and backward as outlast the collective twice over, so
    the collective runs wholly under it as in a step, and only the compute is timed. Each repeat
    times it alone (``c``) and then with the collective launched just before it (``c2``), back to
    back, and the figure is the median over repeats of (c2 - c) / m: pairing the two cancels a
    drift in the host's load that medians taken apart would keep. Were the collective still
    running when compute ended, only the share of its life under compute counts. 0 is free
    overlap, 1 is the two taking turns; above 1 they thrash."""
    import math

    import torch

    from zeroshard.comm import collectives

    block_numel = sum(q.numel() for q in probe.block.parameters())  # its fp32 grads, or its fp32 params
    numel = max(p, CONTENTION_BLOCKS * block_numel // p * p)
    pairs = max(repeats, 5)

    def run_blocks(k: int) -> None:
        for _ in range(k):
            probe.block_call().sum().backward()

    one = _median_times(lambda: run_blocks(1), repeats)
    out = {}
    device = group_device()
    for op in OPS:
        full, shard = torch.zeros(numel, device=device), torch.ones(numel // p, device=device)
        m = _median_times(lambda: _issue(op, full, shard), repeats)
        n = max(1, math.ceil(2 * m / max(one, 1e-9)))
        lost = []
        for _ in range(pairs + 1):  # the first pair pays first-touch costs
            c = _once(lambda: run_blocks(n))
            collectives.barrier(phase="calibrate")
            start = time.perf_counter()
            pending = _issue(op, full, shard, async_op=True)
            run_blocks(n)
            settle()  # the compute only: the stream waits for the collective at the wait, not before
            c2 = time.perf_counter() - start
            done = pending.is_done()
            pending.wait()
            settle()
            both = time.perf_counter() - start
            under = m if done else m * c2 / both
            lost.append(max(0.0, c2 - c) / under)
        out[f"contention_{op}"] = statistics.median(lost[1:])
    return out


def _concurrency(repeats: int, p: int, sub: int | None, numel: int) -> dict[int, dict[str, float]]:
    """Per shard-group size, collectives of ``numel`` fp32 elements (one block: a stage-3 unit's
    gather or reduction) launched together against one after the other (see
    ``MeasuredConcurrency``): the pairs a step overlaps, a prefetched gather with a reduction (in a
    hybrid mesh a shard group's reduction with the replicate group's all-reduce), and three, the
    in-flight cap's worth. Returns each one's and each mix's median seconds."""
    import torch

    from zeroshard.comm import collectives

    device = group_device()

    def make(op: str, group: str):
        g = collectives.group_size(group)
        n = max(g, numel // g * g)
        return op, torch.zeros(n, device=device), torch.ones(n // g, device=device), group

    def timed(ops) -> float:
        def run() -> None:
            for pending in [_issue(op, f, sh, async_op=True, group=g) for op, f, sh, g in ops]:
                pending.wait()
        return _median_times(run, repeats)

    out: dict[int, dict[str, float]] = {}
    shapes = [(p, "world", "world", ("reduce_scatter", "world"))]
    if sub:
        shapes.append((sub, "shard", "shard", ("all_reduce", "replicate")))
    for group, g_ag, g_rs, third in shapes:
        ag, rs, other = make("all_gather", g_ag), make("reduce_scatter", g_rs), make(*third)
        two, three = ([ag, rs], [ag, rs, other]) if sub is None or group != sub else ([rs, other], [ag, rs, other])
        solo = {"ag": timed([ag]), "rs": timed([rs]), "other": timed([other])}
        serial_two = solo["ag"] + solo["rs"] if two[0] is ag else solo["rs"] + solo["other"]
        out[group] = {"two": timed(two) / serial_two, "three": timed(three) / sum(solo.values())}
    return out


def world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def hardware_rank(model: str, vocab: int, micro_batch: int, seq: int, sizes: tuple[int, ...],
                  repeats: int) -> dict:
    """Spawn target: every figure ``calibrate_hardware`` needs from one world size."""
    from zeroshard.comm.mesh import shutdown
    from zeroshard.comm.world import init as zs_init

    # From 4 ranks on, also the collectives of a hybrid step: groups of 2 that run all at once.
    sub = 2 if world_size() >= 4 and world_size() % 2 == 0 else None
    mesh = zs_init(shard_size=sub)
    p = mesh.world
    points = [(op, p, _time_op(op, sizes, repeats, p)) for op in OPS]
    if sub:
        points += [(op, sub, _time_op(op, sizes, repeats, sub, "shard")) for op in ("all_gather", "reduce_scatter")]
        points.append(("all_reduce", p // sub, _time_op("all_reduce", sizes, repeats, p // sub, "replicate")))
    from zeroshard.tools.sim.unit_probe import UnitProbe

    probe = UnitProbe(model, vocab, micro_batch, seq)
    unit = _unit_times(probe, repeats)
    contention = _contention(probe, repeats, p)
    concurrency = _concurrency(repeats, p, sub, int(unit["block_params"]))
    shutdown()
    return {"points": points, "unit": unit, "contention": contention, "concurrency": concurrency}


UNIT_KEYS = ("block_forward_s", "block_backward_s", "root_forward_s", "root_backward_s", "optimizer_s_per_param")
SLOWEST_OF = {"block_forward_slowest_s": "block_forward_reps", "block_backward_slowest_s": "block_backward_reps"}
"""The slowest rank's figure -> the per-repeat times on each rank it is taken from."""
SLOWEST_KEYS = (*SLOWEST_OF, "root_slowest_s")
"""Every slowest-rank figure: the blocks' above, and the root's (the slowest rank's whole forward
plus backward less the blocks' mean), which ``calibrate_world`` derives."""


def _slowest(ranks: list[dict], *reps_keys: str) -> float:
    """Median over repeats of the slowest rank's time (summed over ``reps_keys``, the parts of one
    stretch between syncs): every repeat started on all ranks at once (after a barrier), so this is
    how long the stretch takes when every rank must finish it before any goes on."""
    per_rank = [[sum(parts) for parts in zip(*(r["unit"][k] for k in reps_keys))] for r in ranks]
    return statistics.median(max(times) for times in zip(*per_rank))


def calibrate_world(world: int, model: str, vocab: int, micro_batch: int, seq: int, *,
                    sizes: tuple[int, ...] = STEP_SIZES, repeats: int = 5) -> dict:
    """One calibration at ``world`` ranks (one spawned gloo group), reduced over its ranks: a
    collective's time is its slowest rank's; units, contention and concurrency are the mean over
    ranks (with more ranks than cores the OS shares them out unevenly over one short unit but
    evenly over a step's many, so the slowest rank's unit overstates a step that syncs seldom),
    and a block's forward and backward also the slowest rank's (a step that syncs every block)."""
    from zeroshard.trainer.launch import spawn

    ranks = spawn(hardware_rank, world, args=(model, vocab, micro_batch, seq, sizes, repeats), timeout_s=900)
    points = {}
    for k, (op, group, first_pts) in enumerate(ranks[0]["points"]):
        points[f"{op}:{group}"] = [(n, max(r["points"][k][2][i][1] for r in ranks)) for i, (n, _) in enumerate(first_pts)]
    keys = UNIT_KEYS + ("block_params",)
    unit = {k: statistics.fmean(r["unit"][k] for r in ranks) for k in keys}
    unit.update({k: _slowest(ranks, reps) for k, reps in SLOWEST_OF.items()})
    # A step that meets only at its end (stages 0-2) pays the slowest rank's forward plus backward
    # once: the sum per rank, not the sum of each pass's slowest (a rank behind in one catches up
    # in the other). Charged to the root (MeasuredCompute.root_slowest_s).
    blocks = ranks[0]["unit"]["n_layer"] * (unit["block_forward_s"] + unit["block_backward_s"])
    unit["root_slowest_s"] = max(0.0, _slowest(ranks, "model_forward_reps", "model_backward_reps") - blocks)
    return {"points": points, "unit": unit,
            "contention": {k: statistics.fmean(r["contention"][k] for r in ranks) for k in ranks[0]["contention"]},
            "concurrency": {g: {k: statistics.fmean(r["concurrency"][g][k] for r in ranks) for k in ("two", "three")}
                            for g in ranks[0]["concurrency"]}}


def hardware_from(rounds: dict[int, list[dict]], model: str, vocab: int, micro_batch: int, seq: int, *,
                  name: str = "local"):
    """A ``Hardware`` from ``calibrate_world`` results, several per world taken at different times
    (each figure is the median over them: a load spike in one round does not set it), and the raw
    timings (for a report)."""
    import os

    from zeroshard.tools.sim.hardware import Hardware
    from zeroshard.tools.sim.measured import MeasuredCompute, MeasuredConcurrency, MeasuredLink
    from zeroshard.tools.sim.step import ADAMW_BYTES_PER_PARAM

    med = statistics.median
    links, compute, concurrency, raw = [], [], [], {}
    for world, runs in rounds.items():
        for key, first in runs[0]["points"].items():
            op, group = key.split(":")[0], int(key.split(":")[1])
            pts = [(n, med(r["points"][key][i][1] for r in runs)) for i, (n, _) in enumerate(first)]
            raw[f"{op} over {group} of {world}"] = pts
            try:
                alpha, bw = fit(pts, op, group)
            except ValueError as e:  # a load spike flattened it: the nearest other fit stands in
                print(f"calibration: no fit for {op} over {group} of {world} ranks ({e})", file=sys.stderr)
                continue
            links.append(MeasuredLink(op=op, group=group, world=world, alpha_s=alpha, bandwidth=bw))
        unit = {k: med(r["unit"][k] for r in runs) for k in UNIT_KEYS}
        unit.update({k: med(r["unit"][k] for r in runs) for k in SLOWEST_KEYS if all(k in r["unit"] for r in runs)})
        shares = {k: med(r["contention"][k] for r in runs) for k in runs[0]["contention"]}
        if all("host" in r for r in runs):  # the runtime's per-unit host seconds (host_rank)
            unit["unit_host_forward_s"] = med(r["host"][0] for r in runs)
            unit["unit_host_backward_s"] = med(r["host"][1] for r in runs)
        compute.append(MeasuredCompute(model=model, vocab=vocab, micro_batch=micro_batch, seq=seq, world=world,
                                       **shares, **unit))
        for group in runs[0]["concurrency"]:
            factors = {k: med(r["concurrency"][group][k] for r in runs) for k in ("two", "three")}
            concurrency.append(MeasuredConcurrency(world=world, group=int(group), **factors))
    worlds = tuple(rounds)
    first_c = compute[0]  # the smallest world's compute, the largest world's all-gather
    if not links:
        raise ValueError("no collective's timings grew with size; calibrate again on a quieter host")
    last = ([m for m in links if m.op == "all_gather" and m.group == m.world] or links)[-1]
    block_flops = 6.0 * rounds[worlds[0]][0]["unit"]["block_params"] * micro_batch * seq
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    memory_rate = ADAMW_BYTES_PER_PARAM / max(first_c.optimizer_s_per_param, 1e-15)
    hw = Hardware(name=name, peak_flops=block_flops / (first_c.block_forward_s + first_c.block_backward_s),
                  hbm_bytes=float(mem // max(worlds)), hbm_bandwidth=memory_rate,
                  gpus_per_node=max(worlds), intra_bandwidth=last.bandwidth, inter_bandwidth=last.bandwidth,
                  intra_latency=last.alpha_s, inter_latency=last.alpha_s, gemm_efficiency=1.0,
                  # One memory: offload's copies are memory to memory, its step the measured AdamW.
                  host_link_bandwidth=memory_rate, host_memory_bandwidth=memory_rate,
                  links=tuple(links), compute=tuple(compute), concurrency=tuple(concurrency))
    return hw, raw


def host_rank(model: str, vocab: int, micro_batch: int, seq: int, steps: int) -> tuple[float, float]:
    """Spawn target, on one rank (so no wait on a collective is in it): the runtime's (forward,
    backward) host seconds per stage-3 unit and micro-step, from its host-time breakdown."""
    from zeroshard.comm.mesh import shutdown
    from zeroshard.comm.world import init as zs_init
    from zeroshard.tools.benchmark.host import measure, unit_host_seconds
    from zeroshard.tools.sim.unit_probe import UnitProbe

    zs_init()
    probe = UnitProbe(model, vocab, micro_batch, seq)
    result = measure(probe.model, probe.idx, probe.idx, stage=3, steps=steps)
    shutdown()
    return unit_host_seconds(result)


def calibrate_hardware(worlds: tuple[int, ...], model: str, vocab: int, micro_batch: int, seq: int, *,
                       sizes: tuple[int, ...] = STEP_SIZES, repeats: int = 5, name: str = "local"):
    """A ``Hardware`` for this host with a fitted link per collective and world size and per-unit
    compute times of ``model``, how collectives in flight together share the backend, and the raw
    timings (for a report)."""
    if not worlds or min(worlds) < 2:
        raise ValueError("calibration needs world sizes >= 2, e.g. --sweep 2,4")
    from zeroshard.trainer.launch import spawn

    rounds = {w: [calibrate_world(w, model, vocab, micro_batch, seq, sizes=sizes, repeats=repeats)] for w in worlds}
    host = spawn(host_rank, 1, args=(model, vocab, micro_batch, seq, max(repeats, 3)), timeout_s=900)[0]
    for runs in rounds.values():
        for run in runs:
            run["host"] = list(host)
    return hardware_from(rounds, model, vocab, micro_batch, seq, name=name)

"""Fit the simulator's hardware model to this machine: collectives, per-unit compute, contention.

Each collective size is timed through zeroshard.comm.collectives (so it runs the way the runtime
runs it: on gloo, reduce-scatter and all-gather fan out into one rooted reduce or broadcast per
slice, the same transport as the stage 2-3 per-piece reduction), the median of a few repeats after
a barrier; then t = steps * alpha + bus_bytes / bw is fitted by least squares, with steps and bus
bytes from the ring formulas in ``network``.

``calibrate_hardware`` does that for every collective the replay uses, at each world size, and on
the same ranks times one block's forward and backward, the model's root unit (the whole model's
forward and backward less its blocks), an AdamW step per parameter, and the contention between
compute and communication: a collective launched async and a block's forward and backward run
while it is in flight, against each alone. All ranks time at once, so on a host whose ranks
share its cores every figure is the one a step at that world size sees.
"""

from __future__ import annotations

import statistics
import time

from zeroshard.sim.network import bus_factor

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
    import zeroshard as zs

    mesh = zs.init()
    return _time_op(op, sizes, repeats, mesh.world)


def _issue(op: str, full, shard, async_op: bool = False, group: str = "world"):
    from zeroshard.comm import collectives

    if op == "all_gather":
        return collectives.all_gather(full, shard, group=group, phase="calibrate", async_op=async_op)
    if op == "reduce_scatter":
        return collectives.reduce_scatter(shard, full, group=group, phase="calibrate", async_op=async_op)
    return collectives.all_reduce(full, group=group, phase="calibrate", async_op=async_op)


def _time_op(op: str, sizes: tuple[int, ...], repeats: int, p: int, group: str = "world") -> list[tuple[float, float]]:
    import torch

    from zeroshard.comm import collectives

    out = []
    for nbytes in sizes:
        numel = max(p, nbytes // 4 // p * p)
        full = torch.zeros(numel)
        shard = torch.ones(numel // p)
        times = []
        for _ in range(repeats + 1):  # the first call pays connection setup
            collectives.barrier(phase="calibrate")
            start = time.perf_counter()
            _issue(op, full, shard, group=group)
            times.append(time.perf_counter() - start)
        out.append((float(numel * 4), statistics.median(times[1:])))
    return out


def calibrate(world: int = 2, op: str = "all_gather", sizes: tuple[int, ...] = DEFAULT_SIZES,
              repeats: int = 5) -> dict:
    from zeroshard.launch import spawn

    points = spawn(time_rank, world, args=(op, sizes, repeats), timeout_s=300)[0]
    alpha, bandwidth = fit(points, op, world)
    return {"op": op, "world": world, "points": points, "alpha_s": alpha, "bandwidth_bytes_per_s": bandwidth}


# --------------------------------------------------------------------------- a whole hardware description


def _once(fn) -> float:
    """Seconds of one ``fn()`` started after a barrier, so every rank runs it at once."""
    from zeroshard.comm import collectives

    collectives.barrier(phase="calibrate")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_times(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, the first (allocations, lazy init) dropped."""
    return statistics.median([_once(fn) for _ in range(repeats + 1)][1:])


def _unit_times(model_name: str, vocab: int, micro_batch: int, seq: int, repeats: int) -> dict[str, float]:
    """One block's forward and backward, the root's (whole model less its blocks) and AdamW per param."""
    import torch

    from zeroshard.models.gpt import GPT, GPTConfig
    from zeroshard.step import BETAS

    cfg = GPTConfig.named(model_name, vocab_size=vocab, seq_len=seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    block = model.blocks[0]
    x = torch.randn(micro_batch, seq, cfg.n_embd)
    idx = torch.randint(0, vocab, (micro_batch, seq))
    held: dict[str, torch.Tensor] = {}

    def block_fwd() -> None:
        held["y"] = block(x.detach().requires_grad_(True))

    def block_bwd() -> None:
        held.pop("y").sum().backward()

    def model_fwd() -> None:
        held["loss"] = model(idx, idx, reduction="sum")

    def model_bwd() -> None:
        held.pop("loss").backward()
        model.zero_grad(set_to_none=True)

    out = {}
    for name, fwd, bwd in (("block", block_fwd, block_bwd), ("model", model_fwd, model_bwd)):
        f, b = [], []
        for _ in range(repeats + 1):  # forward and backward alternate, as in a step
            f.append(_once(fwd))
            b.append(_once(bwd))
        out[f"{name}_forward_s"], out[f"{name}_backward_s"] = statistics.median(f[1:]), statistics.median(b[1:])
    flat = torch.nn.Parameter(torch.zeros(sum(p.numel() for p in block.parameters())))
    flat.grad = torch.randn_like(flat)
    opt = torch.optim.AdamW([flat], lr=1e-4, betas=BETAS, weight_decay=0.1)
    out["optimizer_s_per_param"] = _median_times(opt.step, repeats) / flat.numel()
    L = cfg.n_layer
    out["root_forward_s"] = max(0.0, out.pop("model_forward_s") - L * out["block_forward_s"])
    out["root_backward_s"] = max(0.0, out.pop("model_backward_s") - L * out["block_backward_s"])
    out["block_params"] = float(flat.numel())
    return out


def _contention(c: float, model: str, vocab: int, micro_batch: int, seq: int, repeats: int,
                p: int) -> dict[str, float]:
    """Per collective: seconds a block's forward and backward (``c`` s alone) is slowed per second
    of a block-sized collective (``m`` s alone) in flight under it: (both - c) / m, where ``both``
    is the two together. 0 is free overlap, 1 is running one after the other; above 1 they thrash."""
    import torch

    from zeroshard.models.gpt import Block, GPTConfig

    cfg = GPTConfig.named(model, vocab_size=vocab, seq_len=seq)
    block = Block(cfg)
    x = torch.randn(micro_batch, seq, cfg.n_embd)
    block_numel = sum(q.numel() for q in block.parameters())  # its fp32 grads, or its fp32 params
    numel = max(p, block_numel // p * p)
    out = {}
    for op in OPS:
        full, shard = torch.zeros(numel), torch.ones(numel // p)
        m = _median_times(lambda: _issue(op, full, shard), repeats)

        def overlapped() -> None:
            pending = _issue(op, full, shard, async_op=True)
            block(x.detach().requires_grad_(True)).sum().backward()
            pending.wait()

        both = _median_times(overlapped, repeats)
        out[f"contention_{op}"] = max(0.0, both - c) / m
    return out


def world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def hardware_rank(model: str, vocab: int, micro_batch: int, seq: int, sizes: tuple[int, ...],
                  repeats: int) -> dict:
    """Spawn target: every figure ``calibrate_hardware`` needs from one world size."""
    import zeroshard as zs

    # From 4 ranks on, also the collectives of a hybrid step: groups of 2 that run all at once.
    sub = 2 if world_size() >= 4 and world_size() % 2 == 0 else None
    mesh = zs.init(shard_size=sub)
    p = mesh.world
    points = [(op, p, _time_op(op, sizes, repeats, p)) for op in OPS]
    if sub:
        points += [(op, sub, _time_op(op, sizes, repeats, sub, "shard")) for op in ("all_gather", "reduce_scatter")]
        points.append(("all_reduce", p // sub, _time_op("all_reduce", sizes, repeats, p // sub, "replicate")))
    unit = _unit_times(model, vocab, micro_batch, seq, repeats)
    contention = _contention(unit["block_forward_s"] + unit["block_backward_s"], model, vocab, micro_batch, seq,
                             repeats, p)
    zs.shutdown()
    return {"points": points, "unit": unit, "contention": contention}


def calibrate_hardware(worlds: tuple[int, ...], model: str, vocab: int, micro_batch: int, seq: int, *,
                       sizes: tuple[int, ...] = STEP_SIZES, repeats: int = 5, name: str = "local"):
    """A ``Hardware`` for this host with a fitted link per collective and world size and per-unit
    compute times of ``model``, and the raw timings (for a report)."""
    import os

    from zeroshard.launch import spawn
    from zeroshard.sim.hardware import Hardware
    from zeroshard.sim.measured import MeasuredCompute, MeasuredLink
    from zeroshard.sim.step import ADAMW_BYTES_PER_PARAM

    if not worlds or min(worlds) < 2:
        raise ValueError("calibration needs world sizes >= 2, e.g. --sweep 2,4")
    links, compute, raw = [], [], {}
    for world in worlds:
        ranks = spawn(hardware_rank, world, args=(model, vocab, micro_batch, seq, sizes, repeats), timeout_s=900)
        # A collective lasts as long as its slowest rank.
        for k, (op, group, first_pts) in enumerate(ranks[0]["points"]):
            pts = [(n, max(r["points"][k][2][i][1] for r in ranks)) for i, (n, _) in enumerate(first_pts)]
            alpha, bw = fit(pts, op, group)
            links.append(MeasuredLink(op=op, group=group, world=world, alpha_s=alpha, bandwidth=bw))
            raw[f"{op} over {group} of {world}"] = pts
        # Units: the mean over ranks. With more ranks than cores the OS shares them out unevenly
        # over one short unit but evenly over a step's many, so the slowest rank's unit overstates.
        unit = {k: statistics.fmean(r["unit"][k] for r in ranks) for k in ("block_forward_s", "block_backward_s",
                                                            "root_forward_s", "root_backward_s",
                                                            "optimizer_s_per_param")}
        shares = {k: statistics.fmean(r["contention"][k] for r in ranks) for k in ranks[0]["contention"]}
        compute.append(MeasuredCompute(model=model, vocab=vocab, micro_batch=micro_batch, seq=seq, world=world,
                                       **shares, **unit))
    first = compute[0]  # the smallest world's compute, the largest world's all-gather
    last = [m for m in links if m.op == "all_gather" and m.group == m.world][-1]
    block_flops = 6.0 * ranks[0]["unit"]["block_params"] * micro_batch * seq
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = Hardware(name=name, peak_flops=block_flops / (first.block_forward_s + first.block_backward_s),
                  hbm_bytes=float(mem // max(worlds)),
                  hbm_bandwidth=ADAMW_BYTES_PER_PARAM / max(first.optimizer_s_per_param, 1e-15),
                  gpus_per_node=max(worlds), intra_bandwidth=last.bandwidth, inter_bandwidth=last.bandwidth,
                  intra_latency=last.alpha_s, inter_latency=last.alpha_s, gemm_efficiency=1.0,
                  links=tuple(links), compute=tuple(compute))
    return hw, raw

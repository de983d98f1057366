"""Pick the cheapest layout that fits, and say why: a higher stage is not a better one, since each
stage buys memory with more communication.

Cost is communication time per step on the given hardware, priced by the simulator's link model
(``zeroshard.tools.sim.network.rows_seconds``, the h100 preset by default); ties go to the lower
stage, because a stage that buys memory you do not need only adds moving parts. The order of
resort when nothing fits cheaply:

1. the cheapest layout that fits as planned;
2. if that needs ZeRO-3 or hybrid sharding (or nothing fits) and a cheaper layout fails because
   *activations* are its largest term, enable sqrt checkpointing on the cheaper layout instead
   (one extra forward beats ZeRO-3's 1.5x communication, and raising the stage does not divide
   activations at all);
   For an MoE model, expert parallelism is a candidate next to every layout: each ep that divides
   the data-parallel ranks and the experts and fits in a node (the all-to-alls sit on the critical
   path), priced with its all-to-alls; the recommendation always carries a row for ZeRO-3 with and
   without ep (memory and communication time), whichever wins;
3. tensor parallelism, when the largest layer's full params and working buffers (stage 3's
   gathered window, grad buffers in flight and workspace: ``layer_floor``) exceed the device even
   at ZeRO-3: sharding never splits a layer while it computes, so more ranks cannot help, while a
   tp split divides it;
4. cpu offload (``zs.shard(offload="cpu")``: masters and optimizer state in host memory);
5. nothing: say how many ranks ZeRO-3 would need.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroshard.tools.planner.api import plan as make_plan
from zeroshard.tools.planner.result import COMPONENTS, LayoutPlan, Plan
from zeroshard.tools.planner.spec import parse_bytes
from zeroshard.tools.search import first_fit, ranked
from zeroshard.tools.sim.hardware import DEFAULT_HW, PRESETS, Hardware
from zeroshard.tools.sim.network import rows_seconds

PRETTY = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def pretty(name: str) -> str:
    base, _, variant = name.partition("_")
    label = PRETTY.get(base, base)
    return f"{label} ({variant})" if variant else label


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if abs(n) >= 1e8 else f"{n / 1e6:.0f} MB"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    layout: str
    checkpointing: str
    offload: str
    total_bytes: int
    fits: bool
    comm_seconds: float
    dominant: str
    """The largest component of this layout's total."""
    ep: int = 1
    """Expert parallelism's degree for this candidate (1: none)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recommendation:
    layout: str | None
    """The chosen layout's name, or None when nothing fits."""
    checkpointing: str
    offload: str
    fits: bool
    reason: str
    device_mem: int
    candidates: tuple[Candidate, ...]
    plan: Plan
    """The plan the chosen layout comes from (with the recommended checkpointing and offload)."""
    tp: int = 1
    """The tensor-parallel degree the chosen layout needs (1: none)."""
    ep: int = 1
    """The expert-parallel degree the chosen layout needs (1: none)."""
    expert_rows: tuple[Candidate, ...] = ()
    """For an MoE model: ZeRO-3 without ep and at each ep tried, with their memory and
    communication time, whichever was chosen."""

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "checkpointing": self.checkpointing, "offload": self.offload, "tp": self.tp,
                "ep": self.ep, "fits": self.fits, "reason": self.reason, "device_mem_bytes": self.device_mem,
                "candidates": [dataclasses.asdict(c) for c in self.candidates],
                "expert_rows": [dataclasses.asdict(c) for c in self.expert_rows]}


def _dominant(layout: LayoutPlan) -> str:
    values = layout.device.as_dict()
    states = layout.device.model_states
    best = max((n for n in COMPONENTS if n not in ("params", "grads", "master", "optimizer")), key=lambda n: values[n])
    return "model states" if states >= values[best] else best


def _candidates(p: Plan, hw: Hardware, device_mem: int, names: list[str]) -> list[Candidate]:
    out = []
    for name in names:
        layout = p[name]
        out.append(Candidate(layout=name, checkpointing=layout.checkpointing, offload=layout.offload,
                             total_bytes=layout.device.total, fits=layout.device.total <= device_mem,
                             comm_seconds=rows_seconds(layout.collectives, hw), dominant=_dominant(layout), ep=p.spec.ep))
    return _ranked(out, p)


def _ranked(cands: list[Candidate], p: Plan) -> list[Candidate]:
    """By communication time (within 1%: a tie), then the lower stage, then fewer moving parts (no
    ep), then the plain layout."""
    return ranked(cands, lambda c: c.comm_seconds, lambda c: p[c.layout].stage, lambda c: c.ep, lambda c: c.layout)


def label(c: Candidate) -> str:
    return pretty(c.layout) + (f" with ep {c.ep}" if c.ep > 1 else "")


def _expert_options(model_or_config: Any, kwargs: dict, hw: Hardware) -> tuple[int, ...]:
    """The ep degrees to weigh for an MoE model: the one asked for, or every one that divides the
    data-parallel ranks and each layer's experts and keeps an ep group inside a node."""
    if kwargs.get("tp", 1) > 1:
        return ()  # the runtime does not compose them
    asked, dp = kwargs.get("ep", 1), kwargs["world"]
    if asked > 1:
        return (1,)  # weighed against no ep
    from zeroshard.tools.planner.api import _resolve_model
    from zeroshard.tools.planner.experts import expert_split

    try:
        model = _resolve_model(model_or_config, kwargs.get("seq"))[0]
    except ValueError:  # a bare parameter count: no layers
        return ()
    out = []
    for ep in (2, 4, 8, 16, 32, 64):
        if ep > min(dp, hw.gpus_per_node) or dp % ep:
            continue
        try:
            expert_split(model, ep)
        except ValueError:  # no MoE layer, or ep does not divide its experts
            continue
        out.append(ep)
    return tuple(out)


def _expert_note(rows: tuple[Candidate, ...]) -> str:
    """ZeRO-3 with and without ep, side by side: what EP buys in memory and costs in time."""
    if len(rows) < 2:
        return ""
    parts = [f"{label(c)} {gb(c.total_bytes)}, {c.comm_seconds * 1e3:.2f} ms of communication per step"
             for c in rows]
    return "; EP against ZeRO-3: " + ", ".join(parts)


def _comm_note(chosen: Candidate, cands: list[Candidate]) -> str:
    """How much more a costlier alternative would communicate, so the choice reads as a trade."""
    by_name = {c.layout: c for c in cands}
    hybrid = chosen.layout.endswith("_hybrid")
    if chosen.comm_seconds <= 0:
        return ""
    if chosen.layout.startswith("zero3"):
        full = by_name.get("zero3")
        if hybrid and full is not None and full.comm_seconds > chosen.comm_seconds:
            return (f"; sharding inside each node keeps the all-gathers on intra-node links (full ZeRO-3 across "
                    f"nodes would communicate {full.comm_seconds / chosen.comm_seconds:.1f}x longer)")
        return ""
    other = by_name.get("zero3_hybrid" if hybrid else "zero3")
    if other is None:
        return ""
    extra = other.comm_seconds / chosen.comm_seconds - 1
    return f"; {pretty(other.layout)} would add {extra:.0%} more communication" if extra > 0.005 else ""


class _Search:
    """What every resort of ``recommend`` reads: the run, the device, and the candidates so far."""

    def __init__(self, target: Any, mem: int, hw: Hardware, kwargs: dict, ckpt: str, hybrid: int | None) -> None:
        self.target, self.mem, self.hw, self.kwargs, self.ckpt, self.hybrid = target, mem, hw, kwargs, ckpt, hybrid
        self.base = self.plan_with()
        self.names = [n for n in self.base.layouts if not n.endswith("_offload")]
        self.cands = _candidates(self.base, hw, mem, self.names)
        # An MoE model's layouts at the other ep degrees, and the offloaded ones, once tried.
        self.other_cands: list[Candidate] = []
        self.offloaded: list[Candidate] = []
        self.expert_rows: tuple[Candidate, ...] = ()

    def plan_with(self, **extra: Any) -> Plan:
        return make_plan(self.target, gpus_per_node=self.hw.gpus_per_node, shard_size=self.hybrid,
                         checkpointing=extra.pop("checkpointing", self.ckpt), **dict(self.kwargs, **extra))

    @property
    def plain(self) -> Candidate | None:
        return first_fit(self.cands, lambda c: c.fits)

    def answer(self, c: Candidate, reason: str, plan: Plan, **extra: Any) -> Recommendation:
        return Recommendation(layout=c.layout, checkpointing=extra.pop("checkpointing", str(plan.spec.checkpointing)),
                              offload=c.offload, fits=True, reason=reason, device_mem=self.mem,
                              candidates=extra.pop("candidates", tuple(self.cands)), plan=plan, **extra)

    @property
    def head(self) -> str:
        smallest = min([*self.cands, *self.other_cands], key=lambda c: c.total_bytes)
        return (f"nothing fits in {gb(self.mem)} on the device: the smallest, {label(smallest)}, needs "
                f"{gb(smallest.total_bytes)} ({smallest.dominant} dominate)")


def recommend(model_or_config: Any, *, device_mem: int | str, hw: Hardware | None = None,
              **plan_kwargs: Any) -> Recommendation:
    """The cheapest layout of ``model_or_config`` that fits ``device_mem`` per rank, with the reason:
    the first resort that finds one (the module docstring's order) answers.

    ``plan_kwargs`` are ``zs.plan``'s (world, batch, seq, mp, optimizer, ...). With a world larger than
    ``hw.gpus_per_node``, hybrid layouts (shard inside a node, replicate across) are candidates.
    """
    hw = hw or PRESETS[DEFAULT_HW]
    if "world" not in plan_kwargs:
        raise ValueError("recommend needs world=N (the data-parallel ranks you have)")
    for key in ("offload", "shard_size", "gpus_per_node"):
        plan_kwargs.pop(key, None)
    ckpt = plan_kwargs.pop("checkpointing", "none")
    tp = plan_kwargs.get("tp", 1)
    dp, dp_per_node = plan_kwargs["world"] // tp, max(1, hw.gpus_per_node // tp)
    s = _Search(model_or_config, parse_bytes(device_mem), hw, plan_kwargs, ckpt,
                dp_per_node if dp > dp_per_node and dp % dp_per_node == 0 else None)
    resorts = (_with_experts, _with_recompute, _as_planned, _tensor_parallel, _with_offload, _nothing_fits)
    return next(rec for resort in resorts if (rec := resort(s)) is not None)


def _with_experts(s: _Search) -> Recommendation | None:
    """1b. For an MoE model, the other ep degrees' layouts next to these (every ep that fits when
    none was asked, else none), and ZeRO-3's row of each; an ep layout that wins answers."""
    world = s.kwargs["world"] // s.kwargs.get("tp", 1)
    others = {ep: s.plan_with(ep=ep) for ep in _expert_options(s.target, dict(s.kwargs, world=world), s.hw)
              if ep != s.base.spec.ep}
    if not others:
        return None
    s.other_cands = [c for p in others.values() for c in _candidates(p, s.hw, s.mem, s.names)]
    everything = [*s.cands, *s.other_cands]
    s.expert_rows = tuple(sorted((c for c in everything if c.layout == "zero3"), key=lambda c: c.ep))
    ranked_all = _ranked(everything, s.base)
    best = first_fit(ranked_all, lambda c: c.fits)
    if best is None or best.ep == s.base.spec.ep:
        return None
    reason = f"{label(best)} fits with {gb(s.mem - best.total_bytes)} headroom" + _expert_note(s.expert_rows)
    return s.answer(best, reason, others[best.ep], candidates=tuple(ranked_all), ep=best.ep,
                    expert_rows=s.expert_rows, checkpointing=str(s.base.spec.checkpointing))


def _with_recompute(s: _Search) -> Recommendation | None:
    """2. Recompute over a costly stage when activations are what overflows a cheaper layout."""
    plain, base, cands = s.plain, s.base, s.cands
    if base.activations is None or str(base.spec.checkpointing) != "none" or (
            plain is not None and base[plain.layout].stage != 3 and "hybrid" not in plain.layout):
        return None
    sqrt_plan = s.plan_with(checkpointing="sqrt")
    for c in (c for c in cands if not c.fits and (plain is None or cands.index(c) < cands.index(plain))):
        after = _candidates(sqrt_plan, s.hw, s.mem, [c.layout])[0]
        if c.dominant == "activations" and after.fits:
            act = base[c.layout].device.activations
            reason = (f"activations dominate ({gb(act)} of {gb(c.total_bytes)} on {pretty(c.layout)}): enable "
                      f"sqrt checkpointing before raising the stage; {pretty(c.layout)} then fits with "
                      f"{gb(s.mem - after.total_bytes)} headroom" + _comm_note(after, cands))
            return s.answer(after, reason, sqrt_plan, candidates=tuple(cands) + (after,), checkpointing="sqrt")
    return None


def _as_planned(s: _Search) -> Recommendation | None:
    """1. The cheapest layout that fits as planned."""
    if (plain := s.plain) is None:
        return None
    reason = f"{label(plain)} fits with {gb(s.mem - plain.total_bytes)} headroom" + _comm_note(plain, s.cands)
    lower = [c for c in s.cands if s.base[c.layout].stage < s.base[plain.layout].stage and not c.fits]
    if lower:
        worst = min(lower, key=lambda c: c.total_bytes)
        reason += f"; {pretty(worst.layout)} would need {gb(worst.total_bytes)}"
    return s.answer(plain, reason + _expert_note(s.expert_rows), s.base, ep=s.base.spec.ep, expert_rows=s.expert_rows)


def _with_offload(s: _Search) -> Recommendation | None:
    """4. Masters, optimizer state and the reduced grads in host memory, the step on the CPU: among
    equally cheap layouts, the one that moves the least to the host (DDP would move every master)."""
    head = s.head
    off_plan = s.plan_with(offload="cpu")
    off = _candidates(off_plan, s.hw, s.mem, [n for n in off_plan.layouts if n.endswith("_offload")])
    s.offloaded = off
    fit = first_fit(ranked(off, lambda c: c.comm_seconds, lambda c: off_plan[c.layout].host_bytes), lambda c: c.fits)
    if fit is None:
        return None
    host = off_plan[fit.layout].host_bytes
    reason = (f"{head}; {pretty(fit.layout.removesuffix('_offload'))} with cpu offload fits with "
              f"{gb(s.mem - fit.total_bytes)} headroom, moving {gb(host)} per rank to host memory")
    return s.answer(fit, reason, off_plan, candidates=(*s.cands, *off))


def _nothing_fits(s: _Search) -> Recommendation:
    """5. Nothing: say why, and how many ranks ZeRO-3 would need when more ranks would help."""
    smallest = min([*s.cands, *s.other_cands], key=lambda c: c.total_bytes)
    if smallest.dominant == "activations":
        # More ranks shrink model states, never a rank's activations.
        more = "; more ranks will not help: lower the micro-batch or sequence length, or checkpoint more"
    else:
        need = _ranks_needed(s.target, s.mem, s.kwargs, s.kwargs["world"])
        more = f"; ZeRO-3 would fit from {need} ranks" if need else "; even 4096 ranks of ZeRO-3 would not fit"
    return Recommendation(layout=None, checkpointing=str(s.base.spec.checkpointing), offload="none", fits=False,
                          reason=s.head + ", even with offload" + more, device_mem=s.mem,
                          candidates=(*s.cands, *s.offloaded), plan=s.base)


def layer_floor(p: Plan) -> int:
    """What the largest layers need at ZeRO-3 besides the model states (which more ranks divide) and
    the activations (which a smaller micro-batch or checkpointing divides): the gathered full params,
    the grad buffers in flight, the workspace, with the plan's headroom. More ranks never shrink it."""
    z3 = p["zero3"].device
    return z3.total - z3.model_states - z3.activations


def _tensor_parallel(s: _Search) -> Recommendation | None:
    """3. The smallest tp (within a node, dividing the world) whose cheapest fitting layout fits, when
    the largest layer's working set alone exceeds the device at ZeRO-3; None otherwise."""
    model_or_config, base, hw, mem, kwargs, ckpt = s.target, s.base, s.hw, s.mem, s.kwargs, s.ckpt
    floor, world, current = layer_floor(base), kwargs["world"], kwargs.get("tp", 1)
    if base.mode == "analytic" or floor <= mem:
        return None
    for tp in (t for t in (2, 4, 8, 16, 32, 64) if current < t <= hw.gpus_per_node and world % t == 0):
        dp, per_node = world // tp, max(1, hw.gpus_per_node // tp)
        hybrid = per_node if dp > per_node and dp % per_node == 0 else None
        try:
            p = make_plan(model_or_config, **dict(kwargs, tp=tp), checkpointing=ckpt,
                          gpus_per_node=hw.gpus_per_node, shard_size=hybrid)
        except ValueError:  # this tp does not divide the heads or the hidden size, or the batch
            continue
        fits = [c for c in _candidates(p, hw, mem, [n for n in p.layouts if not n.endswith("_offload")]) if c.fits]
        if fits:
            pick = fits[0]
            reason = (f"{s.head}; the largest layer's full params and working buffers need {gb(floor)} even at "
                      f"ZeRO-3, and sharding never splits a layer while it computes: tensor parallelism over "
                      f"{tp} ranks of a node splits each block, and {pretty(pick.layout)} with tp={tp} fits with "
                      f"{gb(mem - pick.total_bytes)} headroom")
            return Recommendation(layout=pick.layout, checkpointing=ckpt, offload="none", fits=True, reason=reason,
                                  device_mem=mem, candidates=tuple(fits), plan=p, tp=tp)
    return None


def _ranks_needed(model_or_config: Any, mem: int, kwargs: dict, world: int) -> int | None:
    """Smallest power-of-two world (same micro-batch) where ZeRO-3 fits, or None up to 4096."""
    accum = kwargs.get("accum") or 1
    micro = (kwargs.get("batch") or world * accum) // (world * accum)
    n = world * 2
    while n <= 4096:
        trial = dict(kwargs, world=n, batch=micro * n * accum)
        if make_plan(model_or_config, **trial)["zero3"].device.total <= mem:
            return n
        n *= 2
    return None

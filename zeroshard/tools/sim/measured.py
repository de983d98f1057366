"""Measured figures a hardware description may carry: per-collective alpha-beta fits and per-unit
compute times, as ``zeroshard plan calibrate`` stores them, and the TOML that holds them.

A measured link replaces the preset's link model for its collective and group size: the ring cost
``steps * alpha + bus_factor * n / bandwidth`` with the fitted alpha and bandwidth. A measured
compute entry replaces the FLOP and byte model for the model it was timed on: seconds per block
forward and backward, for the root unit (embeddings, final norm, head, loss), and the optimizer's
seconds per local parameter. Entries are kept per world size, because on a CPU host the ranks
share its cores: a block timed while ``world`` ranks run at once is what a step of ``world`` sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

OPS = ("all_gather", "reduce_scatter", "all_reduce")
"""The collectives a link model covers (the network model prices these three)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredLink:
    op: str
    group: int
    """Ranks in the collective."""
    world: int
    """Ranks running on the host meanwhile (every group of that size at once, as in a hybrid step)."""
    alpha_s: float
    """Seconds per ring step."""
    bandwidth: float
    """Bus bandwidth, bytes/s (nccl-tests' accounting, see ``sim/network.py``)."""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"measured link: op {self.op!r} is not one of {', '.join(OPS)}")
        if self.group < 2 or self.world < self.group or self.alpha_s < 0 or not self.bandwidth > 0:
            raise ValueError(f"measured link {self.op}: needs 2 <= group <= world, alpha_s >= 0 and bandwidth > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredCompute:
    model: str
    vocab: int
    micro_batch: int
    seq: int
    world: int
    """Ranks that ran at once while this was timed."""
    block_forward_s: float
    block_backward_s: float
    root_forward_s: float
    root_backward_s: float
    optimizer_s_per_param: float
    """One AdamW step, seconds per local parameter."""
    block_forward_slowest_s: float | None = None
    """A block's forward on the slowest rank, every rank starting it at once (median over repeats);
    None where not measured (the mean then stands in). With more ranks than cores the OS shares them
    unevenly over one block, so a schedule that waits on a gather before every block pays this."""
    block_backward_slowest_s: float | None = None
    root_slowest_s: float | None = None
    """The root unit's forward and backward together as a schedule whose ranks meet only at the
    step's end (stages 0-2) sees them: the slowest rank's whole-model forward plus backward (median
    over repeats) less the blocks' mean. Such a step still ends with its slowest rank, so the skew
    of one whole step's compute is paid once, charged here; None where not measured (the mean root
    then stands in)."""
    contention_all_gather: float = 0.0
    """Seconds a block's compute is slowed per second of this collective in flight under it, at this
    world size (see ``Hardware.contention``), measured with the rest; one figure per collective."""
    contention_reduce_scatter: float = 0.0
    contention_all_reduce: float = 0.0
    unit_host_forward_s: float = 0.0
    """The runtime's own host seconds per stage-3 unit and micro-step in forward (its hooks, the
    copy into the params), from the host-time breakdown (zeroshard/tools/benchmark/host.py) on one
    rank; the blocks' times above are of the plain block, without the runtime."""
    unit_host_backward_s: float = 0.0
    """The same in backward: the pre-backward and grad hooks and the reduction's bookkeeping."""

    def __post_init__(self) -> None:
        times = ("block_forward_s", "block_backward_s", "root_forward_s", "root_backward_s", "optimizer_s_per_param")
        slowest = (self.block_forward_slowest_s, self.block_backward_slowest_s, self.root_slowest_s)
        if any(getattr(self, f) < 0 for f in times) or any(t is not None and t < 0 for t in slowest) \
                or min(self.micro_batch, self.seq, self.world) < 1:
            raise ValueError(f"measured compute for {self.model!r}: times must be >= 0, sizes positive")
        if min(self.contention_all_gather, self.contention_reduce_scatter, self.contention_all_reduce) < 0:
            raise ValueError(f"measured compute for {self.model!r}: contention must be >= 0")
        if min(self.unit_host_forward_s, self.unit_host_backward_s) < 0:
            raise ValueError(f"measured compute for {self.model!r}: unit host seconds must be >= 0")

    def contention(self, op: str) -> float:
        return float(getattr(self, f"contention_{op}"))

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredConcurrency:
    """How collectives in flight together share this host's backend, at one world size.

    ``two`` is the wall time of two collectives launched at once (the kinds a step overlaps: a
    prefetched all-gather and a reduce-scatter; at world >= 4 also a shard group's reduce-scatter
    and the replicate group's all-reduce) over the time of the same two run one after the other;
    ``three`` the same for three (a gather and two reduce pieces, the in-flight cap's worth). 1 is a
    link shared fairly (what a single stream's one-at-a-time order also costs); below 1 they run
    partly in parallel (spare cores or links); above 1 they thrash. The replay gives each of k
    collectives in flight 1 / (k * factor(k)) of its solo speed."""

    world: int
    """Ranks running on the host while this was timed."""
    group: int
    """Ranks in the shard group the collectives ran over (smaller than world for a hybrid mesh,
    whose mixes pair a shard group's collectives with the replicate group's all-reduce)."""
    two: float
    three: float

    def __post_init__(self) -> None:
        if not 2 <= self.group <= self.world or not (self.two > 0 and self.three > 0):
            raise ValueError("measured concurrency: needs 2 <= group <= world and positive factors")

    def factor(self, k: int) -> float:
        """Wall time of ``k`` collectives in flight together over their serial time (at least 1/k:
        none runs faster than alone); the three-way figure stands for more."""
        if k <= 1:
            return 1.0
        return max(1.0 / k, self.two if k == 2 else self.three)


def pick_link(links: tuple[MeasuredLink, ...], op: str, p: int, world: int | None = None) -> MeasuredLink | None:
    """The fit of ``op`` over ``p`` ranks while ``world`` run (default ``p``), else the nearest
    measured group size, then world size (None without any fit of ``op``)."""
    world = p if world is None else world
    mine = [m for m in links if m.op == op]
    return min(mine, key=lambda m: (abs(m.group - p), abs(m.world - world), -m.world)) if mine else None


def pick_concurrency(entries: tuple[MeasuredConcurrency, ...], world: int,
                     group: int | None = None) -> MeasuredConcurrency | None:
    """The figure measured at ``world`` ranks over shard groups of ``group`` (default ``world``),
    else the nearest world, then group (None when none is stored)."""
    group = world if group is None else group
    return min(entries, key=lambda c: (abs(c.world - world), abs(c.group - group), -c.world)) if entries else None


def pick_compute(entries: tuple[MeasuredCompute, ...], model: str, vocab: int, world: int) -> MeasuredCompute:
    """The entry timed on ``model`` at ``world`` ranks, else at the nearest world. Raises when the
    hardware holds compute times for other models only (the FLOP model would silently take over)."""
    mine = [c for c in entries if c.model == model and c.vocab == vocab]
    if not mine:
        have = ", ".join(sorted({f"{c.model} (vocab {c.vocab})" for c in entries}))
        raise ValueError(f"this hardware's compute was measured on {have}, not {model} (vocab {vocab}); "
                         f"plan that model (and --vocab-size), or run zeroshard plan calibrate --model {model} "
                         f"--vocab-size {vocab}")
    return min(mine, key=lambda c: (abs(c.world - world), -c.world))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(hw: Any, comment: str = "") -> str:
    """The TOML ``load_hardware`` reads back into an equal ``Hardware``."""
    lines = [f"# {line}" for line in comment.splitlines()]
    tables = []
    for f in dataclasses.fields(hw):
        value = getattr(hw, f.name)
        if f.name == "name":
            continue
        if isinstance(value, tuple):
            for entry in value:
                tables.append(f"\n[[{f.name}]]")
                # TOML has no null: a field left unmeasured is left out and reads back as its default.
                tables += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(entry).items() if v is not None]
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines + tables) + "\n"

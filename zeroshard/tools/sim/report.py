"""Tables and the sweep chart for ``zeroshard plan time``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from zeroshard.tools.planner.spec import STAGE_NAMES
from zeroshard.tools.sim.hardware import Hardware
from zeroshard.tools.sim.memory import peak_bytes
from zeroshard.tools.sim.step import Layout, StepResult, simulate
from zeroshard.tools.sim.workload import Workload

GIB = 2**30


def layout_label(layout: Layout) -> str:
    name = STAGE_NAMES[layout.stage]
    name = f"{name} shard={layout.shard_group}" if layout.hybrid else name
    name += f" tp={layout.tp}" if layout.tp > 1 else ""
    name += f" ep={layout.ep}" if layout.ep > 1 else ""
    name += f" cp={layout.cp} {layout.cp_attention}" if layout.cp > 1 else ""
    return name + (f" offload={layout.offload}" if layout.offload != "none" else "")


def layouts_for(world: int, stages: tuple[int, ...], shard_sizes: tuple[int, ...], **kw: Any) -> list[Layout]:
    """Every stage over the whole world, plus hybrid groups of each size that divides the data-parallel
    ranks (world / tp; without offload, which is simulated over the whole world only, as the planner
    prices it)."""
    out = []
    dp = world // kw.get("tp", 1) // kw.get("cp", 1)
    for stage in stages:
        out.append(Layout.of(world=world, stage=stage, **kw))
        if stage and kw.get("offload", "none") == "none":
            out += [Layout.of(world=world, stage=stage, shards=s, **kw) for s in shard_sizes if s < dp and dp % s == 0]
    return out


@dataclasses.dataclass(frozen=True)
class Row:
    layout: Layout
    result: StepResult
    peak_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"layout": layout_label(self.layout), "world": self.layout.world, "stage": self.layout.stage,
                "tp": self.layout.tp, "ep": self.layout.ep, "cp": self.layout.cp, "shard_group": self.layout.shard_group,
                "peak_bytes": self.peak_bytes, "fits": self.fits,
                **self.result.to_dict()}


def evaluate(w: Workload, hw: Hardware, layouts: list[Layout], memory=None) -> list[Row]:
    """Simulate each layout; ``memory(layout)`` overrides the peak-memory estimate (bytes)."""
    rows = []
    for layout in layouts:
        peak = memory(layout) if memory else peak_bytes(w, layout)
        rows.append(Row(layout, simulate(w, hw, layout), peak, peak <= hw.hbm_bytes))
    return rows


def time_table(rows: list[Row], w: Workload, hw: Hardware):
    from rich.table import Table

    table = Table(title=f"{w.shape.name} on {hw.name}: one step, micro-batch {w.micro_batch} x seq {w.seq}, "
                        f"checkpointing {w.checkpointing}",
                  caption=f"analytical model; HBM {hw.hbm_bytes / GIB:.0f} GiB per GPU; see docs in zeroshard/sim")
    for col in ("layout", "world", "step s", "tokens/s/GPU", "MFU", "compute s", "exposed comm s",
                "hidden comm s", "peak GiB", "dominant"):
        table.add_column(col, justify="left" if col in ("layout", "dominant") else "right")
    for r in rows:
        res = r.result
        peak = f"{r.peak_bytes / GIB:,.1f}" + ("" if r.fits else " [red](OOM)")
        table.add_row(layout_label(r.layout), str(r.layout.world), f"{res.step_s:.4g}",
                      f"{res.tokens_per_s_per_gpu:,.0f}", f"{res.mfu:.1%}", f"{res.compute_s:.4g}",
                      f"{res.exposed_comm_s:.3g}", f"{res.hidden_comm_s:.3g}", peak, res.dominant())
    return table


def sweep_plot(rows: list[Row], path: str | Path, w: Workload, hw: Hardware) -> Path:
    """Tokens/s/GPU against world size per layout (hollow where it does not fit), and peak memory
    against the device's HBM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label: dict[str, list[Row]] = {}
    for r in rows:
        by_label.setdefault(layout_label(r.layout), []).append(r)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    def key(label: str) -> tuple[int, int]:
        lay = by_label[label][0].layout
        return lay.stage, 0 if lay.shard_group == lay.world else lay.shard_group

    for label in sorted(by_label, key=key):
        rs = by_label[label]
        xs = [r.layout.world for r in rs]
        line, = top.plot(xs, [r.result.tokens_per_s_per_gpu for r in rs], "-", label=label)
        for r in rs:
            top.plot(r.layout.world, r.result.tokens_per_s_per_gpu, "o", color=line.get_color(),
                     markerfacecolor=line.get_color() if r.fits else "none")
        bottom.plot(xs, [r.peak_bytes / GIB for r in rs], "o-", color=line.get_color(), label=label)
    bottom.axhline(hw.hbm_bytes / GIB, color="red", linestyle="--", label=f"{hw.name} HBM")
    top.set_ylabel("tokens/s per GPU")
    top.set_title(f"{w.shape.name} on {hw.name}, micro-batch {w.micro_batch} x {w.seq}, ckpt {w.checkpointing}\n"
                  "hollow markers: layout does not fit in memory")
    bottom.set_ylabel("peak memory per GPU (GiB)")
    bottom.set_xlabel("GPUs")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    bottom.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

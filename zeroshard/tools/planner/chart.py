"""``--plot``: per-rank memory stacked by component, one bar per layout, with the device memory line.

matplotlib is an optional extra (``pip install 'zeroshard[plot]'``) and is imported only here, only
when a chart is asked for.
"""

from __future__ import annotations

from pathlib import Path

from zeroshard.tools.planner.result import COMPONENTS, Plan

# Model states in blues/greens (what ZeRO shards), runtime terms in warm colours, headroom grey.
_COLORS = {
    "params": "#1f4e79", "grads": "#2e75b6", "master": "#6fa8dc", "optimizer": "#38761d",
    "activations": "#e69138", "window": "#cc0000", "buckets": "#a64d79", "workspace": "#f1c232",
    "headroom": "#b7b7b7",
}


def _scale(largest: float) -> tuple[float, str]:
    return (1e9, "GB") if largest >= 1e9 else (1e6, "MB")


def _component_bars(ax, plan: Plan, names: list[str], div: float) -> list[float]:
    """Each component's bars stacked, at its own peak (headroom is drawn later); the stack's tops."""
    bottoms = [0.0] * len(names)
    for comp in COMPONENTS:
        if comp == "headroom":
            continue  # drawn last, on top of the predicted peak
        values = [getattr(plan[n].device, comp) / div for n in names]
        if not any(values):
            continue  # keep the legend to the terms that exist in this plan
        ax.bar(names, values, bottom=bottoms, color=_COLORS[comp], label=comp, width=0.6, edgecolor="white",
               linewidth=0.5)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    return bottoms


def _label_axes(ax, plan: Plan, names: list[str], unit: str, top: float, title: str | None) -> None:
    """Title, axes, grid and the legend (outside, on the right, with how to read the bars)."""
    spec = plan.spec
    what = plan.model.name if plan.model else f"{plan.params / 1e9:.3g}B params"
    ax.set_title(title or f"{what}: per-rank memory, world {spec.world}, micro-batch {spec.micro_batch} x seq {spec.seq}",
                 fontsize=11)
    ax.set_ylabel(f"bytes per rank ({unit}, decimal)")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, top * 1.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.text(1.02, 0.0, "black line: predicted peak\nnumber: peak + headroom", transform=ax.transAxes, fontsize=8,
            va="bottom", ha="left", color="#444444")


def plot(plan: Plan, path: str | Path, *, device_mem: int | None = None, title: str | None = None) -> Path:
    """Write the chart to ``path`` (PNG or any format matplotlib knows from the suffix) and return it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window, works headless
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'zeroshard[plot]'") from None
    names = list(plan.layouts)
    totals = [plan[n].device.total for n in names]
    div, unit = _scale(max(totals + [device_mem or 0]))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(names) + 3), 5.5), dpi=120)
    bottoms = _component_bars(ax, plan, names, div)
    # Each component is drawn at its own peak, so the stack can over-count terms that never coexist
    # (activations at backward's start, gloo's grad buffers at its end): that top part is hatched,
    # and the solid line below it is the predicted peak. Headroom sits on the peak, drawn narrower
    # so the components behind it stay visible.
    peaks = [plan[n].device.allocated / div for n in names]
    overlaps = [plan[n].device.overlap / div for n in names]
    if any(overlaps):
        ax.bar(names, overlaps, bottom=peaks, width=0.6, color="white", alpha=0.75, hatch="///",
               edgecolor="#444444", linewidth=0, label="not simultaneous")
    heads = [plan[n].device.headroom / div for n in names]
    ax.bar(names, heads, bottom=peaks, width=0.3, color=_COLORS["headroom"], label="headroom", zorder=3)
    for x, (peak, total) in enumerate(zip(peaks, totals)):
        ax.hlines(peak, x - 0.3, x + 0.3, color="black", linewidth=1.5, zorder=4)
        top = max(bottoms[x], total / div)
        ax.annotate(f"{total / div:.2f}", (x, top), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 2), textcoords="offset points")
    if device_mem:
        ax.axhline(device_mem / div, color="black", linestyle="--", linewidth=1.2)
        # x in axes fraction, y in data: the label sits at the right end of the line whatever the bars.
        ax.text(0.99, device_mem / div, f"device memory {device_mem / div:.3g} {unit}", ha="right", va="bottom",
                fontsize=9, transform=ax.get_yaxis_transform())
    top = max(bottoms + [t / div for t in totals] + [(device_mem or 0) / div])
    _label_axes(ax, plan, names, unit, top, title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out

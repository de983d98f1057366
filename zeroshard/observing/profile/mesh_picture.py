"""``mesh.png`` of ``zeroshard report``: the mesh drawn on the hosts the run ran on.

Each host is a box holding its ranks; each rank is labelled with its mesh coordinates. A line joins
the ranks of every group of each dim larger than one: solid between ranks of one host, dashed (and
curved) where the link crosses hosts, so a shard group spread over the network is visible at a glance.
The straggler, when the profile named one, is outlined in red. The picture is drawn from the
topology the run recorded (summary.json or metrics.jsonl's header; zeroshard/comm/topology.py).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from zeroshard.comm.names import Dim
from zeroshard.comm.topology import placement_text, rank_groups

DIM_COLORS = {"tp": "#cc0000", "shard": "#2e75b6", "replicate": "#38761d", "ep": "#a64d79", "pp": "#e69138"}
DRAWN = ("replicate", "shard", "tp", "ep")
"""Outermost first: the outer dims' lines are drawn first, under the inner ones."""


def coordinates(rank: int, dims: Mapping[str, int]) -> dict[str, int]:
    """The rank's index along each factor of the world, by the mesh's layout (tp innermost)."""
    tp, shard = dims.get("tp", 1), dims.get("shard", 1)
    return {"replicate": rank // (tp * shard), "shard": (rank // tp) % shard, "tp": rank % tp}


def _positions(topology: Mapping[str, Any]) -> tuple[dict[int, tuple[float, float]], dict[str, tuple]]:
    """Each rank's centre, and each host's box (x, y, width, height), hosts in a row."""
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(topology["rank_hosts"]):
        hosts.setdefault(host, []).append(rank)
    most = max(len(r) for r in hosts.values())
    cols = math.ceil(math.sqrt(most))
    rows = math.ceil(most / cols)
    cell, pad = 1.3, 0.4
    width, height = cols * cell + pad, rows * cell + pad + 0.5  # room for the host's name on top
    centres: dict[int, tuple[float, float]] = {}
    boxes = {}
    for h, (name, ranks) in enumerate(hosts.items()):
        x0 = h * (width + 0.9)
        boxes[name] = (x0, 0.0, width, height)
        for i, rank in enumerate(ranks):
            col, row = i % cols, i // cols
            centres[rank] = (x0 + pad / 2 + (col + 0.5) * cell, height - 0.5 - pad / 2 - (row + 0.5) * cell)
    return centres, boxes


def draw_mesh(plt, topology: Mapping[str, Any], path: Path, *, straggler: int | None = None,
              title: str = "") -> Path:
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch

    dims = {str(k): int(v) for k, v in topology["dims"].items()}
    inside = topology["inside_host"]
    centres, boxes = _positions(topology)
    span_x = max(x + w for x, _, w, _ in boxes.values())
    span_y = max(h for _, _, _, h in boxes.values())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * span_x + 1.0), max(3.6, 1.1 * span_y + 1.6)), dpi=120)
    for name, (x, y, w, h) in boxes.items():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15", facecolor="#f4f4f4",
                                    edgecolor="#666666", linewidth=1.2, zorder=0))
        ax.text(x + w / 2, y + h - 0.3, f"host {name}", ha="center", va="center", fontsize=10, weight="bold")
    legend = []
    hosts = topology["rank_hosts"]
    for k, dim in enumerate(d for d in DRAWN if dims.get(d, 1) > 1):
        offset = (k - 1) * 0.1  # side by side where two dims join the same ranks
        for group in rank_groups({Dim(d): n for d, n in dims.items()}, Dim(dim)):
            for a, b in zip(group, group[1:]):
                (xa, ya), (xb, yb) = centres[a], centres[b]
                across = hosts[a] != hosts[b]
                ax.annotate("", xy=(xb + offset, yb + offset), xytext=(xa + offset, ya + offset), zorder=1,
                            arrowprops=dict(arrowstyle="-", color=DIM_COLORS[dim], linewidth=2.2,
                                            linestyle="--" if across else "-", shrinkA=16, shrinkB=16,
                                            connectionstyle=f"arc3,rad={0.2 if across else 0.0}"))
        where = "inside a host" if inside[dim] else "crosses hosts"
        legend.append(Line2D([0], [0], color=DIM_COLORS[dim], linewidth=2.2, linestyle="-" if inside[dim] else "--",
                             label=f"{dim} {dims[dim]} ({where})"))
    for rank, (x, y) in centres.items():
        c = coordinates(rank, dims)
        names = {"replicate": "rep", "shard": "sh", "tp": "tp"}
        label = f"rank {rank}\n" + " ".join(f"{names[d]}{c[d]}" for d in names if dims.get(d, 1) > 1)
        slow = rank == straggler
        ax.text(x, y, label.strip(), ha="center", va="center", fontsize=9, zorder=2,
                bbox=dict(boxstyle="round,pad=0.35", facecolor="white", linewidth=2.0 if slow else 1.0,
                          edgecolor="#cc0000" if slow else "#333333"))
    if straggler is not None:
        legend.append(Line2D([0], [0], marker="s", color="white", markeredgecolor="#cc0000", markersize=10,
                             label=f"straggler: rank {straggler}"))
    ax.set_xlim(-0.3, span_x + 0.3)
    ax.set_ylim(-0.3, span_y + 0.3)
    ax.set_aspect("equal")
    ax.axis("off")
    head = placement_text(topology)
    ax.set_title(f"mesh on the hosts: {head}" + (f"\n{title}" if title else ""), fontsize=10)
    if legend:
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(4, len(legend)),
                  frameon=False, fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

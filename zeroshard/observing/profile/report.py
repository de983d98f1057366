"""``zeroshard report RUN_DIR``: PNG charts of a run, from the files the run wrote.

- ``loss.png``: loss per step (and the data's entropy floor when it is known), with what the run
  healed marked on it: skipped steps, spike rollbacks and replica changes (zeroshard/observing/heal_view.py);
- ``step_time.png``: each step's time stacked by phase (zeroshard/observing/profile/breakdown.py), rank 0;
- ``memory.png``: memory over the last step on rank 0: the process
  memory (CUDA allocated, or RSS on a CPU) and the full-parameter bytes gathered at stage 3, sampled
  at every phase boundary and unit gather or free, with the phases shaded;
- ``mesh.png``: the mesh drawn on the hosts (zeroshard/observing/profile/mesh_picture.py), from the topology
  metrics.jsonl's header (or summary.json) recorded.

matplotlib is imported only here (the ``plot`` and ``test`` extras).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zeroshard.observing.profile.breakdown import PHASES
from zeroshard.observing.profile.render import LABELS

COLORS = {
    "data": "#b7b7b7", "forward": "#2e75b6", "ag_wait": "#cc0000", "backward": "#38761d", "rs_wait": "#e69138",
    "optimizer": "#674ea7", "param_sync": "#a64d79", "checkpoint": "#f1c232", "other": "#666666",
}
PHASE_SHADES = {"data": "#eeeeee", "forward": "#deebf7", "backward": "#e5f5e0", "optimizer": "#efedf5",
                "checkpoint": "#fff7bc"}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, headless
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("zeroshard report needs matplotlib: pip install 'zeroshard[plot]'") from None
    return plt


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the charts that the run's files allow; returns their paths."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.exists():
        raise FileNotFoundError(f"{metrics_path} does not exist: is {run_dir} a `zeroshard train` run directory?")
    metrics = [m for m in _read_jsonl(metrics_path) if m.get("kind") != "header"]  # steps only
    if not metrics:
        raise ValueError(f"{metrics_path} is empty: the run did not finish a step")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    title = _title(config)
    paths = [_loss(plt, metrics, config, title, out / "loss.png", run_dir)]
    if any(m.get("profile") for m in metrics):
        paths.append(_step_time(plt, metrics, title, out / "step_time.png"))
    memory_path = run_dir / "profile" / "memory-rank-0.json"
    if memory_path.exists():
        paths.append(_memory(plt, json.loads(memory_path.read_text()), title, out / "memory.png"))
    topology, straggler = _topology(run_dir, metrics_path)
    if topology is not None:
        from zeroshard.observing.profile.mesh_picture import draw_mesh

        paths.append(draw_mesh(plt, topology, out / "mesh.png", straggler=straggler, title=title))
    return paths


def _topology(run_dir: Path, metrics_path: Path) -> tuple[dict | None, int | None]:
    """(the topology the run recorded, the straggler rank when the summary named one); a run from
    before topologies were recorded has neither."""
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    straggler = (summary.get("profile") or {}).get("straggler_rank")
    if summary.get("topology"):
        return summary["topology"], straggler
    first = metrics_path.read_text().split("\n", 1)[0]
    header = json.loads(first) if first.strip() else {}
    return (header.get("topology") if header.get("kind") == "header" else None), straggler


def _title(config: dict) -> str:
    train = config.get("train", {})
    if not train:  # a zs.observe run around a user's own loop
        return f"world {config['world']}" if "world" in config else ""
    return (f"{train.get('model')} stage {train.get('stage')}, world {config.get('world')}, "
            f"batch {train.get('batch')}x{train.get('seq_len')}")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


HEAL_STYLES = {"skipped": dict(color="#cc0000", linestyle=":", label="skipped step (non-finite)"),
               "rollback": dict(color="#e69138", linestyle="--", label="spike rollback"),
               "replica": dict(color="#674ea7", linestyle="-.", label="replica change")}


def _loss(plt, metrics: list[dict], config: dict, title: str, path: Path, run_dir: Path) -> Path:
    from zeroshard.observing.heal_view import findings, marks

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], color="#1f4e79", linewidth=1.2, label="loss (global batch mean)")
    floor = config.get("entropy_floor")
    if floor:
        ax.axhline(floor, color="#cc0000", linestyle="--", linewidth=1, label=f"entropy floor {floor:.3f}")
    labelled: set[str] = set()
    for kind, step, _ in marks(findings(run_dir)):
        style = dict(HEAL_STYLES[kind], label=None if kind in labelled else HEAL_STYLES[kind]["label"])  # once each
        ax.axvline(step, linewidth=1, alpha=0.8, **style)
        labelled.add(kind)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss: {title}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    return _save(plt, fig, path)


def _step_time(plt, metrics: list[dict], title: str, path: Path) -> Path:
    rows = [m for m in metrics if m.get("profile")]
    steps = [m["step"] for m in rows]
    fig, ax = plt.subplots(figsize=(max(8.0, min(16.0, 0.12 * len(rows) + 6)), 5), dpi=120)
    bottoms = [0.0] * len(rows)
    for key in PHASES:
        values = [m["profile"].get(f"{key}_s", 0.0) * 1e3 for m in rows]
        if not any(values):
            continue
        ax.bar(steps, values, bottom=bottoms, color=COLORS[key], label=LABELS[key], width=0.8, linewidth=0)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    overlap = [m["profile"].get("overlap") for m in rows]
    shown = [o for o in overlap[1:] if o is not None]
    note = f"; mean overlap ratio {sum(shown) / len(shown) * 100:.0f}%" if shown else ""
    ax.set_title(f"step time by phase (rank 0): {title}{note}", fontsize=11)
    ax.set_xlabel("optimizer step (step 1 includes warm-up)")
    ax.set_ylabel("milliseconds")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    return _save(plt, fig, path)


def _memory(plt, prof: dict, title: str, path: Path) -> Path:
    samples = prof.get("samples", [])
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=120)
    spans = prof.get("spans", [])
    width = max((b for _, _, b in spans), default=0.0)
    for name, a, b in spans:
        ax.axvspan(a * 1e3, b * 1e3, color=PHASE_SHADES.get(name, "#f4f4f4"), zorder=0)
        if b - a < 0.06 * width:
            continue  # too narrow to label legibly
        ax.text((a + b) / 2 * 1e3, 1.0, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                fontsize=8, color="#444444")
    if samples:
        t = [s[0] * 1e3 for s in samples]
        ax.step(t, [s[1] for s in samples], where="post", color="#1f4e79", linewidth=1.3,
                label=f"process memory ({prof.get('mem_source', '?')})")
        if any(s[2] for s in samples):
            ax2 = ax.twinx()
            ax2.step(t, [s[2] for s in samples], where="post", color="#cc0000", linewidth=1.3,
                     label="full params gathered (stage 3 window)")
            ax2.set_ylabel("full-param MiB", color="#cc0000")
            ax2.set_ylim(bottom=0)
            ax2.legend(loc="lower right", frameon=False, fontsize=9)
    ax.set_xlabel(f"ms since step {prof['step'] - 1} ended (step {prof['step']})")
    ax.set_ylabel("MiB")
    ax.set_title(f"memory over step {prof['step']} (rank 0): {title}", fontsize=11, pad=16)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", frameon=False, fontsize=9)
    return _save(plt, fig, path)

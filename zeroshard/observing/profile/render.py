"""Text for the step profile: rows of the `zeroshard train` summary table."""

from __future__ import annotations

from typing import Any

from zeroshard.observing.profile.breakdown import PHASES

LABELS = {
    "data": "data", "forward": "forward", "ag_wait": "all-gather wait", "backward": "backward",
    "rs_wait": "reduce wait", "optimizer": "optimizer", "param_sync": "param sync", "checkpoint": "checkpoint",
    "other": "other",
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def breakdown_rows(mean: dict[str, float]) -> list[tuple[str, str]]:
    total = sum(mean[f"{k}_s"] for k in PHASES) or 1.0
    return [(f"  {LABELS[k]}", f"{_ms(mean[f'{k}_s'])} ({mean[f'{k}_s'] / total * 100:4.1f}%)") for k in PHASES]


def straggler_text(p: dict[str, Any]) -> str:
    """"rank 3 on host b": the first thing to look at on a slow multi-host run is which machine."""
    host = p.get("straggler_host")
    return f"rank {p['straggler_rank']}" + (f" on host {host}" if host else "")


def profile_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("step time P50 / P99", f"{_ms(p['step_p50_s'])} / {_ms(p['step_p99_s'])} (rank 0, {p['profiled_steps']} steps)"),
        ("step breakdown (mean)", ""),
        *breakdown_rows(p["breakdown_mean_s"]),
        ("collectives / step", f"{p['comm_bytes_per_step'] / 2**20:,.1f} MiB, busy {_ms(p['comm_busy_s_per_step'])}, "
                               f"exposed {_ms(p['comm_exposed_s_per_step'])}"),
        ("overlap ratio", f"{_pct(p['overlap'])} (1 - exposed / busy"
                          f"{', waits timed by device events' if p.get('wait_clock') == 'device' else ''})"),
        ("all-gather windows / step", f"{p['ag_windows_per_step']:.0f} (max {p['max_unsharded_units']} units unsharded at once)"),
        ("peak memory", f"{p['mem_peak_mb']:,.0f} MiB ({p['mem_source']}, rank 0)"),
        ("samples/s / tokens/s", f"{p['samples_per_s']:,.1f} / {p['tokens_per_s']:,.0f}"),
    ]
    if p.get("mfu") is not None:
        peak = p["peak_flops"]
        hfu = "" if p["hfu"] == p["mfu"] else f", HFU {_pct(p['hfu'])} with recompute"
        rows.append(("MFU", f"{_pct(p['mfu'])}{hfu} of {peak / 1e9:,.1f} GFLOP/s per rank"))
    if p.get("pipeline"):
        rows += pipeline_rows(p["pipeline"])
    spread = p["straggler_excess_s"]
    rows.append(("straggler", f"{straggler_text(p)} (+{_ms(spread)} compute/step over the fastest)"))
    return rows


def pipeline_rows(pipe: dict[str, Any]) -> list[tuple[str, str]]:
    """Per pp rank: its step split into each stage's forward and backward compute, idle inside the
    schedule (the bubble) and the rest of the step, and the bubble against the planner's theory."""
    rows = [("pipeline", f"{pipe['schedule']}, pp {pipe['pp']}, {pipe['microbatches']} microbatches: bubble theory "
                         f"{_pct(pipe['theory_bubble'])} of the schedule")]
    for r in pipe["by_rank"]:
        parts = []
        for stage, t in r["stages"].items():
            weight = f" + W {_ms(t['backward_weight'])}" if t["backward_weight"] > 0 else ""
            parts.append(f"stage {stage} F {_ms(t['forward'])} B {_ms(t['backward'])}{weight}")
        rest = r["step_s"] - r["schedule_s"]
        rows.append((f"  rank {r['rank']} (pp rank {r['pp_rank']})",
                     f"step {_ms(r['step_s'])} = {'; '.join(parts)} + idle {_ms(r['idle_s'])} + rest {_ms(rest)}; "
                     f"bubble {_pct(r['bubble'])} measured"))
    return rows

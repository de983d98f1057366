"""What a run healed, as the doctor, the summary table and the report show it.

Read from the run directory: ``nonfinite.json`` (written when the non-finite guard stopped the run:
zeroshard/runtime/guard.py), ``rollbacks.jsonl`` (one line per spike rollback:
zeroshard/trainer/heal.py), ``replicas.jsonl`` (one line per replica that left or joined) and the
``skipped`` flag of metrics.jsonl's step records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NONFINITE = "nonfinite.json"
ROLLBACKS = "rollbacks.jsonl"
REPLICAS = "replicas.jsonl"


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def findings(run_dir: str | Path) -> dict[str, Any]:
    """The run's skipped steps, the guard's report (None when nothing was skipped; ``stopped`` when it
    ended the run), rollbacks and replica changes."""
    folder = Path(run_dir)
    stop = json.loads((folder / NONFINITE).read_text()) if (folder / NONFINITE).is_file() else None
    steps = [r for r in _lines(folder / "metrics.jsonl") if "step" in r]
    return {"skipped_steps": [r["step"] for r in steps if r.get("skipped")], "nonfinite_stop": stop,
            "rollbacks": _lines(folder / ROLLBACKS), "replica_changes": _lines(folder / REPLICAS)}


def has_findings(found: dict[str, Any]) -> bool:
    return bool(found["skipped_steps"] or found["nonfinite_stop"] or found["rollbacks"] or found["replica_changes"])


def stopped(found: dict[str, Any]) -> bool:
    """Whether the non-finite guard ended the run."""
    return bool((found["nonfinite_stop"] or {}).get("stopped"))


def _where(report: dict[str, Any] | None) -> str:
    if not report:
        return "unknown"
    if report.get("first_rank") is None:
        return "a non-finite loss (the grads were finite)"
    return f"rank {report['first_rank']}, unit {report['first_unit']}"


def lines(found: dict[str, Any]) -> list[str]:
    """The doctor's paragraph on what the run healed (empty when nothing happened)."""
    out: list[str] = []
    stop = found["nonfinite_stop"]
    if stop is not None and stop.get("stopped"):
        first = stop.get("first") or {}
        out.append(f"stopped: {stop['consecutive']} consecutive steps had a non-finite loss or grad norm "
                   f"(max_bad_steps {stop['max_bad_steps']}); the first, step {first.get('step')}, went "
                   f"non-finite at {_where(first)}")
        bad = first.get("nonfinite") or []
        if len(bad) > 1:
            out.append("  non-finite grads held by: " + ", ".join(f"rank {b['rank']} {b['unit']}" for b in bad[:8])
                       + (" ..." if len(bad) > 8 else ""))
    skips = (stop or {}).get("skips") or []
    steps = sorted(set(found["skipped_steps"]) | {s["step"] for s in skips})
    if steps:
        out.append(f"skipped {len(steps)} step(s) for a non-finite loss or grad norm: "
                   + ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else ""))
        out += [f"  step {s['step']}: {_where(s)}" for s in skips[:10]]
    for rb in found["rollbacks"]:
        out.append(f"rollback: loss {rb['loss']:.4g} at step {rb['step']} ({rb['loss'] / rb['window_mean']:.1f}x "
                   f"the recent mean); reloaded step {rb['restored_step']} and skipped "
                   f"{len(rb['skipped_batches'])} batches ({len(rb['skipped_samples'])} samples)")
    for ch in found["replica_changes"]:
        out.append(f"replica {ch.get('replica')} {ch.get('event')} at step {ch.get('step')}"
                   + (f": {ch['note']}" if ch.get("note") else ""))
    return out


def marks(found: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(kind, step, label) of each thing the run healed, in step order, as `zeroshard report` marks
    them on the loss chart: a skipped step, a rollback (at the spike) and a replica change."""
    out = [("skipped", int(step), "skipped (non-finite)") for step in found["skipped_steps"]]
    out += [("rollback", int(rb["step"]), f"rollback to step {rb['restored_step']}") for rb in found["rollbacks"]]
    out += [("replica", int(ch["step"]), f"replica {ch.get('replica')} {ch.get('event')}")
            for ch in found["replica_changes"]]
    return sorted(out, key=lambda m: m[1])


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the end-of-run table for what the run healed."""
    rows: list[tuple[str, str]] = []
    if summary.get("nonfinite_skipped_steps"):
        first = (summary.get("nonfinite_skips") or [{}])[0]
        rows.append(("steps skipped (non-finite)", f"{summary['nonfinite_skipped_steps']} (first at step "
                                                   f"{first.get('step')}, {_where(first)})"))
    for rb in summary.get("rollbacks") or []:
        rows.append(("spike rollback", f"step {rb['step']} -> {rb['restored_step']}, "
                                       f"{len(rb['skipped_batches'])} batches skipped"))
    for ch in summary.get("replica_changes") or []:
        rows.append(("replica change", f"replica {ch.get('replica')} {ch.get('event')} at step {ch.get('step')}"))
    return rows

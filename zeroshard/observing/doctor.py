"""Read every rank's ledger and name the first point where the ranks diverged.

Collectives match by position: the k-th collective of every rank must be the same call. So the
ledgers are compared seq by seq over the range that every rank still holds, field by field (op,
numel, dtype, group, unit, phase; see docs/diagnostics.md). Three kinds of finding, earliest first:

- **mismatch**: at some seq the ranks issued different calls. Where one rank's entry equals
  another's *next* entry, that rank skipped a collective, and the skipped one is named;
- **never entered**: the calls agree as far as they go, but some ranks issued collective #k and
  others never did; the unit and phase of #k come from the ranks that entered it;
- **died**: a rank raised (its dump says what) or left no dump at all (killed: SIGKILL, the OOM
  killer, gloo's abort on a size mismatch); its last entries come from its dump or its ring file.

A mismatch where some rank's entry is the loop's own torch.distributed call (phase "user", recorded
by zeroshard.observing) is a **user collective**: the finding names that call and the line that made it.
Where each rank was is reported too: waiting in one of zeroshard's collectives, in its own
collective, or blocked outside them; a dump made on a failure holds every thread's Python stack.

The analysis is pure: it takes ``{rank: (header, records)}`` so the desync check can run it on
ledgers gathered in memory, and ``zeroshard doctor`` on the files.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from zeroshard.observing.doctor_pp import analyse_pp, stage_groups, stopped_text, unmatched_text

FIELDS = ("op", "numel", "dtype", "group", "unit", "phase")
LAST_ENTRIES = 4
USER_PHASE = "user"  # zeroshard.comm.collectives.USER_PHASE (not imported: the doctor needs no torch)
STACK_LINES = 24


def load(run_dir: str | Path) -> dict[int, tuple[dict, list[dict]]]:
    """Every rank's (header, records) from ``RUN_DIR/ledger``: its JSON dump merged with its ring
    file (which may be newer, and is all there is for a rank that was killed)."""
    from zeroshard.comm.ledger import read_dump
    from zeroshard.observing.ring import read_ring

    folder = Path(run_dir) / "ledger"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} does not exist: no rank left a ledger. Ledgers are written by `zeroshard train` "
            "(or a loop inside zs.observe) when a run finishes, fails or hangs; check RUN_DIR")
    ranks: dict[int, tuple[dict, list[dict]]] = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        header, records = read_dump(path)
        ranks[int(header.get("rank", path.stem.split("-")[1]))] = (header, records)
    for path in sorted(folder.glob("rank-*.ring")):
        try:
            ring_header, ring_records = read_ring(path)
        except (ValueError, OSError):
            continue
        rank = ring_header["rank"]
        if rank not in ranks:
            ranks[rank] = (ring_header, ring_records)
            continue
        header, records = ranks[rank]
        if ring_header["next_seq"] > header.get("next_seq", 0):
            # The training thread went on after the dump (a peer's alarm): the ring is newer.
            merged = {r["seq"]: r for r in records}
            merged.update({r["seq"]: r for r in ring_records})
            records = [merged[s] for s in sorted(merged)]
            header = {**header, "next_seq": ring_header["next_seq"],
                      "in_flight": [r["seq"] for r in records if r["state"] != "completed"]}
            ranks[rank] = (header, records)
    if not ranks:
        raise FileNotFoundError(f"{folder} holds no rank-R.jsonl or rank-R.ring files")
    return ranks


def entry_text(record: dict | None) -> str:
    if record is None:
        return "(nothing)"
    unit = record.get("unit") or "-"
    return (f"#{record['seq']} {record['op']}({record['numel']} x {record['dtype']}, group {record['group']}) "
            f"unit {unit} phase {record.get('phase') or '-'} step {record.get('step', '?')} [{record['state']}]")


def _fingerprint(record: dict) -> tuple:
    # An uneven all-to-all's numel is this rank's own rows (the ledger's CollectiveRecord.uneven).
    return tuple(None if f == "numel" and record.get("uneven") else record.get(f) for f in FIELDS)


def _where(record: dict) -> dict:
    return {"seq": record["seq"], "op": record["op"], "unit": record.get("unit", ""),
            "phase": record.get("phase", ""), "step": record.get("step")}


def analyse(ranks: dict[int, tuple[dict, list[dict]]], world: int | None = None) -> dict[str, Any]:
    """The doctor's findings as plain data (what ``zeroshard doctor --json`` prints)."""
    world = world or max([h.get("world", 0) for h, _ in ranks.values()] + [max(ranks) + 1])
    by_seq = {r: {rec["seq"]: rec for rec in records} for r, (_, records) in ranks.items()}
    next_seq = {r: h.get("next_seq", max(by_seq[r], default=-1) + 1) for r, (h, _) in ranks.items()}
    first_seq = {r: min(by_seq[r], default=next_seq[r]) for r in ranks}
    report: dict[str, Any] = {
        "world": world, "ranks": {}, "missing_ranks": [r for r in range(world) if r not in ranks],
        "mismatch": None, "never_entered": None, "died": [], "hang": [], "user_collective": None,
        "at": None,  # the collective the verdict names: seq, op, unit, phase, step, and the ranks at fault
    }
    hosts = rank_hosts(ranks)
    report["hosts"] = by_host(hosts, sorted(set(ranks) | set(report["missing_ranks"])))
    for r, (header, records) in sorted(ranks.items()):
        report["ranks"][r] = {
            "host": hosts.get(r),
            "source": "ring" if header.get("reason") == "ring" else "dump",
            "reason": header.get("reason"), "message": header.get("message", ""),
            "next_seq": next_seq[r], "first_seq": first_seq[r],
            "in_flight": header.get("in_flight", []),
            "last": [entry_text(rec) for rec in records[-LAST_ENTRIES:]],
            "blocked": blocked_at(header, records),
        }
        if header.get("reason") == "error":
            report["died"].append({"rank": r, "how": "raised", "message": header.get("message", ""),
                                   "last": report["ranks"][r]["last"]})
        elif header.get("reason") == "ring":
            report["died"].append({"rank": r, "how": "killed", "message": "left no dump: killed without running "
                                   "Python (SIGKILL, the OOM killer, or gloo's abort on a size mismatch)",
                                   "last": report["ranks"][r]["last"]})
        elif header.get("reason") == "hang":
            report["hang"].append({"rank": r, "message": header.get("message", "")})

    # Under pp only the ranks of one stage issue the same calls; the stages' sends and receives are
    # paired instead (zeroshard/observing/doctor_pp.py).
    groups = stage_groups({r: records for r, (_, records) in ranks.items()})
    report["pp"] = None if groups is None else analyse_pp({r: records for r, (_, records) in ranks.items()}, groups)
    members = sorted(ranks)
    for members in ([members] if groups is None else list(groups.values())):
        _compare(report, members, by_seq, first_seq, next_seq)
        if report["mismatch"] is not None or report["never_entered"] is not None:
            break
    if report["mismatch"] is not None:
        report["at"] = report["mismatch"]["at"]
        report["user_collective"] = _user_collective(report["mismatch"]["seq"], {r: ranks[r] for r in members},
                                                     by_seq, report["ranks"])
        if report["user_collective"] is not None:
            report["at"] = report["user_collective"]["at"]
    report["verdict"], report["summary"] = _verdict(report)
    return report


def _compare(report: dict, members: list[int], by_seq: dict, first_seq: dict, next_seq: dict) -> None:
    """Compare ``members``' calls seq by seq: the first mismatch, else the first call some never entered."""
    lo = max(first_seq[r] for r in members)
    hi = min(next_seq[r] for r in members)
    report["compared"] = [lo, hi]
    for seq in range(lo, hi):
        found = {r: by_seq[r].get(seq) for r in members}
        entries = {r: e for r, e in found.items() if e is not None}
        if len(entries) < len(found):
            continue
        prints = {r: _fingerprint(e) for r, e in entries.items()}
        if len(set(prints.values())) > 1:
            report["mismatch"] = _mismatch(seq, entries, prints, by_seq)
            return
    if len({next_seq[r] for r in members}) > 1:
        k = hi
        entered = sorted(r for r in members if next_seq[r] > k)
        absent = sorted(r for r in members if next_seq[r] == k)
        entry = by_seq[entered[0]].get(k)
        report["never_entered"] = {
            **(_where(entry) if entry else {"seq": k}), "entered": entered, "missing": absent,
            "entry": entry_text(entry),
        }
        report["at"] = {**(_where(entry) if entry else {"seq": k}), "ranks": absent}


def rank_hosts(ranks: dict[int, tuple[dict, list[dict]]]) -> dict[int, str]:
    """Each rank's host: from its own dump, else from a peer's list of every rank's host (a killed
    rank leaves only its ring, which has none). Empty for ledgers written before hosts were recorded."""
    out: dict[int, str] = {}
    for header, _ in ranks.values():
        out.update({r: h for r, h in enumerate(header.get("rank_hosts") or [])})
    out.update({r: header["host"] for r, (header, _) in ranks.items() if header.get("host")})
    return out


def by_host(hosts: dict[int, str], ranks: list[int]) -> dict[str, list[int]]:
    """Ranks grouped by host, hosts in the order of their first rank; {} when no host is known."""
    if not hosts:
        return {}
    out: dict[str, list[int]] = {}
    for r in ranks:
        out.setdefault(hosts.get(r, "(unknown host)"), []).append(r)
    return out


def blocked_at(header: dict, records: list[dict]) -> dict[str, Any] | None:
    """Where this rank's training thread was when it dumped: the collective it was waiting in (one of
    zeroshard's, or the loop's own), or none (blocked outside collectives); with its thread's stack."""
    stacks = header.get("stacks")
    if header.get("reason") in (None, "finished", "ring", "desync") and not stacks:
        return None
    # On NCCL a wait returns at once and the device runs the collectives in issue order, so every
    # collective queued behind a stuck one is open too (waited on, or still running on the device):
    # the stuck one is the oldest. On gloo the training thread blocks in one wait: the only one.
    on_device = set(header.get("on_device", []))
    waiting = [r for r in records if r.get("state") != "completed" and
               (r.get("wait_start") is not None or r["seq"] in on_device)]
    main = next((t for t in stacks or [] if t.get("main")), None)
    out: dict[str, Any] = {"kind": "outside", "entry": None, "where": None,
                           "thread": main["thread"] if main else None, "stack": main["stack"] if main else []}
    if waiting:
        record = min(waiting, key=lambda r: r["seq"])
        user = record.get("phase") == USER_PHASE
        out.update(kind="user" if user else "zeroshard", entry=_where(record),
                   where=header.get("user_calls", {}).get(str(record["seq"])) if user else None)
    return out


def _user_collective(seq: int, ranks: dict, by_seq: dict, infos: dict) -> dict[str, Any] | None:
    """At a mismatch: the ranks whose entry is the loop's own call, and what the others run there."""
    users = sorted(r for r in ranks if by_seq[r][seq].get("phase") == USER_PHASE)
    if not users or len(users) == len(ranks):
        return None
    where = {r: ranks[r][0].get("user_calls", {}).get(str(seq)) for r in users}
    others = {r: _where(by_seq[r][seq]) for r in sorted(ranks) if r not in users}
    first = by_seq[users[0]][seq]
    return {"ranks": users, "op": first["op"], "step": first.get("step"), "where": where, "others": others,
            "at": {**_where(first), "ranks": users}}


def _mismatch(seq: int, entries: dict[int, dict], prints: dict[int, tuple], by_seq: dict) -> dict:
    counts = Counter(prints.values())
    fields = [f for i, f in enumerate(FIELDS) if len({p[i] for p in prints.values()}) > 1]
    out: dict[str, Any] = {"seq": seq, "fields": fields,
                           "by_rank": {r: entry_text(e) for r, e in sorted(entries.items())},
                           "values": {f: {r: e.get(f) for r, e in sorted(entries.items())} for f in fields},
                           "skipped": None, "reordered": None}

    def runs_next(r: int, other: int) -> bool:
        """Rank r's entry k is rank other's entry k+1: r is one collective ahead of other."""
        later = by_seq[other].get(seq + 1)
        return later is not None and _fingerprint(later) == prints[r]

    ranks = sorted(entries)
    for r in ranks:
        for other in ranks:
            if other == r or prints[other] == prints[r] or not runs_next(r, other):
                continue
            if runs_next(other, r):
                # Each runs the other's next call: the same calls in another order.
                out["reordered"] = {"ranks": [r, other], "a": _where(entries[r]), "b": _where(entries[other])}
                out["at"] = {**_where(entries[min(r, other)]), "ranks": [max(r, other)]}
            else:
                out["skipped"] = {"rank": r, **_where(entries[other]), "ran_instead": _where(entries[r])}
                out["at"] = {**_where(entries[other]), "ranks": [r]}
            return out
    expected = counts.most_common(1)[0][0]
    if len(counts) > 1 and counts.most_common(1)[0][1] > counts.most_common(2)[1][1]:
        out["odd_ranks"] = sorted(r for r, p in prints.items() if p != expected)
    else:
        out["odd_ranks"] = [r for r in ranks if prints[r] != prints[ranks[0]]]
    reference = next(e for r, e in sorted(entries.items()) if r not in out["odd_ranks"])
    out["at"] = {**_where(reference), "ranks": out["odd_ranks"]}
    return out


def _short(message: str, limit: int = 160) -> str:
    # gloo's messages run on ("... This is typically caused by ... GLHF!"); the first sentence says it.
    first = message.split(". ")[0]
    return first if len(first) <= limit else first[:limit - 3] + "..."


def _verdict(report: dict) -> tuple[str, str]:
    died = report["died"]
    dead = "; ".join(f"rank {d['rank']} {d['how']}: {_short(d['message'])}" for d in died)
    tail = f". {dead}" if died else ""
    if report.get("user_collective") is not None:
        return "user_collective", _user_text(report["mismatch"]["seq"], report["user_collective"]) + tail
    if report["mismatch"] is not None:
        m = report["mismatch"]
        if m["skipped"] is not None:
            s = m["skipped"]
            text = (f"first divergence at collective #{m['seq']}: rank {s['rank']} never entered {s['op']} of unit "
                    f"{s['unit'] or '-'} in phase {s['phase'] or '-'} (step {s['step']}); it ran "
                    f"{s['ran_instead']['op']} of unit {s['ran_instead']['unit'] or '-'} "
                    f"({s['ran_instead']['phase']}) instead")
        elif m["reordered"] is not None:
            a, b = m["reordered"]["a"], m["reordered"]["b"]
            r1, r2 = m["reordered"]["ranks"]
            text = (f"first divergence at collective #{m['seq']} (step {a['step']}): the ranks ran the same collectives "
                    f"in another order: rank {r1} ran {a['op']} of unit {a['unit'] or '-'} ({a['phase']}) where rank "
                    f"{r2} ran {b['op']} of unit {b['unit'] or '-'} ({b['phase']})")
        else:
            at = m["at"]
            diffs = "; ".join(f"{f}: " + ", ".join(f"rank {r} {v}" for r, v in vals.items())
                              for f, vals in m["values"].items())
            text = (f"first divergence at collective #{m['seq']} ({at['op']} of unit {at['unit'] or '-'} in phase "
                    f"{at['phase'] or '-'}, step {at['step']}): {diffs}")
        return "mismatch", text + _pp_tail(report, m["at"]["ranks"]) + tail
    if report["never_entered"] is not None:
        n = report["never_entered"]
        who = ", ".join(str(r) for r in n["missing"])
        text = (f"rank{'s' if len(n['missing']) > 1 else ''} {who} never entered collective #{n['seq']} "
                f"({n.get('op', '?')} of unit {n.get('unit') or '-'} in phase {n.get('phase') or '-'}, step "
                f"{n.get('step', '?')}) that rank{'s' if len(n['entered']) > 1 else ''} "
                f"{', '.join(str(r) for r in n['entered'])} entered")
        return "never_entered", text + _pp_tail(report, n["missing"]) + tail
    pp = report.get("pp")
    if pp is not None and pp["unmatched"] is not None:
        # Every stage's ranks agree among themselves, but one stage stopped short of the schedule.
        # The peer is the one that stopped short: it never sent, or never posted the receive.
        return "pp_unmatched", unmatched_text(pp) + "; " + stopped_text(pp["unmatched"]["peer"], pp) + tail
    if died:
        return "died", dead
    if report["missing_ranks"]:
        return "incomplete", f"no ledger from ranks {report['missing_ranks']}; the others agree"
    if report["hang"]:
        return "hang", "every rank issued the same collectives, but a rank reported a hang: " + report["hang"][0]["message"]
    if pp is not None:
        return "ok", (f"no divergence: the ranks of each of the {len(set(map(tuple, pp['stages'].values())))} pp "
                      f"stage groups issued the same collectives, and every send has its receive")
    lo, hi = report["compared"]
    return "ok", f"no divergence: collectives #{lo}..#{hi - 1} match on all {len(report['ranks'])} ranks"


def _pp_tail(report: dict, ranks: list[int]) -> str:
    """Under pp: where in the schedule the ranks at fault stopped, and the send or receive left unpaired."""
    pp = report.get("pp")
    if pp is None:
        return ""
    parts = [stopped_text(r, pp) for r in ranks]
    if pp["unmatched"] is not None:
        parts.append(unmatched_text(pp))
    return ". " + "; ".join(parts)


def _user_text(seq: int, u: dict) -> str:
    who = ", ".join(str(r) for r in u["ranks"])
    made = "; ".join(f"rank {r} at {w or 'an unrecorded line'}" for r, w in u["where"].items())
    others = "; ".join(f"rank {r} is in {o['op']} of unit {o['unit'] or '-'} in phase {o['phase'] or '-'} "
                       f"(step {o['step']})" for r, o in u["others"].items())
    return (f"collective #{seq}: rank{'s' if len(u['ranks']) > 1 else ''} {who} made its own torch.distributed "
            f"{u['op']} (step {u['step']}; {made}) that the other ranks did not; there {others}")


def _blocked_lines(r: int, b: dict) -> list[str]:
    entry = b["entry"]
    if b["kind"] == "zeroshard":
        head = (f"rank {r}: waiting in collective #{entry['seq']} {entry['op']} of unit {entry['unit'] or '-'} "
                f"in phase {entry['phase'] or '-'} (step {entry['step']})")
    elif b["kind"] == "user":
        head = (f"rank {r}: blocked outside zeroshard's collectives, in its own torch.distributed {entry['op']} "
                f"(collective #{entry['seq']}, step {entry['step']}) made at {b['where'] or 'an unrecorded line'}")
    else:
        head = f"rank {r}: blocked outside zeroshard's collectives (in none of them)"
    lines = [head]
    if b["stack"]:
        lines.append(f"  Python stack of its thread {b['thread']} (most recent call last):")
        for text in b["stack"][-STACK_LINES:]:
            lines += [f"  {part}" for part in text.splitlines()]
    return lines


def render(report: dict, run_dir: str | Path | None = None) -> list[str]:
    """Human-readable lines for a report from :func:`analyse`."""
    lines = [f"zeroshard doctor: {run_dir or ''} ({report['world']} ranks)".replace(":  (", ": ("),
             f"verdict: {report['verdict'].upper()}: {report['summary']}"]
    # The per-rank view, host by host: a fault confined to one host (its network, its GPUs) shows
    # as a block of ranks.
    groups = report.get("hosts") or {None: list(report["ranks"])}
    for host, members in groups.items():
        indent = "  " if host is None else "    "
        if host is not None:
            lines.append(f"  host {host} (rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}):")
        for r in members:
            info = report["ranks"].get(r)
            if info is None:
                lines.append(f"{indent}rank {r}: left no ledger")
                continue
            what = {"ring": "no dump; read its crash-safe ring"}.get(info["source"], f"{info['reason']} dump")
            msg = f": {_short(info['message'], 240)}" if info["message"] else ""
            lines.append(f"{indent}rank {r}: {what}, {info['next_seq']} collectives issued{msg}")
    m = report["mismatch"]
    if m is not None:
        lines.append(f"collective #{m['seq']} per rank (differs in: {', '.join(m['fields'])}):")
        lines += [f"  rank {r}: {text}" for r, text in m["by_rank"].items()]
    n = report["never_entered"]
    if n is not None:
        lines.append(f"collective #{n['seq']} as entered by rank {n['entered'][0]}: {n['entry']}")
    blocked = [(r, info["blocked"]) for r, info in report["ranks"].items() if info.get("blocked")]
    if blocked:
        lines.append("where each rank was:")
        for r, b in blocked:
            lines += [f"  {line}" for line in _blocked_lines(r, b)]
    for r, info in report["ranks"].items():
        lines.append(f"last entries of rank {r}:")
        lines += [f"  {text}" for text in info["last"]]
    return lines

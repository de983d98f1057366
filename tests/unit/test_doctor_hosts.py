"""The doctor's per-rank view grouped by host, a killed rank's host taken from its peers' dumps."""

from __future__ import annotations

from zeroshard.observing.doctor import analyse, render

HOSTS = ["h0", "h0", "h1", "h1"]


def rec(seq: int) -> dict:
    return {"kind": "collective", "seq": seq, "op": "all_gather", "numel": 64, "dtype": "float32", "group": "shard",
            "bytes": 256, "unit": f"blocks.{seq}", "phase": "forward", "start": 0.0, "end": None,
            "state": "completed", "step": 1}


def dump(rank: int, reason: str, n: int) -> tuple[dict, list[dict]]:
    header = {"kind": "header", "rank": rank, "world": 4, "reason": reason, "message": "", "next_seq": n,
              "in_flight": [], "host": HOSTS[rank], "rank_hosts": HOSTS}
    return header, [rec(i) for i in range(n)]


def test_ranks_are_listed_under_their_hosts_and_a_killed_rank_keeps_its_host():
    ring = {"kind": "header", "rank": 3, "world": 4, "reason": "ring", "next_seq": 2, "in_flight": []}
    ranks = {0: dump(0, "peer", 3), 1: dump(1, "peer", 3), 2: dump(2, "peer", 3), 3: (ring, [rec(0), rec(1)])}
    report = analyse(ranks)
    assert report["hosts"] == {"h0": [0, 1], "h1": [2, 3]}
    assert report["ranks"][3]["host"] == "h1"  # the ring has no host; the peers' dumps name it
    lines = render(report)
    print("\n".join(lines[:8]))
    start = lines.index("  host h0 (ranks 0, 1):")
    assert lines[start + 1].startswith("    rank 0: peer dump") and lines[start + 2].startswith("    rank 1: ")
    assert lines[start + 3] == "  host h1 (ranks 2, 3):"
    assert lines[start + 5].startswith("    rank 3: no dump; read its crash-safe ring")


def test_ledgers_without_hosts_keep_the_flat_view():
    ranks = {r: ({k: v for k, v in dump(r, "finished", 2)[0].items() if k not in ("host", "rank_hosts")},
                 [rec(0), rec(1)]) for r in range(2)}
    report = analyse(ranks)
    assert report["hosts"] == {}
    assert any(line.startswith("  rank 0: finished dump") for line in render(report))

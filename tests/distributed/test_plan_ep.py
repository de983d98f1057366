"""The planner under expert parallelism against real ep runs of tiny-moe (2 layers) on gloo.

One spawn of world 4 (plan_ep_workloads.suite) measures stage 3 three times, each on a mesh of its
own: without ep (ZeRO-3 over all 4 ranks), at (ep 2 x edp 2) and at ep 4
(`zeroshard.tools.planner.measure.measure_many_worker`, what `plan --measure` runs). Every model-state
component, stage 3's window and the expert bytes a rank holds in full during forward must be what
the plan says, and the peak within 10%; the expert bytes held fall by ep against ZeRO-3 without it.
The same spawn trains tiny-moe at ep 2 and 4 and records the ledger's ep all-to-all bytes and the
routing counts: the planner's balanced figure is the ranks' mean exactly, and with each rank's
recorded skew it is that rank's bytes.

ep with tp, (shard 2 x tp 2, ep 2), in the same spawn: stage 3 is measured once more (model states,
window and buckets the plan's, peak within 10%), and a run's ledger holds, at the steady-state
step, every collective the plan lists for it: the expert groups' all-gathers and reduce-scatters
over edp, the dense ones over shard, the MoE layers' tp all-gathers, the attention's one tp
all-reduce per block and direction, byte for byte on every rank, and the ep all-to-alls at the
ranks' mean (each tp rank routes its run of the tokens).
"""

from __future__ import annotations

import pytest

from zeroshard.trainer.launch import spawn
from zeroshard.models import GPTConfig
from zeroshard.tools.planner import plan
import plan_ep_workloads as pw
from zeroshard.tools.planner.measure import MODEL_STATES, checks, request

pytestmark = pytest.mark.timeout(900)

WORLD, BATCH, SEQ = 4, 8, 16
EPS = (1, 2, 4)
TP_EP = "tp2ep2"
"""The key of the (shard 2 x tp 2, ep 2) plan next to the ep ones."""
CONFIG = GPTConfig.named("tiny-moe", n_layer=2, vocab_size=64, seq_len=SEQ)


@pytest.fixture(scope="module")
def plans() -> dict:
    out: dict = {ep: plan(CONFIG, world=WORLD, batch=BATCH, seq=SEQ, ep=ep, device="cpu") for ep in EPS}
    # the same global batch over 2 data-parallel ranks: 4 sequences a rank, shared by its tp group
    out[TP_EP] = plan(CONFIG, world=WORLD, batch=BATCH, seq=SEQ, ep=2, tp=pw.TP, device="cpu")
    return out


@pytest.fixture(scope="module")
def world4(plans) -> list[dict]:
    return spawn(pw.suite, WORLD, args=([request(plans[key], (3,)) for key in (*EPS, TP_EP)], EPS[1:]),
                 timeout_s=600)


@pytest.fixture(scope="module")
def measured(plans, world4) -> dict:
    """ep (or TP_EP) -> (the stage-3 ComponentCheck, the expert bytes each rank held in full during forward)."""
    per_rank = [r["measured"] for r in world4]
    return {key: (checks(plans[key], [r[i] for r in per_rank])[0],
                  [r[i][3]["expert_held_in_forward"] for r in per_rank])
            for i, key in enumerate((*EPS, TP_EP))}


@pytest.mark.parametrize("ep", [*EPS, TP_EP])
def test_per_rank_memory_is_the_plans(plans, measured, ep):
    check, _ = measured[ep]
    for name in (*MODEL_STATES, "window", "buckets"):
        predicted, got = getattr(check.predicted, name), check.measured[name]
        assert abs(predicted - got) <= max(0.001 * got, 64), (name, predicted, got)
    print(f"ep {ep}: model states {check.predicted.model_states} B planned, "
          f"{sum(check.measured[k] for k in MODEL_STATES)} B measured; peak {check.predicted.allocated} B planned, "
          f"{check.measured_total} B measured ({check.total_error:.1%})")
    assert check.total_error <= 0.10


@pytest.mark.parametrize("ep", EPS[1:])
def test_expert_bytes_held_in_forward(plans, measured, ep):
    """A rank holds its ep block of the gathered layers' experts: the plan's figure, 1/ep of what
    ZeRO-3 without ep holds (it gathers every expert of a layer)."""
    held = measured[ep][1]
    without = measured[1][1]
    print(f"ep {ep}: experts held in full during forward {max(held)} B per rank (planned "
          f"{plans[ep]['zero3'].experts['expert_held_in_forward']} B); ZeRO-3 without ep {max(without)} B")
    assert set(held) == {plans[ep]["zero3"].experts["expert_held_in_forward"]}
    assert max(held) * ep == max(without)


def test_expert_states_split_over_ep_and_edp(plans):
    """Each rank keeps 1/ep of the experts, sharded over the dp/ep ranks that hold them; the dense
    params stay sharded over all 4 (stage 3 therefore holds the same model states either way)."""
    stacked = [p for n, p in _meta().named_parameters() if ".experts." in n]
    experts = sum(p.numel() for p in stacked)
    for ep in EPS[1:]:
        zero3, zero1 = plans[ep]["zero3"].experts, plans[ep]["zero1"].experts
        assert zero3["expert_numel"] * ep == experts
        # fp32; each stacked param padded to at most 64 elements more, per shard
        assert 0 <= zero3["expert_params"] - experts * 4 / WORLD <= 4 * 64 * len(stacked)
        assert zero1["expert_params"] == zero1["expert_numel"] * 4  # stage 1 keeps the local experts whole
    assert plans[2]["zero3"].device.model_states == plans[4]["zero3"].device.model_states


def _meta():
    import torch

    from zeroshard.models import GPT

    with torch.device("meta"):
        return GPT(CONFIG)


def _planned_ep_bytes(ep: int, skew: float = 0.0) -> int:
    cfg = pw.routed_config(ep)
    p = plan(pw.ROUTED, world=WORLD, batch=cfg.batch, seq=pw.SEQ, accum=cfg.accum, ep=ep, routing_skew=skew)
    return sum(c.buffer_bytes * c.count for c in p["zero3"].collectives if c.group == "ep")


@pytest.mark.parametrize("ep", EPS[1:])
def test_all_to_all_bytes_are_the_ledgers(world4, ep):
    """Every rank sends its own tokens x top_k rows, so the ranks' mean of the ledger's ep bytes
    is the planner's balanced figure exactly; what a rank receives is its routing, and the plan
    with the skew those counts give (its mean received rows over tokens x top_k, less 1) is that
    rank's bytes, to the rounding of a row per layer call."""
    cfg = pw.routed_config(ep)
    rows = cfg.batch // (WORLD * cfg.accum) * pw.SEQ * pw.ROUTED.expert_top_k  # a micro-batch's, per rank
    row_bytes = pw.ROUTED.n_embd * 4
    balanced = _planned_ep_bytes(ep)
    for s in range(pw.STEPS):
        ledger = [r["routed"][ep]["ledger_bytes"][s] for r in world4]
        assert all(n == rows for r in world4 for n in r["routed"][ep]["sent"][s])
        assert sum(ledger) == WORLD * balanced, (ledger, balanced)
        for rank, r in enumerate(world4):
            received = r["routed"][ep]["received"][s]
            skew = sum(received) / len(received) / rows - 1
            planned = _planned_ep_bytes(ep, skew) if skew >= 0 else None
            if planned is not None:
                assert abs(planned - ledger[rank]) <= 2 * len(received) * row_bytes, (rank, planned, ledger[rank])
        print(f"ep {ep}, step {s}: ledger ep bytes per rank {ledger}, planned balanced {balanced} "
              f"(mean {sum(ledger) / WORLD:.0f})")
    skews = [sum(r["routed"][ep]["received"][0]) / len(r["routed"][ep]["received"][0]) / rows - 1 for r in world4]
    assert max(skews) > 0, "the routing must be uneven for the skewed check to test anything"


def _planned_by_key(layout) -> dict[tuple[str, str, str], int]:
    out: dict[tuple[str, str, str], int] = {}
    for c in layout.collectives:
        out[(c.op, c.group, c.phase)] = out.get((c.op, c.group, c.phase), 0) + c.buffer_bytes * c.count
    return out


def test_ep_with_tp_collectives_are_the_ledgers(world4):
    """(shard 2 x tp 2, ep 2), stage 3, accumulation 2, the steady-state step: every collective the
    plan lists is in every rank's ledger with the same bytes (the tp all-reduce's row spans forward
    and backward), the ep all-to-alls at the ranks' mean; the ledger's only others are the
    router's count all-reduce, the clip, the non-finite guard's flag and the step's metrics."""
    cfg = pw.routed_config(2, pw.TP)
    p = plan(pw.ROUTED, world=WORLD, batch=cfg.batch, seq=pw.SEQ, accum=cfg.accum, ep=2, tp=pw.TP)["zero3"]
    planned = _planned_by_key(p)
    ledgers = [r["with_tp"]["by_key"][-1] for r in world4]
    tp_reduce = planned.pop(("all_reduce", "tp", ""))
    a2a = {k: planned.pop(k) for k in [k for k in planned if k[0] == "all_to_all"]}
    for rank, ledger in enumerate(ledgers):
        assert {k: ledger.get(k) for k in planned} == planned, rank
        assert ledger[("all_reduce", "tp", "forward")] + ledger[("all_reduce", "tp", "backward")] == tp_reduce
        others = set(ledger) - set(planned) - set(a2a) - {("all_reduce", "tp", "forward"), ("all_reduce", "tp", "backward")}
        # (the non-finite guard's flag rides with the clip, and under tp the clip's norm is not the world's)
        assert {k for k in others if k[2] not in ("clip", "metrics", "guard")} == {("all_reduce", "dp", "forward")}, \
            others
    for key, nbytes in a2a.items():
        assert sum(ledger[key] for ledger in ledgers) == WORLD * nbytes, (key, [ledger[key] for ledger in ledgers])
    rows = cfg.batch // (WORLD // pw.TP * cfg.accum) * pw.SEQ // pw.TP * pw.ROUTED.expert_top_k  # a tp run's
    assert all(n == rows for r in world4 for n in r["with_tp"]["sent"][-1])
    print(f"ep 2 x tp 2: planned per step {sorted(planned.items())}, tp all-reduce {tp_reduce}, all-to-all "
          f"{sorted(a2a.items())}; ledger all-to-all per rank {[[led[k] for k in sorted(a2a)] for led in ledgers]}")

"""LoRA at stage 3 on 2 ranks: per-rank memory measured in one real step against the planner, and
against full fine-tuning of the same model (the frozen base holds only its sharded weights)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from zeroshard.models import GPTConfig  # noqa: E402
from zeroshard.tools.planner import plan  # noqa: E402
from zeroshard.tools.planner.inventory import meta_gpt  # noqa: E402
from zeroshard.tools.planner.measure import checks, measure_many_worker, request  # noqa: E402
from zeroshard.trainer.launch import spawn  # noqa: E402
from zeroshard.trainer.lora import inject_lora  # noqa: E402

WORLD = 2
MODEL = GPTConfig.named("small", n_layer=2)
LORA = dict(r=8, alpha=16.0, targets="all-linear")
TARGET = 0.10

pytestmark = pytest.mark.timeout(900)


def test_lora_stage3_memory_matches_the_plan_and_undercuts_full_finetuning():
    lora_plan = plan(inject_lora(meta_gpt(MODEL), **LORA), world=WORLD, batch=2, seq=128, device="cpu")
    full_plan = plan(MODEL, world=WORLD, batch=2, seq=128, device="cpu")
    reqs = [request(lora_plan, (3,), lora=LORA), request(full_plan, (3,))]
    spawned = spawn(measure_many_worker, WORLD, args=(reqs,), timeout_s=600)
    lora, full = (checks(p, [r[i] for r in spawned])[0] for i, p in enumerate((lora_plan, full_plan)))
    states = {name: {k: c.measured[k] for k in ("params", "grads", "master", "optimizer")}
              for name, c in (("lora", lora), ("full", full))}
    for name, c in (("lora", lora), ("full", full)):
        print(f"{name} stage 3 world {WORLD}: model states {c.predicted.model_states} predicted vs "
              f"{sum(states[name].values())} measured ({c.model_state_error:.1%}), peak {c.predicted_peak} vs "
              f"{c.measured_total} ({c.total_error:.1%}); {states[name]}")
    print(f"lora / full per-rank peak: {lora.measured_total / full.measured_total:.2f}, model states "
          f"{sum(states['lora'].values()) / sum(states['full'].values()):.2f}")
    assert abs(lora.model_state_error) <= TARGET and abs(lora.total_error) <= TARGET
    # The base's weights only (plus the adapters, 3% of them here): no master, grad or optimizer
    # state beyond the adapters' own.
    assert states["full"]["params"] < states["lora"]["params"] < 1.05 * states["full"]["params"]
    assert states["lora"]["grads"] < 0.05 * states["full"]["grads"]
    assert states["lora"]["optimizer"] < 0.05 * states["full"]["optimizer"]
    assert lora.measured_total < 0.7 * full.measured_total  # activations are the same in both

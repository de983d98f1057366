"""Debug mode (check_schedule): the engine's every step is compared with its schedule as it runs."""

from __future__ import annotations

import pytest

from zeroshard.trainer.launch import spawn


def _run(stage: int, accum: int, check_mismatch: bool) -> dict:
    import torch

    import zeroshard as zs
    from zeroshard.trainer import step
    from zeroshard.trainer.config import TrainConfig
    from zeroshard.trainer.data import build_dataset, collate
    from zeroshard.models import GPT, GPTConfig
    from zeroshard.runtime import ScheduleMismatchError

    mesh = zs.init()
    model_cfg = GPTConfig.named("tiny", seq_len=16)
    data = build_dataset(seq_len=16, num_samples=64, seed=0)
    cfg = TrainConfig(stage=stage, nproc=mesh.world, batch=8, seq_len=16, accum=accum, check_schedule=True,
                      checkpointing="all" if stage == 3 else "none")
    torch.manual_seed(0)
    run = step.build(cfg, mesh, model=GPT(model_cfg), dataset=data)
    for _ in range(3):
        step.step(run, *collate(run.dataset, run.sampler.next_indices()))
    if not check_mismatch:
        return {"steps": 3}
    # A collective the schedule does not have, inside a step and on one of the model's units: the
    # check must name it rather than pass.
    x, y = collate(run.dataset, run.sampler.next_indices())
    unit = zs.runtime.get_engine(run.model).units[0].name
    zs.comm.collectives.all_reduce(torch.zeros(4), unit=unit, phase="backward")  # before the step's forward
    try:
        run.model(x, y)  # the forward starts the step; the stray record came before it: not counted
        zs.comm.collectives.all_reduce(torch.zeros(4), unit=unit, phase="backward")
        step.optimizer_step(run.model, run.opt, clip=0.0)
    except ScheduleMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.parametrize("stage,accum", [(0, 1), (2, 2), (3, 2)])
def test_check_schedule_passes_on_real_steps(stage, accum):
    assert spawn(_run, 2, args=(stage, accum, False), timeout_s=300) == [{"steps": 3}, {"steps": 3}]


def test_check_schedule_names_a_collective_the_schedule_lacks():
    results = spawn(_run, 2, args=(3, 1, True), timeout_s=300)
    for result in results:
        assert result["error"] and "differs from the step schedule" in result["error"], result

"""`zeroshard train`'s words on where the ranks run: the topology line, the cross-host shard advice,
and the modelled cost added to a refused cross-host tp layout (zeroshard/tools/planner/placement.py)."""

from __future__ import annotations

from typing import Any, Mapping

from zeroshard.comm.topology import CrossHostError, placement_text


def _gpt(config: Mapping[str, Any] | None) -> Any:
    """The run's GPTConfig, or None for a model the planner does not size (a Hugging Face one)."""
    from zeroshard.models import GPTConfig

    try:
        return GPTConfig(**config) if config else None
    except TypeError:
        return None


def topology_lines(info: Mapping[str, Any], train: Mapping[str, Any] | None) -> list[str]:
    """Rank 0's start-up lines: hosts x ranks and where each dim runs, then the shard advice if any."""
    summary = info.get("topology")
    if not summary:
        return []
    lines = [f"topology: {placement_text(summary)}"]
    model = _gpt(info.get("model_config"))
    if train is not None and model is not None and not summary["inside_host"]["shard"]:
        from zeroshard.tools.planner.placement import shard_group_advice

        advice = shard_group_advice(model, train, summary)
        if advice is not None:
            lines.append(f"warning: {advice.text}")
    return lines


def failure_text(err: BaseException, train: Mapping[str, Any]) -> str:
    """One line for a rank's failure; a refused cross-host tp layout gets the planner's modelled cost."""
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    if not isinstance(err, CrossHostError) or err.dim != "tp":
        return text
    from zeroshard.models import GPTConfig
    from zeroshard.tools.planner.placement import cross_host_tp_cost

    try:
        model = GPTConfig.named(train["model"], seq_len=train["seq_len"])
        world = int(train["nproc"])
        cost = cross_host_tp_cost(model, train, world=world, ranks_per_host=err.ranks_per_host)
    except (ValueError, KeyError, TypeError):  # a model the planner does not size: the refusal stands alone
        return text
    return f"{text}; {cost}"

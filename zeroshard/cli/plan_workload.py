"""The workload `plan time` prices, from its flags: a preset shape, a folder's or hf: model's config, or
zeroshard's GPT, with the checkpointing, tp and ep checks those flags need. `plan time` and
`plan time --pp` both read it."""

from __future__ import annotations
import argparse
from typing import Any
from zeroshard.tools.sim.workload import SHAPES, TORCHTITAN_POLICIES, Workload, gpt_shape

DEFAULT_SEQ = 8192


def workload(args: argparse.Namespace, world: int) -> tuple[Workload, Any]:
    """The workload and, for zeroshard's GPT presets, a memory function from the full planner."""
    from zeroshard.tools.sim.memory import gpt_peak_bytes

    headroom = _headroom(args)
    if args.model is None:
        raise ValueError("plan time needs --model (a zeroshard preset, " + ", ".join(SHAPES) + ", a save_pretrained "
                         "folder or hf:NAME)")
    accum = getattr(args, "accum", 1) or 1  # plan's --accum: micro-steps per optimizer step
    checkpointing = _knobs(args)["checkpointing"]
    tp = getattr(args, "tp", 1) or 1
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} does not divide world {world}; pick a tp that divides every world size")
    # The batch is split over the data-parallel ranks; the ranks of a tp group share theirs.
    cp = getattr(args, "cp", None) or 1  # a cp group shares its samples too (each rank holds seq / cp of each)
    if world % (tp * cp):
        raise ValueError(f"--tp {tp} x --cp {cp} does not divide world {world}; pick degrees whose product divides it")
    mb = args.micro_batch or (max(1, args.batch // (world // tp // cp * accum)) if args.batch else 1)
    # --mp fp32 computes (and all-reduces tp activations) in fp32; otherwise the bf16 of GPU runs.
    compute_bytes = 4 if getattr(args, "mp", None) == "fp32" else 2
    ep = getattr(args, "ep", None) or 1
    skew = getattr(args, "routing_skew", None) or 0.0
    if args.model in SHAPES:
        shape = SHAPES[args.model]
        _check_tp_split(shape, tp)
        w = Workload(shape=shape, micro_batch=mb, seq=args.seq or DEFAULT_SEQ,
                     checkpointing=checkpointing, accum=accum, compute_bytes=compute_bytes)
        _check_ep(shape, ep)
        return w, None
    from zeroshard.trainer.targets import is_preset

    if not is_preset(args.model):  # a folder, hf:NAME or module:Class: the shape its config gives
        from zeroshard.trainer.targets import build_target
        from zeroshard.tools.sim.hf_shape import hf_shape

        model = build_target(args.model, vocab_size=getattr(args, "vocab_size", None), seq_len=args.seq or DEFAULT_SEQ,
                             config=getattr(args, "model_config", None))
        shape = hf_shape(model, args.model)
        _check_tp_split(shape, tp)
        if ep > 1:  # the runtime's own check of the model's MoE layers (no MoE layer, an ep not dividing them)
            from zeroshard.parallel.experts import check_ep

            check_ep(model, ep)
        w = Workload(shape=shape, micro_batch=mb, seq=args.seq or DEFAULT_SEQ,
                     checkpointing=checkpointing, accum=accum, compute_bytes=compute_bytes, routing_skew=skew)
        return w, None
    from zeroshard.models import GPTConfig

    if checkpointing in TORCHTITAN_POLICIES:
        raise ValueError(f"--checkpointing {checkpointing} is for the Llama shapes; zeroshard's GPT takes "
                         "none, all, every:K or sqrt")
    cfg = GPTConfig.named(args.model, **({"vocab_size": args.vocab_size} if getattr(args, "vocab_size", None) else {}))
    if ep > 1:
        from zeroshard.parallel.experts import check_ep
        from zeroshard.tools.planner.inventory import meta_gpt

        check_ep(meta_gpt(cfg), ep)
    w = Workload(shape=gpt_shape(cfg, args.model), micro_batch=mb, seq=args.seq or cfg.seq_len,
                 checkpointing=checkpointing, accum=accum, compute_bytes=compute_bytes, routing_skew=skew)
    return w, lambda layout: gpt_peak_bytes(args.model, w, layout, headroom=headroom)


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's knobs the replay models: the runtime's defaults, with the flags given on top."""
    from zeroshard.cli.typed_flags import given_knobs
    from zeroshard.runtime.options import KNOBS
    from zeroshard.tools.sim.step import SIMULATED_KNOBS

    return {k.name: k.default for k in KNOBS if k.name in SIMULATED_KNOBS} | given_knobs(args, SIMULATED_KNOBS)


def _headroom(args: argparse.Namespace) -> float:
    """plan's --headroom (allocator headroom on top of the peak), the planner's 10% when absent."""
    value = getattr(args, "headroom", None)
    return 0.10 if value is None else value


def _check_ep(shape, ep: int) -> None:
    """The Llama shapes are dense: ep has no experts to split there."""
    if ep > 1 and not shape.n_expert:
        raise ValueError(f"--ep {ep} splits MoE experts, but {shape.name} has a dense MLP; drop --ep or plan an MoE "
                         "model (tiny-moe, an HF Mixtral or Qwen-MoE folder)")


def _check_tp_split(shape, tp: int) -> None:
    """A Llama shape split Megatron-style: tp must divide the query heads, the KV heads and the MLP width."""
    head_dim = shape.hidden // shape.n_head
    for what, size in (("n_head", shape.n_head), ("KV heads", shape.kv_dim // head_dim), ("the MLP width", shape.ffn)):
        if size % tp:
            raise ValueError(f"--tp {tp} does not divide {what} ({size}) of {shape.name}; pick a tp that divides it")


def model_target(args: argparse.Namespace) -> Any:
    """--model as a non-preset target (a trainer ``Target``), with what it is built with: `plan` builds it
    on meta, and --measure's ranks build it again. `plan` and `plan --pp` both read it."""
    from zeroshard.trainer.targets import Target

    return Target(spec=args.model, vocab_size=args.vocab_size, seq_len=args.seq or 64, config=args.model_config)

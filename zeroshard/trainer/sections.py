"""The sections of a `TrainConfig`: each one a TOML table, a group of flags in `--help`, and a
dataclass that checks its own fields (types and ranges); what needs two sections at once (a batch
over the data-parallel ranks, quantized grads at a stage that shards them) is checked by TrainConfig.

Inside a table a key drops the prefix that used to stand in for its section (`[pipeline] schedule`,
`[checkpoint] dir`). The flat spellings (`pp_schedule = "gpipe"`, `--pp-schedule`) are still read:
`FLAT` maps each to its section and field.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Mapping

from zeroshard.comm.dims import ParallelDims
from zeroshard.parallel.cp.layout import CP_SCHEMES
from zeroshard.trainer.schedules import DEFAULT_SCHEDULE, WARMUP_SHAPES as WARMUP_SHAPES, check_schedule

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
"""torch.compile backends `compile_backend` accepts (a library caller may pass any registered one)."""
RESUME_MODES = ("auto", "fresh-ok")
PACKING_MODES = ("on", "off")


def check_values(values: Mapping[str, Any], types: Mapping[str, Any], names: Mapping[str, str] | None = None
                 ) -> dict[str, Any]:
    """TOML and flags both deliver loosely typed values; catch "steps = '10'" here, with the key's
    flat name, rather than as a TypeError deep inside the training loop. An int given for a float
    becomes a float ("peak_flops = 100000000000" in TOML is an int)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        allowed = typing.get_args(types[key]) or (types[key],)
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not (value is None and type(None) in allowed) and not any(
                isinstance(value, t) and not (isinstance(value, bool) and t is not bool)
                for t in allowed if t is not type(None)):
            expected = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{(names or {}).get(key, key)}={value!r} has type {type(value).__name__}; "
                             f"expected {expected}")
        out[key] = value
    return out


def check_types(obj: Any, names: tuple[str, ...] | None = None) -> None:
    """``check_values`` over a dataclass's own fields (``names``: only these), in place."""
    hints = typing.get_type_hints(type(obj))
    keys = names if names is not None else tuple(f.name for f in dataclasses.fields(obj))
    flat = {k: flat_name(type(obj), k) for k in keys}
    checked = check_values({k: getattr(obj, k) for k in keys}, {k: hints[k] for k in keys}, flat)
    for key, value in checked.items():
        object.__setattr__(obj, key, value)


def _at_least(section: Any, low: int | float, *names: str, note: str = "") -> None:
    for name in names:
        if getattr(section, name) < low:
            raise ValueError(f"{flat_name(type(section), name)}={getattr(section, name)} must be >= {low}{note}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """[data]: what is read and in what shape."""

    TABLE: ClassVar[str] = "data"
    FLAT: ClassVar[dict[str, str]] = {"path": "data"}

    path: str | None = None
    """Path to a text file for byte-level training, a folder of token files (from `zeroshard data
    prepare`, or nanoGPT's .bin; see docs/data.md), a JSONL, JSON, Parquet or Arrow file of records
    (`text`, chat `messages`, or `prompt` and `completion`; the loss covers the assistant and
    completion tokens), or None for the synthetic Markov source (whose entropy floor is known exactly)."""

    batch: int = 16
    """GLOBAL batch in sequences per optimizer step, split evenly over ranks. It does not change
    with the world size, so runs at any world size see the same data."""

    seq_len: int = 64
    """Tokens per sequence (the model's context length is set to this)."""

    num_samples: int = 4096
    """Sequences in the synthetic dataset (ignored for a text file)."""

    vocab_size: int = 16
    """Tokens in the synthetic Markov source (a text file is always 256 bytes). Small by default
    so that the tiny model reaches the entropy floor in minutes on a CPU."""

    order: int = 2
    """Order k of the synthetic Markov chain: each token depends on the previous k. With k >= 2
    the model must learn to attend backwards, so the loss plateaus before it falls."""

    tokenizer: str | None = None
    """Tokenizer folder for record data (its chat template renders `messages`); None takes the model
    folder's own."""

    packing: str = "on"
    """Record data: 'on' packs several samples into each sequence (positions restart per sample and
    attention stays inside it: the same loss as unpacked), 'off' pads one sample per sequence."""

    doc_mask: bool = False
    """Token folders: attention stops at each EOS `data prepare` wrote between documents, so a window
    never attends across a document end (positions restart after each EOS)."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 1, "batch", "seq_len", "num_samples", "order")
        if self.packing not in PACKING_MODES:
            raise ValueError(f"packing={self.packing!r} is invalid; use 'on' (pack samples) or 'off' (pad them)")
        _at_least(self, 2, "vocab_size")
        if self.path is None and self.num_samples < self.batch:
            raise ValueError(f"num_samples={self.num_samples} is smaller than one global batch ({self.batch}); "
                             "raise num_samples or lower batch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimSection:
    """[optim]: the optimizer, its learning-rate schedule and how many steps it takes."""

    TABLE: ClassVar[str] = "optim"
    FLAT: ClassVar[dict[str, str]] = {}

    steps: int = 100
    """Optimizer steps to run."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""

    lr_schedule: str = DEFAULT_SCHEDULE
    """The learning-rate schedule by name (zeroshard/trainer/schedules.py): warmup_cosine (zeroshard's), the HF
    Trainer's lr_scheduler_type values (linear, cosine, cosine_with_min_lr, constant, constant_with_warmup,
    polynomial, warmup_stable_decay) or DeepSpeed's (WarmupLR, WarmupDecayLR, WarmupCosineLR), each with its
    own formula at 0-based step s."""

    min_lr: float = 1e-4
    """The floor the decay ends at: warmup_cosine, cosine_with_min_lr, polynomial (HF's lr_end),
    warmup_stable_decay (min_lr_ratio·lr) and WarmupCosineLR (cos_min_ratio·lr)."""

    warmup: int = 10
    """Warm-up steps (warmup_num_steps in DeepSpeed's schedules, which warm up over at least 2)."""

    warmup_shape: str = "linear"
    """How warm-up climbs: `linear`, `log` (DeepSpeed's schedules, where it is the default, and warmup_cosine:
    most of the climb in the first steps), `cosine` or `1-sqrt` (warmup_stable_decay)."""

    warmup_min_lr: float = 0.0
    """Where DeepSpeed's warm-up starts (WarmupLR's warmup_min_lr; WarmupDecayLR decays back to it)."""

    power: float = 1.0
    """polynomial's power."""

    decay_steps: int | None = None
    """warmup_stable_decay's decay phase in steps; None takes decay_ratio of the steps."""

    decay_ratio: float = 0.1
    """warmup_stable_decay's decay phase as a share of the steps, when decay_steps is None."""

    decay_shape: str = "cosine"
    """warmup_stable_decay's decay: linear, cosine or 1-sqrt."""

    weight_decay: float = 0.1
    """AdamW weight decay, applied to >=2-D weights only (see `zeroshard.optim_groups`)."""

    optimizer: str | dict = "adamw"
    """adamw, muon (Muon for the hidden matrices, AdamW for embeddings, head, norms and biases), adafactor,
    or module:Class for a class of your own; a TOML [optimizer] table takes name = "..." and the class's
    options (per_tensor = true or elementwise = true declare your own class; zeroshard/trainer/optimizers.py)."""

    clip: float = 1.0
    """Clip the GLOBAL gradient norm (over every shard, tied params counted once) to this value;
    0 disables clipping."""

    accum: int = 1
    """Gradient-accumulation micro-steps per optimizer step. Each rank's share of the global batch
    is split into `accum` micro-batches; the loss is normalised by the global token count."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 1, "steps", "accum")
        _at_least(self, 0, "warmup", note=" (0 disables warm-up)")
        _at_least(self, 0, "weight_decay", "clip")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must lie in [0, lr={self.lr}]")
        if self.power <= 0 or not 0 <= self.decay_ratio <= 1 or (self.decay_steps or 0) < 0:
            raise ValueError(f"power={self.power} must be > 0, decay_ratio={self.decay_ratio} in [0, 1] and "
                             f"decay_steps={self.decay_steps} >= 0")
        check_schedule(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelSection:
    """[parallel]: the degrees the run asks for; `dims(nproc)` is the layout they make
    (zeroshard/comm/dims.py checks it)."""

    TABLE: ClassVar[str] = "parallel"
    FLAT: ClassVar[dict[str, str]] = {}

    shard_size: int | None = None
    """Hybrid sharding: shard inside groups of this many consecutive ranks and replicate across
    groups (world/shard_size replicas). None shards over the whole world."""

    tp: int = 1
    """Tensor parallelism: split each block's matmuls over this many consecutive ranks (Megatron's
    column/row split through torch's DTensor; docs/tensor_parallel.md). ZeRO then shards over the
    nproc/tp data-parallel ranks, which split the batch; the ranks of one tp group share theirs. Needs a
    model with a TP plan: tiny, small, medium or hf:llama-tiny. 1 is no tensor parallelism."""

    ep: int = 1
    """Expert parallelism: split every MoE layer's experts over this many consecutive data-parallel
    ranks and route tokens to them by all-to-all (docs/expert_parallel.md). Dense params are sharded
    as without it; each expert over the nproc/ep ranks that hold it. Needs an MoE model whose expert
    count ep divides: tiny-moe, or an HF Mixtral or Qwen-MoE save_pretrained folder (each rank reads
    its block of experts). Checkpoints record each expert's placement: a run resumes at any ep. 1 is no
    expert parallelism."""

    pp: int = 1
    """Pipeline parallelism: cut the model's blocks into this many stages, one per group of nproc/pp
    consecutive ranks, ZeRO (at `stage`) inside each stage over its ranks; torch's own schedules run
    them (docs/pipeline.md). Needs zeroshard's GPT, hf:llama-tiny or a pretrained folder of a Llama,
    Mistral, Qwen2 or Qwen3 decoder, or of a Mixtral, Qwen2-MoE or Qwen3-MoE one; composes with tp
    (nproc = pp x data-parallel x tp) and with ep (each stage's experts split over ep of its ranks).
    1 is no pipeline."""

    cp: int = 1
    """Context parallelism: split every sequence over this many ranks (between the data-parallel
    ranks and tp); attention exchanges keys and values over them (`cp_attention`), ZeRO shards over
    data-parallel x cp ranks (docs/context_parallel.md). Needs zeroshard's GPT or an HF model whose
    attention goes through transformers' attention interface; composes with pp, ep and packed
    documents. 1 is no context parallelism."""

    cp_attention: str = "ring"
    """How attention sees the whole sequence under cp: "ring" (keys/values passed around the cp ranks,
    load-balanced causal chunks: seq divisible by 2 x cp) or "ulysses" (all-to-all from sequence to
    head shards: heads and kv heads divisible by cp)."""

    allow_cross_host: bool = False
    """Run tp (or ep) groups that span hosts anyway. Without it such a layout is refused at start,
    since every per-layer tp collective would cross the host network (docs/topology.md)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("tp", "ep", "pp", "cp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (1 is no {name} parallelism)")
        if self.cp_attention not in CP_SCHEMES:
            raise ValueError(f"cp_attention={self.cp_attention!r} is not a scheme; use one of {', '.join(CP_SCHEMES)}")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size={self.shard_size} must be >= 1, or unset to shard over every rank")

    def dims(self, nproc: int) -> ParallelDims:
        """The layout of ``nproc`` ranks these degrees make; a degree that does not fit is one line."""
        return ParallelDims.of(nproc, pp=self.pp, tp=self.tp, shard=self.shard_size, ep=self.ep, cp=self.cp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSection:
    """[pipeline]: how the stages `parallel.pp` cuts are scheduled."""

    TABLE: ClassVar[str] = "pipeline"
    FLAT: ClassVar[dict[str, str]] = {"schedule": "pp_schedule", "stages_per_rank": "pp_stages_per_rank",
                                      "blocks": "pp_blocks"}

    schedule: str = "1f1b"
    """The pipeline schedule (torch.distributed.pipelining's): gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble or
    looped-bfs (the last two run several stages per rank)."""

    microbatches: int = 0
    """Microbatches per schedule run (each accumulation step's batch slice is split into them);
    0 takes pp x stages per rank. 1F1B needs at least pp."""

    stages_per_rank: int = 0
    """Stages each pipeline rank holds: 0 takes the schedule's own (1, or 2 for interleaved-1f1b and
    looped-bfs); blocks are split over pp x this many stages."""

    blocks: str = ""
    """Dotted path of the model's blocks (its ModuleList, e.g. 'transformer.h') for a model whose
    blocks zeroshard cannot find itself; empty: found from the model."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 0, "microbatches", "stages_per_rank", note=" (0 takes the schedule's own)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommSection:
    """[comm]: what the collectives send."""

    TABLE: ClassVar[str] = "comm"
    FLAT: ClassVar[dict[str, str]] = {"quant": "comm_quant", "quant_block": "comm_quant_block"}

    quant: str = "none"
    """Quantized communication: 'none', or 'weights' (stage 3 all-gathers weights as blockwise int8
    plus fp32 scales; masters stay exact), 'grads' (stages 2-3 reduce grads as int8 pieces through an
    all-to-all, summed in fp32 by the owner), 'grads+ef' (the same with error feedback: each rank
    carries its rounding error into its next reduction, one fp32 value per grad element), or
    weights with either, comma-separated ('weights,grads', 'weights,grads+ef')."""

    quant_block: int = 256
    """Elements per quantization block (one fp32 scale each); a power of two."""

    backend: str | None = None
    """The collective backend, gloo or nccl; None takes ZEROSHARD_BACKEND (how a torchrun job picks
    one), else nccl where CUDA is visible and gloo elsewhere. NCCL runs one rank per GPU, so more
    local ranks than GPUs is refused; gloo's ranks may share one."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r} is invalid; use gloo or nccl (or leave it unset for the default)")
        parts = self.parts
        if parts - {"weights", "grads", "grads+ef"} or {"grads", "grads+ef"} <= parts:
            raise ValueError(f"comm_quant={self.quant!r} is invalid; use 'none', 'weights', 'grads', "
                             "'grads+ef' (with error feedback) or weights with either, e.g. 'weights,grads+ef'")
        block = self.quant_block
        if block <= 0 or block & (block - 1):
            raise ValueError(f"comm_quant_block={block} must be a positive power of two (e.g. 256)")

    @property
    def parts(self) -> set[str]:
        """What is quantized (the rules of zeroshard.comm.quant.CommQuant, read without torch)."""
        return {p.strip() for p in self.quant.split(",") if p.strip()} - {"none"}

    def check_stage(self, stage: int) -> None:
        if "weights" in self.parts and stage != 3:
            raise ValueError(f"comm_quant=weights needs stage 3 (weights are all-gathered only there); "
                             f"got stage {stage}: pass --stage 3 or drop weights")
        if self.parts & {"grads", "grads+ef"} and stage < 2:
            raise ValueError(f"comm_quant=grads needs stage 2 or 3 (a sharded grad reduction); got stage "
                             f"{stage}: pass --stage 2 or 3 or drop grads")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileSection:
    """[compile]: torch.compile of the blocks."""

    TABLE: ClassVar[str] = "compile"
    FLAT: ClassVar[dict[str, str]] = {"enabled": "compile", "backend": "compile_backend"}

    enabled: bool = False
    """torch.compile each block's forward (zs.shard's compile=); the runtime's hooks stay eager.
    See docs/compile.md."""

    backend: str = "inductor"
    """Backend for `compile`: inductor (needs a C++ compiler on CPU), aot_eager, eager or cudagraphs."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend={self.backend!r} is invalid; use one of {COMPILE_BACKENDS}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """[checkpoint]: when and where the run saves, and what it resumes from."""

    TABLE: ClassVar[str] = "checkpoint"
    FLAT: ClassVar[dict[str, str]] = {"every": "save_every", "dir": "ckpt_dir", "background": "save_async"}

    every: int = 0
    """Save a checkpoint every this many optimizer steps into `ckpt_dir`; 0 never saves."""

    dir: str | None = None
    """Checkpoint directory: one `step-NNNNNNNN` subdirectory per save, plus a `latest` pointer."""

    resume: str | None = None
    """'auto' continues from the newest checkpoint in `ckpt_dir` that verifies, naming any it skips;
    an empty or missing `ckpt_dir` starts fresh, but checkpoints of which none verifies are an error
    (nothing is deleted). 'fresh-ok' is 'auto' that starts from step 0 instead of that error. A path
    continues from that checkpoint. The world size and stage may differ from the saved run's."""

    keep_last: int = 3
    """Verified checkpoints of this run kept in `ckpt_dir`; after each save has committed and verified,
    older verified ones of this run are deleted, and any that fails verification is renamed
    `<name>.corrupt` (never deleted). 0 keeps all."""

    background: bool = False
    """Save in the background: each rank copies its shards to host memory (pinned on CUDA) and
    training goes on while the files are written, hashed and committed (one save in flight at a
    time; a crash mid-write leaves the previous checkpoint as the newest). Costs host memory of
    the size of the rank's checkpoint files."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 0, "every", "keep_last", note=" (0 disables it)")
        if self.every and self.dir is None:
            raise ValueError(f"save_every={self.every} needs ckpt_dir: pass --ckpt-dir DIR")
        if self.resume in RESUME_MODES and self.dir is None:
            raise ValueError(f"resume={self.resume!r} searches ckpt_dir, which is not set: pass --ckpt-dir DIR")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
    """[lora]: train LoRA adapters (peft) on a frozen base model; r = 0 trains the whole model."""

    TABLE: ClassVar[str] = "lora"
    FLAT: ClassVar[dict[str, str]] = {"r": "lora_r", "alpha": "lora_alpha", "dropout": "lora_dropout",
                                      "targets": "lora_targets"}

    r: int = 0
    """LoRA rank; 0 is no adapters (full fine-tuning). With r > 0 the base params are frozen and held only
    in the compute dtype (no master, grad or optimizer state), the adapters train in fp32."""

    alpha: float = 16.0
    """LoRA's alpha: the adapter's update is scaled by alpha / r."""

    dropout: float = 0.0
    """Dropout on the adapters' input."""

    targets: str = "all-linear"
    """The modules that get adapters: comma-separated module names or suffixes (q_proj,v_proj), as peft's
    target_modules, or all-linear (every linear layer but the output head)."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 0, "r", note=" (0 trains the whole model)")
        if self.r and (self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.targets.strip()):
            raise ValueError(f"lora_alpha={self.alpha} must be > 0, lora_dropout={self.dropout} in [0, 1) and "
                             f"lora_targets={self.targets!r} must name modules")

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObserveSection:
    """[observe]: what the run records and prints, and how it watches for hangs."""

    TABLE: ClassVar[str] = "observe"
    FLAT: ClassVar[dict[str, str]] = {}

    run_dir: str | None = None
    """Where metrics.jsonl and config.json go; None means runs/<timestamp>."""

    log_every: int = 10
    """Steps between printed loss lines (the progress bar, when shown, updates every step)."""

    hang_timeout_s: float = 600.0
    """Seconds a rank may stay blocked in one collective before the watchdog dumps every rank's
    ledger to RUN_DIR/ledger and ends the run with the collective's name (`zeroshard doctor RUN_DIR`
    explains it). The process-group timeout is set a little later. A rank that dies is detected at
    once, not after this."""

    desync_check: int = 0
    """Every this many steps, compare a hash of each rank's collective sequence with one tiny
    all-gather and stop with the first divergence if they differ; 0 disables."""

    profile: bool = True
    """Per-step time breakdown, overlap ratio, memory and MFU in metrics.jsonl and the summary."""

    trace: bool = False
    """Write a Chrome/Perfetto trace per rank to RUN_DIR/trace/rank-R.json (compute and
    collective lanes)."""

    log: str = "none"
    """Experiment loggers that get metrics.jsonl's scalars: 'tensorboard' (RUN_DIR/tensorboard),
    'wandb', both comma-separated, or 'none' (`pip install 'zeroshard[log]'`)."""

    peak_flops: float | None = None
    """Peak FLOP/s of one rank's device, for MFU; None measures it with a short matmul at start
    (pass the datasheet figure to compare against that instead)."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 1, "log_every")
        _at_least(self, 0, "desync_check", note=" (0 disables it)")
        if self.hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s={self.hang_timeout_s} must be > 0")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"peak_flops={self.peak_flops} must be > 0 FLOP/s, or unset to measure it")
        loggers = [n.strip() for n in self.log.split(",") if n.strip() and n.strip() != "none"]
        unknown = [n for n in loggers if n not in LOGGERS]
        if unknown:
            raise ValueError(f"unknown logger {unknown[0]!r}: choose from {', '.join(LOGGERS)} (comma-separated)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    """[eval]: held-out loss and perplexity during training."""

    TABLE: ClassVar[str] = "eval"
    FLAT: ClassVar[dict[str, str]] = {"data": "eval_data", "every": "eval_every"}

    data: str | None = None
    """Held-out data, read as `data` is (the same tokenizer, packing and seq_len); its loss is the exact
    token mean over every sample, each rank evaluating its share. None: no evaluation."""

    every: int = 0
    """Evaluate every this many optimizer steps, and after the last one; 0 only after the last."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 0, "every", note=" (0 evaluates after the last step only)")
        if self.every and self.data is None:
            raise ValueError(f"eval_every={self.every} needs held-out data: pass --eval-data PATH")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealSection:
    """[heal]: what the run does about a bad step, a loss spike and a lost replica."""

    TABLE: ClassVar[str] = "heal"
    FLAT: ClassVar[dict[str, str]] = {}

    skip_nonfinite: bool = True
    """Skip, on every rank, a step whose loss or global grad norm is not finite (one flag all ranks
    agree on; zeroshard/runtime/guard.py): counted, logged, and diagnosed (first rank, first unit)."""

    max_bad_steps: int = 5
    """Stop after this many consecutive skipped steps, writing RUN_DIR/nonfinite.json (the step, the
    first rank and the first unit whose grads went non-finite; `zeroshard doctor RUN_DIR` shows it);
    0 never stops."""

    rollback_on_spike: float = 0.0
    """Roll back when a step's loss exceeds this many times the mean of the `rollback_window` steps
    before it: reload the last verified checkpoint and skip the batches from it up to the spike,
    recording them in RUN_DIR/rollbacks.jsonl and in later checkpoints. Needs checkpointing
    (save_every and ckpt_dir). 0 is off."""

    rollback_window: int = 20
    """Steps of recent losses a spike is measured against."""

    skip_from: str | None = None
    """A rollbacks.jsonl (or the run dir holding one) whose skipped batches this run skips too, so a
    rerun reproduces a run that rolled back."""

    replica_recovery: bool = False
    """Keep training on the healthy replica groups when a rank of one dies, and let its replacement take
    the live state from a peer of its shard position, without a checkpoint (torchft; docs/heal.md).
    Each of the `replicas` groups is its own torchrun job (REPLICA_GROUP_ID=i, TORCHFT_LIGHTHOUSE=addr),
    sharding over its own ranks."""

    replicas: int = 1
    """Replica groups `replica_recovery` trains with (each its own torchrun job); the global batch is
    split over all of their data-parallel ranks."""

    def __post_init__(self) -> None:
        check_types(self)
        _at_least(self, 0, "max_bad_steps", note=" (0 never stops)")
        _at_least(self, 0, "rollback_on_spike", note=" (0 disables it)")
        _at_least(self, 1, "rollback_window", "replicas")
        if 0 < self.rollback_on_spike <= 1:
            raise ValueError(f"rollback_on_spike={self.rollback_on_spike} must be > 1 (a multiple of the recent "
                             "mean loss), or 0 to disable it")

    def check_with(self, checkpoint: CheckpointSection, dims: ParallelDims) -> None:
        """What this section needs of the others: checkpoints to roll back to, replicas to recover."""
        replicas = self.replicas if self.replica_recovery else dims.replicate
        if self.rollback_on_spike and not (checkpoint.every and checkpoint.dir):
            raise ValueError(f"rollback_on_spike={self.rollback_on_spike} rolls back to the last checkpoint, but "
                             "none is saved: pass --save-every N --ckpt-dir DIR")
        if self.replica_recovery and replicas < 2:
            raise ValueError(f"replica_recovery=True needs replicas, but this run has {replicas}: pass --replicas N "
                             "(N >= 2 replica groups, each its own torchrun job; docs/heal.md)")
        if self.replica_recovery and self.rollback_on_spike:
            raise ValueError(f"rollback_on_spike={self.rollback_on_spike} cannot roll back replica groups that recover: "
                             "they keep no checkpoint (a rejoining group takes a live peer's state), so no group has "
                             "a step to go back to; drop --rollback-on-spike or --replica-recovery")
        if self.replica_recovery and checkpoint.every:
            raise ValueError(f"save_every={checkpoint.every} with replica_recovery: the replica groups save no "
                             "checkpoint (a rejoining group takes a live peer's state); drop --save-every")
        if self.replica_recovery and (dims.tp > 1 or dims.pp > 1 or dims.ep > 1 or dims.replicate > 1):
            raise ValueError("replica_recovery=True shards each replica group over its own ranks: use tp=1, pp=1, "
                             "ep=1 and no shard_size (the groups are the replicas)")


LOGGERS = ("tensorboard", "wandb")
"""The experiment loggers `log` names (zeroshard/observe/loggers.py writes to them)."""

SECTIONS: tuple[type, ...] = (DataSection, OptimSection, ParallelSection, PipelineSection, CommSection,
                              CompileSection, CheckpointSection, ObserveSection, LoraSection, EvalSection, HealSection)
"""Every section but the engine's (the runtime's own EngineOptions, its knobs flat in [engine])."""


def flat_name(section: type, field: str) -> str:
    """The flat key (and flag) of a section's field: its own name unless the prefix stood in for the section."""
    return getattr(section, "FLAT", {}).get(field, field)


FLAT: dict[str, tuple[type, str]] = {flat_name(s, f.name): (s, f.name) for s in SECTIONS for f in dataclasses.fields(s)}
"""Flat key -> (its section, the field there)."""

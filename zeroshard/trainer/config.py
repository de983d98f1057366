"""Typed configuration for `zeroshard train` and `zeroshard verify`.

A run is described by one `TrainConfig`. It can come from a TOML file, from command-line
flags, or both; flags override the file (see `merge_config`). Everything is validated once,
in `__post_init__`, so a bad value fails before any process is spawned.

The engine's knobs are not restated here: `engine` is the runtime's own `EngineOptions`, and
its flat knob table (zeroshard.runtime.options.KNOBS) supplies their keys, types, defaults and
help, so a knob added to the engine is a flag and a TOML key with no edit here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from zeroshard.models.names import HF_MODEL_NAMES, HF_PREFIX, HF_TINY_LAYERS, MODEL_NAMES, MOE_MODEL_NAMES
from zeroshard.runtime.docstrings import field_docs
from zeroshard.runtime.options import KNOB_NAMES, KNOBS, EngineOptions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

TP_MODEL_NAMES = MODEL_NAMES + ("hf:llama-tiny",)
"""The models `tp` > 1 can split: those whose class has a ready plan in zeroshard.runtime.tp.PLANS
(zeroshard's GPT, its MoE preset's attention included, and HF Llama; a unit test keeps the two
lists in step). HF GPT-2 has none, and a
pretrained folder's weights are read shard by shard without a tp split (zeroshard/checkpoint/hf/pretrained.py)."""
PP_MODEL_NAMES = MODEL_NAMES + ("hf:llama-tiny",)
"""The models `pp` > 1 can cut into stages: zeroshard's GPT and the HF decoders with model.layers
(zeroshard/parallel/pipeline/families.py); a pretrained folder of one of PP_FOLDER_TYPES too."""
PP_FOLDER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
"""``model_type`` of the pretrained folders `pp` > 1 cuts: decoders whose blocks are model.layers, dense
or MoE (their experts split over ep inside each stage with `ep` > 1)."""
PARAM_DTYPES = ("fp32", "bf16", "fp16")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
WARMUP_SHAPES = ("linear", "log")
"""torch.compile backends `compile_backend` accepts (a library caller may pass any registered one)."""
STAGES = (0, 1, 2, 3)


@dataclass(kw_only=True, init=False)
class TrainConfig:
    """One training run. Field names are also the TOML keys and (with `-` for `_`) the flags; the
    engine's knobs are spelled flat beside them (`field_names()` lists both)."""

    model: str = "tiny"
    """Named GPT size: tiny (<1M params, for tests), small (~25M) or medium (~120M); or a Hugging Face
    model, hf:gpt2-tiny or hf:llama-tiny (needs the hf extra)."""

    stage: int = 0
    """Sharding stage: 0 = DDP, 1 = optimizer state, 2 = + gradients, 3 = + parameters."""

    nproc: int = 2
    """Local processes to spawn. Ignored under torchrun, where WORLD_SIZE decides."""

    batch: int = 16
    """GLOBAL batch in sequences per optimizer step, split evenly over ranks. It does not change
    with the world size, so runs at any world size see the same data."""

    seq_len: int = 64
    """Tokens per sequence (the model's context length is set to this)."""

    steps: int = 100
    """Optimizer steps to run."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""

    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""

    warmup: int = 10
    """Warm-up steps from 0 to `lr` (shaped by `warmup_shape`); cosine decay to `min_lr` follows."""

    warmup_shape: str = "linear"
    """How warm-up climbs: `linear` (lr·(s+1)/warmup at 0-based step s) or `log`
    (lr·ln(s+2)/ln(warmup+1): most of the climb in the first steps, DeepSpeed WarmupLR's default)."""

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

    seed: int = 0
    """Seeds model init, the synthetic data and the sampler. Same seed, same run."""

    data: str | None = None
    """Path to a text file for byte-level training, a folder of token files (from `zeroshard data
    prepare`, or nanoGPT's .bin; see docs/data.md), or None for the synthetic Markov source
    (whose entropy floor is known exactly)."""

    num_samples: int = 4096
    """Sequences in the synthetic dataset (ignored for a text file)."""

    vocab_size: int = 16
    """Tokens in the synthetic Markov source (a text file is always 256 bytes). Small by default
    so that the tiny model reaches the entropy floor in minutes on a CPU."""

    order: int = 2
    """Order k of the synthetic Markov chain: each token depends on the previous k. With k >= 2
    the model must learn to attend backwards, so the loss plateaus before it falls."""

    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    """The runtime's knobs: activation checkpointing, offload, buckets, prefetch, resharding,
    reduction overlap, accumulation (zeroshard.runtime.options). Flags and TOML keys spell them
    flat (`prefetch = 2`, `--offload cpu`), and so does the constructor: `TrainConfig(prefetch=2)`."""

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

    pp_schedule: str = "1f1b"
    """The pipeline schedule (torch.distributed.pipelining's): gpipe, 1f1b, interleaved-1f1b, interleaved-zero-bubble or
    looped-bfs (the last two run several stages per rank)."""

    microbatches: int = 0
    """Microbatches per schedule run (each accumulation step's batch slice is split into them);
    0 takes pp x stages per rank. 1F1B needs at least pp."""

    pp_stages_per_rank: int = 0
    """Stages each pipeline rank holds: 0 takes the schedule's own (1, or 2 for interleaved-1f1b and
    looped-bfs); blocks are split over pp x this many stages."""

    allow_cross_host: bool = False
    """Run tp (or ep) groups that span hosts anyway. Without it such a layout is refused at start,
    since every per-layer tp collective would cross the host network (docs/topology.md)."""

    mp: str = "fp32"
    """Mixed precision: the compute (and all-gather) dtype of params, fp32, bf16 or fp16.
    Masters and optimizer state stay fp32 and gradients are reduced in fp32; fp16 adds dynamic
    loss scaling."""

    comm_quant: str = "none"
    """Quantized communication: 'none', or 'weights' (stage 3 all-gathers weights as blockwise int8
    plus fp32 scales; masters stay exact), 'grads' (stages 2-3 reduce grads as int8 pieces through an
    all-to-all, summed in fp32 by the owner), 'grads+ef' (the same with error feedback: each rank
    carries its rounding error into its next reduction, one fp32 value per grad element), or
    weights with either, comma-separated ('weights,grads', 'weights,grads+ef')."""

    comm_quant_block: int = 256
    """Elements per quantization block (one fp32 scale each); a power of two."""

    compile: bool = False
    """torch.compile each block's forward (zs.shard's compile=); the runtime's hooks stay eager.
    See docs/compile.md."""

    compile_backend: str = "inductor"
    """Backend for `compile`: inductor (needs a C++ compiler on CPU), aot_eager, eager or cudagraphs."""

    init: str = "auto"
    """How the model is initialised: 'meta' builds it on the meta device and materialises only
    this rank's shards (bitwise the same values), 'full' builds it whole on every rank, 'auto'
    picks meta above 50M params."""

    dropout: bool = True
    """Train with the model's own dropout (and other train-time randomness, such as an MoE router's
    jitter). False runs the model in eval mode, which turns it off: `zeroshard verify` does, since
    masks drawn on a sharded run and on one process differ. Models without dropout are unaffected."""

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

    save_every: int = 0
    """Save a checkpoint every this many optimizer steps into `ckpt_dir`; 0 never saves."""

    ckpt_dir: str | None = None
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

    save_async: bool = False
    """Save in the background: each rank copies its shards to host memory (pinned on CUDA) and
    training goes on while the files are written, hashed and committed (one save in flight at a
    time; a crash mid-write leaves the previous checkpoint as the newest). Costs host memory of
    the size of the rank's checkpoint files."""

    def __init__(self, **values: Any) -> None:
        # Written out rather than generated so that the engine's knobs can be given flat, as every
        # TOML file, flag and test spells them, and still land in the one EngineOptions.
        engine = values.pop("engine", None)
        knobs = {k: values.pop(k) for k in list(values) if k in KNOB_NAMES}
        for f in dataclasses.fields(self):
            if f.name != "engine":  # the one field with a factory; every other default is a plain value
                setattr(self, f.name, values.pop(f.name, f.default))
        if values:
            raise TypeError(f"TrainConfig got unknown keys {sorted(values)}; valid keys are: {', '.join(field_names())}")
        _check_types(self, knobs)
        self.engine = EngineOptions.from_flat(knobs, base=engine)
        self._check_ranges()

    def _check_comm_quant(self) -> None:
        """The same rules as zeroshard.comm.quant.CommQuant, without importing torch."""
        parts = {p.strip() for p in self.comm_quant.split(",") if p.strip()} - {"none"}
        if parts - {"weights", "grads", "grads+ef"} or {"grads", "grads+ef"} <= parts:
            raise ValueError(f"comm_quant={self.comm_quant!r} is invalid; use 'none', 'weights', 'grads', "
                             "'grads+ef' (with error feedback) or weights with either, e.g. 'weights,grads+ef'")
        block = self.comm_quant_block
        if block <= 0 or block & (block - 1):
            raise ValueError(f"comm_quant_block={block} must be a positive power of two (e.g. 256)")
        if "weights" in parts and self.stage != 3:
            raise ValueError(f"comm_quant=weights needs stage 3 (weights are all-gathered only there); "
                             f"got stage {self.stage}: pass --stage 3 or drop weights")
        if parts & {"grads", "grads+ef"} and self.stage < 2:
            raise ValueError(f"comm_quant=grads needs stage 2 or 3 (a sharded grad reduction); got stage "
                             f"{self.stage}: pass --stage 2 or 3 or drop grads")

    def _check_tp(self) -> None:
        if self.tp < 1 or self.nproc % self.tp:
            raise ValueError(f"tp={self.tp} does not divide nproc={self.nproc}; pick a tp that divides nproc "
                             f"(nproc/tp ranks are data parallel; tp=1 is no tensor parallelism)")
        if self.tp > 1 and self.model not in TP_MODEL_NAMES:
            raise ValueError(f"model={self.model!r} has no tensor-parallel plan; use tp=1, or one of "
                             f"{', '.join(TP_MODEL_NAMES)} (zeroshard's GPT and HF Llama have one)")

    def _check_ep(self) -> None:
        if self.ep == 1:
            return
        # ep borrows its ranks from dp x tp (zeroshard/comm/mesh.py's check_ep_layout, the same rule), inside
        # each pipeline stage under pp.
        pp = self.pp if self.pp >= 1 and self.nproc % self.pp == 0 else 1
        ranks, where = self.nproc // pp, " of a pipeline stage" if pp > 1 else ""
        if self.ep < 1 or ranks % self.ep:
            kind = "data-parallel" if self.tp == 1 else "data-parallel x tp"
            raise ValueError(f"ep={self.ep} does not divide the {ranks} {kind} ranks{where}, so its product with the "
                             f"other dims is not nproc={self.nproc}; pick an ep that divides {ranks}")
        if self.tp > 1 and self.ep % self.tp and self.tp % self.ep:
            raise ValueError(f"ep={self.ep} with tp={self.tp}: an ep group must hold whole tp groups or lie inside "
                             f"one; pick an ep that is a multiple or a divisor of tp={self.tp}")
        if pp > 1 and self.tp > 1:
            raise ValueError(f"ep={self.ep} with tp={self.tp} under pp={pp} is not composed yet; use tp=1 with pp and "
                             "ep, or pp=1")
        if self.model in MODEL_NAMES + HF_MODEL_NAMES and self.model not in MOE_MODEL_NAMES:
            # (a pretrained folder's layers are checked before launch, on a meta build of it)
            raise ValueError(f"ep={self.ep} needs a mixture-of-experts model, but {self.model} has no MoE layer; use "
                             f"ep=1, {', '.join(MOE_MODEL_NAMES)}, or an HF Mixtral or Qwen-MoE save_pretrained folder")

    @property
    def pp_microbatches(self) -> int:
        """`microbatches`, or its default (pp x stages per rank) when 0; 1 without a pipeline."""
        from zeroshard.parallel.pipeline.schedules import microbatches_of

        return microbatches_of(self.pp, schedule=self.pp_schedule, microbatches=self.microbatches,
                               stages_per_rank_asked=self.pp_stages_per_rank)

    def _check_pp(self) -> None:
        if self.pp < 1 or (self.nproc // self.tp) % self.pp or self.nproc % self.tp:
            raise ValueError(f"pp={self.pp} does not divide nproc={self.nproc}{f' / tp {self.tp}' if self.tp > 1 else ''}; "
                             "pick a pp that divides it (nproc/pp ranks per pipeline stage; pp=1 is no pipeline)")
        if self.pp == 1:
            return
        from zeroshard.parallel.pipeline.schedules import (check_checkpointing, check_compile, check_microbatches, schedule_spec,
                                                  stages_per_rank)

        spec = schedule_spec(self.pp_schedule)
        per_rank = stages_per_rank(spec, self.pp_stages_per_rank)
        check_checkpointing(spec, self.engine.checkpointing)
        check_compile(spec, self.compile)
        layers = self._pp_blocks()
        if layers % (self.pp * per_rank):
            raise ValueError(f"pp={self.pp} x {per_rank} stages per rank does not divide the {layers} blocks of "
                             f"{self.model}; pick pp x pp_stages_per_rank dividing {layers}")
        if self.init == "meta" and self.model.startswith(HF_PREFIX):
            raise ValueError("init=meta under pp > 1 is not yet composed with a Hugging Face preset; use init=full "
                             "(or auto), a GPT preset, or a save_pretrained folder (read on meta stage by stage)")
        refused = {"check_schedule": self.engine.check_schedule}
        for name, on in refused.items():
            if on:
                raise ValueError(f"{name} is not yet composed with pp > 1 (docs/pipeline.md, limits); drop it or "
                                 "use pp=1")
        from zeroshard.parallel.pipeline.grad_reduce import check_grad_reduce

        check_grad_reduce(self.engine.pp_grad_reduce, stage=self.stage)
        dp = self.nproc // self.tp // self.pp
        if self.batch % (dp * self.accum) == 0:
            check_microbatches(spec, microbatches=self.pp_microbatches, pp=self.pp,
                               local_batch=self.batch // (dp * self.accum))

    def _pp_blocks(self) -> int:
        """The blocks pp cuts into stages: a preset's, or a pretrained decoder folder's layers."""
        from zeroshard.checkpoint.hf.folder import CONFIG, is_pretrained_folder

        if is_pretrained_folder(self.model):
            try:
                hf = json.loads((Path(self.model) / CONFIG).read_text())
            except ValueError as e:
                raise ValueError(f"{Path(self.model) / CONFIG} is not JSON ({e}); fix or rewrite the folder") from e
            kind, layers = hf.get("model_type"), hf.get("num_hidden_layers")
            if kind not in PP_FOLDER_TYPES or not isinstance(layers, int):
                raise ValueError(f"the {kind!r} model in {self.model} cannot be cut into pipeline stages; use pp=1, "
                                 f"or a folder of one of {', '.join(PP_FOLDER_TYPES)}")
            if hf.get("output_router_logits") and hf.get("router_aux_loss_coef"):
                # (zeroshard/parallel/pipeline/families.py refuses the built model the same way)
                raise ValueError(f"the {kind} model in {self.model} asks for its routers' load-balancing loss "
                                 "(output_router_logits), one term over every layer's tokens that no pipeline stage "
                                 "holds; set output_router_logits to false in its config.json or use pp=1")
            return layers
        if self.model not in PP_MODEL_NAMES:
            raise ValueError(f"model={self.model!r} cannot be cut into pipeline stages; use pp=1, one of "
                             f"{', '.join(PP_MODEL_NAMES)}, or a pretrained folder of {', '.join(PP_FOLDER_TYPES)}")
        if self.model.startswith(HF_PREFIX):
            return HF_TINY_LAYERS
        from zeroshard.models.gpt import GPTConfig

        return GPTConfig.named(self.model).n_layer

    def _check_ranges(self) -> None:
        if self.model not in MODEL_NAMES + HF_MODEL_NAMES and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model!r} is not a known model; use one of {MODEL_NAMES + HF_MODEL_NAMES} "
                             "or a folder written by save_pretrained (with config.json)")
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage} is invalid; use 0 (DDP), 1, 2 or 3")
        if self.mp not in PARAM_DTYPES:
            raise ValueError(f"mp={self.mp!r} is invalid; use one of {PARAM_DTYPES}")
        self._check_tp()
        self._check_ep()
        self._check_pp()
        dp = self.nproc // self.tp // self.pp
        if self.shard_size is not None and (self.shard_size < 1 or dp % self.shard_size):
            where = f"nproc={self.nproc}" if self.tp == 1 else f"the {dp} data-parallel ranks (nproc {self.nproc} / tp {self.tp})"
            raise ValueError(f"shard_size={self.shard_size} must divide {where}")
        if self.engine.offload.kind == "disk" and not self.engine.offload.directory:
            raise ValueError("offload='disk' needs offload_dir: pass --offload-dir DIR")
        self._check_comm_quant()
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend={self.compile_backend!r} is invalid; use one of {COMPILE_BACKENDS}")
        if self.init not in ("auto", "meta", "full"):
            raise ValueError(f"init={self.init!r} is invalid; use 'auto', 'meta' or 'full'")
        for name in ("nproc", "batch", "seq_len", "steps", "num_samples", "log_every", "order", "accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 2")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0 (0 disables warm-up)")
        if self.warmup_shape not in WARMUP_SHAPES:
            raise ValueError(f"warmup_shape={self.warmup_shape!r} is invalid; use one of {', '.join(WARMUP_SHAPES)}")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr={self.min_lr} must lie in [0, lr={self.lr}]")
        for name in ("weight_decay", "clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s={self.hang_timeout_s} must be > 0")
        if self.desync_check < 0:
            raise ValueError(f"desync_check={self.desync_check} must be >= 0 (0 disables it)")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"peak_flops={self.peak_flops} must be > 0 FLOP/s, or unset to measure it")
        from zeroshard.observing.loggers import parse_log

        parse_log(self.log)
        from zeroshard.trainer.optimizers import parse_optimizer

        parse_optimizer(self.optimizer)
        check_checkpointing(self)
        # Tensor-parallel ranks share a batch: it is split over the data-parallel ranks only.
        check_batch_split(self.batch, dp, self.accum)
        if self.data is None and self.num_samples < self.batch:
            raise ValueError(
                f"num_samples={self.num_samples} is smaller than one global batch ({self.batch}); "
                "raise num_samples or lower batch"
            )

    def to_dict(self) -> dict[str, Any]:
        """Flat, as a TOML file spells it: `TrainConfig(**cfg.to_dict())` is `cfg` again."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "engine":
                out.update(self.engine.flat())
            else:
                out[f.name] = getattr(self, f.name)
        return out


def check_batch_split(batch: int, world: int, accum: int = 1) -> None:
    """Every rank gets the same number of sequences, in `accum` equal micro-batches."""
    if batch % (world * accum) != 0:
        raise ValueError(
            f"global batch={batch} does not split evenly over {world} ranks x {accum} micro-steps; "
            f"use a batch that is a multiple of {world * accum}"
        )


def check_checkpointing(cfg: TrainConfig) -> None:
    for name in ("save_every", "keep_last"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 0 (0 disables it)")
    if cfg.save_every and cfg.ckpt_dir is None:
        raise ValueError(f"save_every={cfg.save_every} needs ckpt_dir: pass --ckpt-dir DIR")
    if cfg.resume in ("auto", "fresh-ok") and cfg.ckpt_dir is None:
        raise ValueError(f"resume={cfg.resume!r} searches ckpt_dir, which is not set: pass --ckpt-dir DIR")


def _check_types(cfg: TrainConfig, knobs: Mapping[str, Any]) -> None:
    # TOML and flags both deliver loosely typed values; catch "steps = '10'" here, with the
    # field's name, rather than as a TypeError deep inside the training loop.
    values = {name: getattr(cfg, name) for name in _TYPES if name not in KNOB_NAMES} | dict(knobs)
    for name, value in values.items():
        allowed = typing.get_args(_TYPES[name]) or (_TYPES[name],)
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # "peak_flops = 100000000000" in TOML is an int
        elif not (value is None and type(None) in allowed) and not any(
                isinstance(value, t) and not (isinstance(value, bool) and t is not bool)
                for t in allowed if t is not type(None)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{name}={value!r} has type {type(value).__name__}; expected {names}")
        if name in knobs:
            knobs[name] = value  # type: ignore[index]
        else:
            setattr(cfg, name, value)


def _flat_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name == "engine":
            out.update({knob.name: knob.type for knob in KNOBS})
        else:
            out[f.name] = hints[f.name]
    return out


_TYPES = _flat_types()
"""Every key a config takes, flat, in field order, with its annotation."""

_FIELD_DOCS = {**field_docs(TrainConfig), **{knob.name: knob.help for knob in KNOBS}}


def field_names() -> list[str]:
    """Every key a config takes, flat: its own fields and the engine's knobs, in field order."""
    return list(_TYPES)


def field_type(name: str) -> Any:
    """A key's annotation (``int``, ``str | None``, ...), for a flag's type."""
    return _TYPES[name]


def field_help(name: str) -> str:
    """The docstring under a field (or engine knob), reused as its --help text so the two never drift."""
    return _FIELD_DOCS.get(name, "")


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of TrainConfig keys. A `[train]` table is accepted as well as top-level keys."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist; check the --config path")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    if set(raw) == {"train"} and isinstance(raw["train"], dict):
        raw = raw["train"]
    return normalize_keys(raw, source=str(p))


def normalize_keys(values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """Accept `seq-len` as well as `seq_len`, and reject unknown keys by name."""
    known = set(field_names())
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(
                f"unknown config key {key!r} in {source}; valid keys are: {', '.join(sorted(known))}"
            )
        out[name] = value
    return out


def merge_config(
    file_values: Mapping[str, Any] | None = None, flag_values: Mapping[str, Any] | None = None
) -> TrainConfig:
    """Defaults, then the file, then flags. Flags that were not given must be absent (or None)."""
    merged: dict[str, Any] = dict(file_values or {})
    for key, value in (flag_values or {}).items():
        if value is not None:
            merged[key] = value
    merged = normalize_keys(merged, source="flags")
    return TrainConfig(**merged)


def config_from_sources(path: str | Path | None, flag_values: Mapping[str, Any]) -> TrainConfig:
    file_values = load_toml(path) if path is not None else {}
    return merge_config(file_values, flag_values)

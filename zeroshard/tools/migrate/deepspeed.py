"""A DeepSpeed JSON config -> the TrainConfig keys `zeroshard train --config` reads.

Every key is accounted for, and each becomes one row of the decision table (`Decision`): it is
mapped to a TrainConfig key, accepted with a note saying what zeroshard does instead (a key that
changes nothing numeric: logging, a tuning knob our runtime does its own way), or refused with an
`UnsupportedKey` that names it, says what it does and names the nearest zeroshard option. An
unknown key is refused too: silently dropping a setting would train a different run from the one
the user asked for. `drop=` (the CLI's `--drop KEY`) removes a refused key on the user's word.

"auto" is the Hugging Face Trainer's placeholder: it fills the key from its own arguments before
DeepSpeed reads the config. Here the zeroshard flags are those arguments: an "auto" key takes the
matching flag (`--batch`, `--lr`, `--clip`, ...) or, without one, zeroshard's default. A flag that
disagrees with a value written in the JSON is refused, as the Trainer refuses such a mismatch.

Keys left out of the JSON take DeepSpeed's defaults, not ours, where the two differ in numerics
(DeepSpeed clips no gradients unless `gradient_clipping` is set, so `clip = 0.0` is written).
"""

from __future__ import annotations

from typing import Any, Mapping

from zeroshard.models.names import MOE_MODEL_NAMES
from zeroshard.trainer.config import TrainConfig, field_names
from zeroshard.trainer.optimizers import NAMED as OPTIMIZERS
from zeroshard.trainer.schedules import SCHEDULES
from zeroshard.tools.migrate.ds_keys import ZERO_ALIASES
from zeroshard.tools.migrate.decisions import (AUTO, FROM_DERIVED, FROM_DS_DEFAULT, FROM_JSON, FROM_ZS_DEFAULT,
                                         MISSING, Conversion, Decision, UnsupportedKey)
from zeroshard.tools.migrate.ds_zero import convert_zero
from zeroshard.tools.migrate.reader import Builder, Section, default_of, flag_name, without_keys

__all__ = ["ADAMW_BETAS", "ADAMW_EPS", "SCALER", "Conversion", "Decision", "UnsupportedKey", "from_deepspeed"]

ADAMW_BETAS = (0.9, 0.95)
"""The AdamW betas `zeroshard train` uses (zeroshard/trainer/train.py BETAS; kept equal by a unit test)."""
ADAMW_EPS = 1e-8
SCALER = dict(initial_scale_power=16, loss_scale_window=2000, hysteresis=1, min_loss_scale=None)
"""zs.ShardedGradScaler's fixed schedule in DeepSpeed's words: 2**16 to start, x2 after 2000 clean
steps, x0.5 at every overflow (no hysteresis), no floor."""


def from_deepspeed(ds: Mapping[str, Any], *, world: int | None = None, flags: Mapping[str, Any] | None = None,
                   drop: tuple[str, ...] = ()) -> Conversion:
    """Convert a parsed DeepSpeed config.

    ``world`` (ranks in the run) turns a per-GPU micro-batch into our global batch, unless all
    three batch keys are given. ``flags`` are TrainConfig values given as zeroshard flags: they fill
    "auto" keys, must agree with keys the JSON writes, and are written as they are otherwise.
    ``drop`` names dotted keys to remove before converting (a refused key the user can do without).
    """
    if world is not None and world < 1:
        raise ValueError(f"world={world} must be >= 1")
    unknown = sorted(set(flags or {}) - set(field_names()))
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a zeroshard train key; see zeroshard train --help")
    flags = dict(flags or {})
    if flags.get("nproc") is not None:
        if world is not None and world != flags["nproc"]:
            raise ValueError(f"--world {world} and --nproc {flags['nproc']} differ; give one")
        world = flags.pop("nproc")
    out = Builder(world, flags)
    root = Section(without_keys(ds, tuple(drop), out), "")
    _tensor_parallel(root, out)  # first: with tp the batch keys count data-parallel ranks, not the world
    _batch(root, out)
    _expert_parallel(root, out)
    _precision(root, out)
    zero = root.section("zero_optimization", ZERO_ALIASES)
    if zero is not None:
        convert_zero(zero, out)
        zero.finish()
    elif (stage := out.flag("stage")) is not None:
        out.set("", MISSING, "stage", stage, flag_name("stage"))
    out.map(root, "gradient_clipping", "clip", absent=0.0, cast=float)  # DeepSpeed clips nothing unless asked
    _optimizer(root, out)
    _scheduler(root, out)
    _misc(root, out)
    root.finish()
    for name, value in out.flags.items():  # flags no DeepSpeed key covers (--model, --steps, ...)
        if name not in out.read_flags:
            out.set("", MISSING, name, value, flag_name(name))
    order = {name: i for i, name in enumerate(field_names())}
    values = dict(sorted(out.values.items(), key=lambda kv: order[kv[0]]))
    if "nproc" not in values:
        out.row("", MISSING, "-", "world size unknown", "nproc is not written: give zeroshard train --nproc N "
                "(or run it under torchrun)", noted=True)
    if values.get("ep", 1) > 1 and "model" not in values:
        out.row("", MISSING, "-", "ep needs an MoE model", "give zeroshard train --model (tiny-moe, or an HF Mixtral "
                "or Qwen-MoE save_pretrained folder)", noted=True)
    try:
        # With the world unknown, check what does not depend on it (the smallest world tp and ep fit in);
        # without a model named, an ep run is checked on one of zeroshard's MoE models.
        model = {"model": MOE_MODEL_NAMES[0]} if values.get("ep", 1) > 1 and "model" not in values else {}
        TrainConfig(**{"nproc": values.get("tp", 1) * values.get("ep", 1), **model, **values})
    except ValueError as e:
        raise ValueError(f"the converted config is not a valid zeroshard run: {e}") from e
    return Conversion(values, out.decisions)


def _tensor_parallel(root: Section, out: Builder) -> None:
    """AutoTP training (``tensor_parallel.autotp_size``) -> tp: zeroshard splits its GPT and HF Llama
    with a ready plan by the model's class (docs/tensor_parallel.md), as AutoTP's presets do."""
    section = root.section("tensor_parallel")
    if section is None:
        if (tp := out.flag("tp")) is not None:
            out.set("", MISSING, "tp", tp, flag_name("tp"))
        return
    given, size, source = out.resolve(section, "autotp_size", "tp", absent=0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise UnsupportedKey(f"DeepSpeed key {section.name('autotp_size')}={size!r} must be a non-negative integer")
    nested = section.section("tp")  # the older spelling, {"tp": {"tp_size": N}}
    if nested is not None:
        old = nested.concrete("tp_size", size)
        if size and old != size:
            raise UnsupportedKey(f"DeepSpeed keys {section.name('autotp_size')}={size} and {nested.name('tp_size')}="
                                 f"{old} differ; keep one")
        given, size, source = (nested.data.get("tp_size"), old, FROM_JSON) if given is MISSING else (given, old, source)
        nested.finish()
    if size > 1:
        out.set(section.name("autotp_size"), given, "tp", size, source)
    else:
        out.row(section.name("autotp_size"), given, "-", source, "0 or 1 is no tensor parallelism")
    out.refuse(section, "partition_config", "a custom AutoTP layer split; zeroshard splits its GPT and HF Llama by a "
            "ready plan (from Python, zs.tensor_parallel(model, plan=fn) takes your own)", off=(None, {}))
    out.refuse(section, "tp_grain_size", "zeroshard splits every head and MLP column evenly over the tp ranks",
            off=(None, 1))
    out.note(section, "preset_model", "zeroshard reads the tensor-parallel plan from the model's spec "
             "(zeroshard's GPT, or what a transformers config declares)")
    out.note(section, "tp_overlap_comm", "zeroshard's tp all-reduces block the next op (DTensor's); ZeRO's "
             "collectives are the ones it overlaps")
    out.note(section, "dtype", "zeroshard's tp runs in the compute dtype (mp)")
    out.note(section, "keep_module_on_host", "zeroshard splits the model where it was built (or on meta)")
    section.finish()


# AutoEP keys that find the MoE layers or pick kernels: zeroshard splits the model's own MoE layers by its ep plan.
_AUTOEP_NOTED = ("preset_model", "moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2",
                 "expert_w3", "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
                 "shared_experts_gate_pattern", "use_grouped_mm", "disable_triton_grouped_mm", "combine_impl",
                 "validate_folding_routing")
# AutoEP keys that override the model's routing; their defaults ("auto", None, 1.0) keep the model's own.
_AUTOEP_ROUTING = {"route_norm": (None,), "route_scale": (None, 1, 1.0), "score_apply": (None, AUTO),
                   "score_func": (None, AUTO), "top_k": (None, AUTO), "routed_scaling_factor": (None, AUTO),
                   "num_expert_groups": (None,), "num_limited_groups": (None,), "load_balance_coeff": (None,)}


def _expert_parallel(root: Section, out: Builder) -> None:
    """AutoEP (``expert_parallel.autoep_size``) -> ep, where the run's config has it (zeroshard/trainer/sections.py):
    the model's own MoE layers split over ep ranks, tokens sent to them by all-to-all (docs/expert_parallel.md)."""
    section = root.section("expert_parallel")
    if section is None:
        if (ep := out.flag("ep")) is not None:
            out.set("", MISSING, "ep", ep, flag_name("ep"))
        return
    enabled = section.concrete("enabled", False)
    if not enabled:
        section.take_all()
        out.row(section.name("enabled"), enabled, "-", FROM_JSON, "AutoEP off: no expert parallelism")
        return section.finish()
    out.row(section.name("enabled"), enabled, "-", FROM_JSON, "AutoEP on")
    if "ep" not in field_names():
        raise UnsupportedKey(f"DeepSpeed key {section.name('autoep_size')} is unsupported: zeroshard has no ep "
                             "(--drop expert_parallel converts without it)")
    out.map(section, "autoep_size", "ep", absent=1, cast=int)
    out.refuse(section, "expert_tensor_parallel_size", "tensor parallelism inside each expert; zeroshard's experts "
               "are whole on their ep rank", off=(None, 1))
    for key in _AUTOEP_NOTED:
        out.note(section, key, "zeroshard finds the MoE layers by the model's own ep plan and runs their experts")
    for key, defaults in _AUTOEP_ROUTING.items():
        out.refuse(section, key, "it overrides the model's routing; zeroshard runs the model's own router",
                   off=defaults)
    section.finish()


def _batch_key(root: Section, key: str, out: Builder, name: str | None) -> tuple[Any, Any, str]:
    """(JSON value, value or None, source) of one batch key; "auto" takes flag ``name`` if given."""
    if name is None:  # the micro-batch has no zeroshard flag: it follows from the global batch
        given = root.take(key, MISSING)
        return given, None if given in (MISSING, AUTO) else given, FROM_JSON
    given, value, source = out.resolve(root, key, name)
    if given == AUTO and out.flags.get(name) is None:
        return given, None, source  # derived from the others when they can give it; else the default
    return given, None if value is MISSING else value, source


def _batch(root: Section, out: Builder) -> None:
    """DeepSpeed's train_batch_size = micro-batch x accumulation x data-parallel ranks. With tensor
    parallelism those are world / tp (a tp group shares its micro-batch), as zeroshard's global batch is."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    (g_total, total, s_total), (g_micro, micro, s_micro), (g_accum, accum, s_accum) = (
        _batch_key(root, keys[0], out, "batch"), _batch_key(root, keys[1], out, None),
        _batch_key(root, keys[2], out, "accum"))
    if g_total is MISSING and g_micro is MISSING and total is None:
        raise UnsupportedKey("the DeepSpeed config sets neither train_batch_size nor train_micro_batch_size_per_gpu; "
                             "write one of them in the JSON (\"auto\" takes --batch)")
    tp = out.values.get("tp", 1)
    if out.world is not None and out.world % tp:
        raise UnsupportedKey(f"--world {out.world} is not a multiple of tensor_parallel.autotp_size={tp}; "
                             "give the number of ranks in all (data-parallel x tp)")
    dp = None if out.world is None else out.world // tp
    ranks = "world" if tp == 1 else "data-parallel ranks"
    if total is None and micro is None:  # both "auto": the HF Trainer's global batch is ours
        total, s_total = default_of("batch"), f"auto: {FROM_ZS_DEFAULT}"
    if total is not None and micro is not None and accum is not None and dp is None:
        if total % (micro * accum):
            raise UnsupportedKey(f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu="
                                 f"{micro} x gradient_accumulation_steps={accum}; fix one of the three")
        dp = total // (micro * accum)
    if micro is not None and (total is None or accum is None) and dp is None:
        raise UnsupportedKey("train_micro_batch_size_per_gpu needs the world size to give zeroshard's global "
                             "batch: pass --world N (the number of ranks)")
    if micro is None:
        if accum is None:
            accum, s_accum = default_of("accum"), (f"auto: {FROM_ZS_DEFAULT}" if g_accum == AUTO else FROM_DS_DEFAULT)
    elif total is None:
        if accum is None:
            accum, s_accum = default_of("accum"), (f"auto: {FROM_ZS_DEFAULT}" if g_accum == AUTO else FROM_DS_DEFAULT)
        total, s_total = micro * accum * dp, FROM_DERIVED
    elif accum is None:
        if total % (micro * dp):
            raise UnsupportedKey(f"train_batch_size={total} is not a multiple of train_micro_batch_size_per_gpu="
                                 f"{micro} x {ranks} {dp}; fix the batch keys or --world")
        accum, s_accum = total // (micro * dp), FROM_DERIVED
    elif total != micro * accum * dp:
        raise UnsupportedKey(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                             f"gradient_accumulation_steps={accum} x {ranks} {dp}; fix the batch keys or --world")
    out.set(keys[0], g_total, "batch", total, s_total)
    out.set(keys[2], g_accum, "accum", accum, s_accum)
    if dp is not None:
        per_rank = f"batch / ({ranks} {dp} x accum {accum}) = {total // (dp * accum)}" if total % (dp * accum) == 0 \
            else "does not split evenly"
        out.row(keys[1], g_micro, "-", FROM_DERIVED if micro is None else s_micro, f"the per-rank micro-batch: {per_rank}")
        source = "--world" if out.world is not None else FROM_DERIVED
        out.set("", MISSING, "nproc", dp * tp, source)
    elif g_micro is not MISSING:
        out.row(keys[1], g_micro, "-", FROM_DERIVED, "the per-rank micro-batch follows from batch, accum and --nproc")


def _precision(root: Section, out: Builder) -> None:
    """bf16 / fp16 -> mp; "auto" in enabled takes --mp (as the Trainer takes --bf16 / --fp16)."""
    if root.has("bf16") and root.has("bfloat16"):
        raise UnsupportedKey("DeepSpeed keys bf16 and bfloat16 are the same setting, given twice; keep bf16")
    flag = out.flag("mp")
    mp = flag if flag is not None else default_of("mp")
    on: list[tuple[str, Any, str]] = []  # (dtype, JSON value, source)
    for key, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = root.section(key)
        if section is None:
            continue
        given = section.take("enabled", False)
        enabled = (mp == dtype) if given == AUTO else given
        if not isinstance(enabled, bool):
            raise UnsupportedKey(f"DeepSpeed key {section.name('enabled')}={given!r} must be true, false or \"auto\"")
        source = (f"auto: {flag_name('mp')}" if flag is not None else f"auto: {FROM_ZS_DEFAULT}") if given == AUTO \
            else FROM_JSON
        if enabled:
            on.append((dtype, given, source))
            if dtype == "fp16":
                _loss_scaling(section, out)
        if not enabled or dtype != "fp16":
            section.take_all()  # loss-scaling keys of a disabled fp16, bf16's immediate_grad_update: nothing numeric
        section.finish()
        out.row(section.name("enabled"), given, f"mp = {dtype!r}" if enabled else "-", source)
    if len(on) == 2:
        raise UnsupportedKey("DeepSpeed keys bf16.enabled and fp16.enabled are both true; enable one")
    sections = [k for k in ("bf16", "bfloat16", "fp16") if root.has(k)]
    if not sections:  # nothing written: fp32 as in DeepSpeed, or the flag's dtype
        out.set("", MISSING, "mp", flag or "fp32", flag_name("mp") if flag else FROM_DS_DEFAULT,
                "" if flag else "neither bf16 nor fp16 in the JSON: fp32 compute")
    elif flag is not None and flag != (on[0][0] if on else "fp32"):
        raise UnsupportedKey(f"the DeepSpeed config computes in {on[0][0] if on else 'fp32'} but --mp {flag}; make "
                             f"them agree, or write \"auto\" in {sections[0]}.enabled to take the flag")
    else:
        out.values["mp"] = on[0][0] if on else "fp32"
    out.refuse(root, "amp", "apex AMP; use \"bf16\": {\"enabled\": true} or fp16 instead", off=(None, {"enabled": False}))
    dtypes = root.section("data_types")
    if dtypes is not None:
        out.refuse(dtypes, "grad_accum_dtype", "zeroshard accumulates gradients in fp32", off=(None, "fp32"))
        dtypes.finish()
    out.refuse(root, "communication_data_type", "zeroshard reduces gradients in fp32", off=(None, "fp32"))


def _loss_scaling(fp16: Section, out: Builder) -> None:
    """DeepSpeed's dynamic loss scaler -> zs.ShardedGradScaler, whose schedule is fixed."""
    if fp16.concrete("loss_scale", 0) != 0:
        raise UnsupportedKey(f"DeepSpeed key {fp16.name('loss_scale')}={fp16.data['loss_scale']!r} is a static loss "
                             "scale, which zeroshard lacks (fp16 uses a dynamic ShardedGradScaler); set it to 0")
    out.refuse(fp16, "fp16_master_weights_and_grads", "zeroshard keeps fp32 masters and fp32 gradients")
    out.refuse(fp16, "auto_cast", "zeroshard casts params (mp), not inputs")
    for key, ours in SCALER.items():
        value = fp16.take(key)
        if value is not None and value != ours and value != AUTO:
            out.row(fp16.name(key), value, "-", "noted: the steps skipped around an overflow can differ",
                    f"zeroshard's fp16 loss scaler uses {key}={ours!r}", noted=True)
    fp16.take("consecutive_hysteresis")


def _optimizer(root: Section, out: Builder) -> None:
    opt = root.section("optimizer")
    if opt is None:
        out.row("optimizer", MISSING, "-", "zeroshard train's AdamW", "no optimizer section: AdamW with lr and "
                "weight_decay as set (or zeroshard's defaults)", noted=True)
        return
    kind = str(opt.concrete("type", "")).lower()
    params = opt.section("params") or Section({}, opt.name("params"))
    if kind in OPTIMIZERS and kind != "adamw":  # the trainer's own table: a per-tensor optimizer it runs
        _per_tensor_optimizer(kind, opt, params, out)
        return
    if kind == "lamb":
        raise UnsupportedKey(f"DeepSpeed key {opt.name('type')}={opt.data.get('type')!r} is unsupported: torch ships no "
                             "LAMB; zeroshard steps a LAMB of your own whole per tensor (zeroshard train --optimizer "
                             "mypkg.optim:Lamb with per_tensor = true in an [optimizer] table), or --drop optimizer "
                             "converts with zeroshard's AdamW")
    if kind not in ("adam", "adamw") or (kind == "adam" and params.take("adam_w_mode") is False):
        raise UnsupportedKey(f"DeepSpeed key {opt.name('type')}={opt.data.get('type')!r} is unsupported: zeroshard "
                             "train steps AdamW (decoupled weight decay); from Python, zs.optimizer takes any "
                             f"elementwise torch optimizer (--drop optimizer converts with zeroshard's AdamW)")
    out.row(opt.name("type"), opt.data.get("type"), "-", FROM_JSON, "zeroshard train's AdamW")
    params.take("adam_w_mode")
    out.refuse(params, "bias_correction", "torch's AdamW always corrects the moments' bias", off=(None, True))
    out.refuse(params, "amsgrad", "zeroshard train's AdamW runs without amsgrad")
    out.map(params, "lr", "lr", cast=float)
    out.map(params, "weight_decay", "weight_decay", cast=float,
            why="zeroshard decays matrices and embeddings only, not biases or norm weights", noted=True)
    ours: dict[str, Any] = {"betas": list(ADAMW_BETAS), "eps": ADAMW_EPS}  # as JSON spells them
    for key, value in ours.items():
        given = params.take(key)
        if given is None:
            continue
        if given != AUTO and (list(given) if key == "betas" else given) != value:
            raise UnsupportedKey(f"DeepSpeed key {params.name(key)}={given!r} is unsupported: zeroshard train's AdamW "
                                 f"uses {key} {value}")
        out.row(params.name(key), given, "-", "auto: zeroshard's AdamW" if given == AUTO else FROM_JSON,
                f"zeroshard train's AdamW uses {key} {value}")
    for key in ("torch_adam", "fused"):
        out.note(params, key, "zeroshard steps torch.optim.AdamW; the update is the same")
    params.finish()
    opt.finish()


PER_TENSOR_TYPES = {"muon": "Muon for the hidden matrices, AdamW for embeddings, head, norms and biases",
                    "adafactor": "torch.optim.Adafactor"}
"""What the decision table says of the per-tensor optimizers (which ones run is zeroshard/trainer/optimizers.py's
NAMED; they step per tensor on owner ranks, zeroshard/runtime/owners.py)."""
MUON_OPTIONS = ("momentum", "nesterov", "ns_steps", "eps")
"""DeepSpeed Muon params that are torch.optim.Muon options of the same name and meaning."""


def _per_tensor_optimizer(kind: str, opt: Section, params: Section, out: Builder) -> None:
    """Muon (the matrices; AdamW for the rest, as DeepSpeed's Muon does) and Adafactor: ``optimizer``
    with lr and weight_decay as the run's; Muon's own options go into the [optimizer] table."""
    out.map(params, "lr", "lr", cast=float)
    out.map(params, "weight_decay", "weight_decay", cast=float)
    extra = {key: params.take(key) for key in MUON_OPTIONS if kind == "muon" and params.has(key)}
    value: Any = {"name": kind, **extra} if extra else kind
    out.set(opt.name("type"), opt.data.get("type"), "optimizer", value, FROM_JSON, PER_TENSOR_TYPES.get(kind, ""))
    params.finish()
    opt.finish()


DS_SCHEDULES = {sched.deepspeed: name for name, sched in SCHEDULES.items() if sched.deepspeed}
"""DeepSpeed scheduler types -> zeroshard's lr_schedule, read from the schedules' own table."""


def _scheduler(root: Section, out: Builder) -> None:
    """A DeepSpeed scheduler -> lr_schedule of the same name (zeroshard/trainer/schedules.py) and its params."""
    sched = root.section("scheduler")
    if sched is None:
        out.row("scheduler", MISSING, "-", FROM_ZS_DEFAULT, "no scheduler section: zeroshard's linear warm-up then "
                "cosine decay (warmup, min_lr); DeepSpeed alone would hold lr constant (--lr-schedule constant)",
               noted=True)
        return
    kind = sched.concrete("type")
    params = sched.section("params") or Section({}, sched.name("params"))
    if kind not in DS_SCHEDULES:
        raise UnsupportedKey(f"DeepSpeed key {sched.name('type')}={kind!r} is unsupported: zeroshard runs "
                             f"{', '.join(DS_SCHEDULES)} and the HF Trainer's schedules (--lr-schedule); "
                             "--drop scheduler converts with zeroshard's schedule")
    name = DS_SCHEDULES[kind]
    out.set(sched.name("type"), kind, "lr_schedule", name, FROM_JSON)
    given_type = params.take("warmup_type", MISSING)
    warmup_type = "log" if given_type is MISSING else given_type  # DeepSpeed's default is "log"
    if warmup_type not in SCHEDULES[name].shapes:
        raise UnsupportedKey(f"DeepSpeed key {params.name('warmup_type')}={warmup_type!r} is unsupported: {kind} "
                             f"warms up {' or '.join(SCHEDULES[name].shapes)}")
    out.set(params.name("warmup_type"), given_type, "warmup_shape", warmup_type,
            FROM_JSON if given_type is not MISSING else f"{FROM_DS_DEFAULT} log")
    out.refuse(params, "last_batch_iteration", "zeroshard resumes its schedule from checkpoints", off=(None, -1))
    out.map(params, "warmup_num_steps", "warmup", absent=1000, cast=int)  # DeepSpeed's default
    if kind in ("WarmupCosineLR", "WarmupDecayLR"):
        steps = out.map(params, "total_num_steps", "steps", cast=int)
        if steps is MISSING:
            raise UnsupportedKey(f"{params.name('total_num_steps')} is missing; zeroshard needs it as steps (or "
                                 "\"auto\" to take --steps)")
    if kind == "WarmupCosineLR":  # ratios of the optimizer's lr
        lr = out.values.get("lr", default_of("lr"))
        for key, field, default in (("cos_min_ratio", "min_lr", 1e-4), ("warmup_min_ratio", "warmup_min_lr", 0.0)):
            ratio = float(params.concrete(key, default))
            out.set(params.name(key), params.data.get(key, MISSING), field, lr * ratio,
                    f"lr x {key}" + ("" if params.has(key) else f" ({FROM_DS_DEFAULT} {default})"))
        return _finish_scheduler(params, sched)
    _warmup_lr_params(params, out)
    _finish_scheduler(params, sched)


def _warmup_lr_params(params: Section, out: Builder) -> None:
    """WarmupLR's and WarmupDecayLR's own lrs: warmup_max_lr is the peak (DeepSpeed's default 1e-3,
    whatever the optimizer's says; "auto" is the Trainer's, the optimizer's), warmup_min_lr the start."""
    lr = out.values.get("lr", default_of("lr"))
    given = params.take("warmup_max_lr", MISSING)
    if given == AUTO:
        out.row(params.name("warmup_max_lr"), given, f"lr = {lr!r}", "auto: the optimizer's lr")
    else:
        peak = 1e-3 if given is MISSING else float(given)
        if "lr" in out.values and peak != out.values["lr"]:
            raise UnsupportedKey(f"DeepSpeed key {params.name('warmup_max_lr')}={given if given is not MISSING else 1e-3!r}"
                                 f"{' (DeepSpeed default)' if given is MISSING else ''} and optimizer.params.lr="
                                 f"{out.values['lr']!r} differ; the scheduler's wins in DeepSpeed: make them agree")
        out.set(params.name("warmup_max_lr"), given, "lr", peak, FROM_JSON if given is not MISSING else FROM_DS_DEFAULT)
    low = params.take("warmup_min_lr", MISSING)
    value = 0.0 if low in (MISSING, AUTO) else float(low)  # the Trainer fills 0
    out.set(params.name("warmup_min_lr"), low, "warmup_min_lr", value,
            "auto: 0 (as the HF Trainer fills it)" if low == AUTO else FROM_JSON if low is not MISSING
            else FROM_DS_DEFAULT)


def _finish_scheduler(params: Section, sched: Section) -> None:
    params.finish()
    sched.finish()


# Keys of DeepSpeed features zeroshard lacks that change what is trained: refused while on.
_ROOT_REFUSED = {
    "sparse_attention": "DeepSpeed sparse-attention kernels, which change what attention computes; zeroshard runs "
                        "the model's own attention",
    "pipeline": "pipeline parallelism; the nearest in zeroshard is stage 3 (each rank holds 1/N of every layer)",
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence parallelism (all-to-all over attention heads); "
                              "zeroshard's tp splits each block's matmuls instead",
    "compression_training": "DeepSpeed compression, which quantizes or prunes the model as it trains",
    "data_efficiency": "DeepSpeed data sampling and routing, which changes what each step sees",
    "curriculum_learning": "DeepSpeed curriculum learning, which changes what each step sees",
    "elasticity": "DeepSpeed elastic batch sizes, which change the batch with the world",
    "activation_checkpointing": "it configures deepspeed.checkpointing, which the model calls itself; "
                                "zeroshard's checkpointing key (none, all, every:K, sqrt) does the job",
    "moe": "DeepSpeed-MoE's own layer settings (deepspeed.moe.layer.MoE, its gating and capacity); zeroshard runs "
           "the model's own MoE layers, split over ranks by expert_parallel.autoep_size (ep)",
}
# Keys that change nothing numeric: logging, profiling, I/O tuning. Dropped with a note.
_ROOT_NOTED = {
    "wall_clock_breakdown": "zeroshard's profile (on by default) breaks every step down",
    "memory_breakdown": "zeroshard's profile records memory per step",
    "flops_profiler": "zeroshard's profile reports MFU",
    "tensorboard": "zeroshard writes RUN_DIR/metrics.jsonl; --log tensorboard forwards it",
    "wandb": "zeroshard writes RUN_DIR/metrics.jsonl; --log wandb forwards it",
    "csv_monitor": "zeroshard writes RUN_DIR/metrics.jsonl; `zeroshard report` renders it",
    "comet": "zeroshard writes RUN_DIR/metrics.jsonl; `zeroshard report` renders it",
    "comms_logger": "zeroshard's trace (--trace) and collective ledger record every collective",
    "timers": "zeroshard's profile times every step",
    "aio": "DeepSpeed's NVMe I/O tuning; zeroshard's disk offload streams slice by slice",
    "checkpoint": "DeepSpeed checkpoint-file options; zeroshard checkpoints are sharded, checksummed and reshard "
                  "on load",
    "zero_allow_untested_optimizer": "zeroshard checks its optimizer itself",
    "zero_force_ds_cpu_optimizer": "zeroshard's cpu offload steps torch's optimizer on the host",
    "dump_state": "a DeepSpeed debugging print",
}


def _misc(root: Section, out: Builder) -> None:
    out.map(root, "steps_per_print", "log_every", cast=int)
    out.refuse(root, "prescale_gradients", "zeroshard divides by the world size after reducing, in fp32")
    out.refuse(root, "gradient_predivide_factor", "zeroshard divides by the world size after reducing, in fp32",
            off=(None, 1, 1.0))
    for key, why in _ROOT_REFUSED.items():
        out.refuse(root, key, why, off=(None, False, {}, {"enabled": False}, 1))
    out.refuse(root, "gradient_accumulation_dtype", "zeroshard accumulates gradients in fp32", off=(None, "fp32"))
    for key, why in _ROOT_NOTED.items():
        out.note(root, key, why)

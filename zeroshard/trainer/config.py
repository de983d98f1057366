"""Typed configuration for `zeroshard train` and `zeroshard verify`.

A run is described by one `TrainConfig`: a few top-level keys that name the run (model, stage,
nproc, seed, mp, init, dropout) and one section per concern, each a TOML table that checks its own
fields (zeroshard/trainer/sections.py): [data], [optim], [parallel], [pipeline], [engine], [comm],
[compile], [checkpoint], [observe]. It can come from a TOML file, from command-line flags, or both;
flags override the file (see `merge_config`). Everything is validated when the config is built, so
a bad value fails before any process is spawned.

Every flat spelling that worked before still does: `TrainConfig(lr=1e-3, tp=2)`, `cfg.lr`, the
flags (`--pp-schedule`) and a TOML file of flat keys, which is read with a one-line note naming
each key's table. The engine's knobs are not restated here: `engine` is the runtime's own
`EngineOptions`, and its knob table (zeroshard.runtime.options.KNOBS) supplies their keys, types,
defaults and help, so a knob added to the engine is a flag and a TOML key with no edit here.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from zeroshard.comm.dims import ParallelDims
from zeroshard.models.names import HF_MODEL_NAMES, MODEL_NAMES, MOE_MODEL_NAMES
from zeroshard.runtime.docstrings import field_docs
from zeroshard.runtime.options import KNOB_NAMES, KNOBS, EngineOptions
from zeroshard.trainer.sections import (COMPILE_BACKENDS, FLAT, SECTIONS, WARMUP_SHAPES, CheckpointSection,
                                        CommSection, CompileSection, DataSection, EvalSection, HealSection, LoraSection,
                                        ObserveSection, OptimSection, ParallelSection, PipelineSection, check_types,
                                        check_values, flat_name)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = ["COMPILE_BACKENDS", "WARMUP_SHAPES", "TrainConfig", "config_from_sources", "field_help", "field_names",
           "field_section", "field_type", "load_toml", "merge_config"]

TP_MODEL_NAMES = MODEL_NAMES + ("hf:llama-tiny",)
"""The named models `tp` > 1 can split: those whose spec has a tensor-parallel plan
(zeroshard/models/spec.py: zeroshard's GPT, its MoE preset's attention included, and HF Llama, whose
config declares one; HF GPT-2's declares none). Read here without building them (a unit test keeps
this list equal to the specs); a pretrained folder's spec is checked before launch on a meta build."""
PP_MODEL_NAMES = MODEL_NAMES + HF_MODEL_NAMES
"""The models `pp` > 1 cuts into stages by name (zeroshard/parallel/pipeline/layout.py finds their
blocks); a pretrained folder too, whatever its architecture."""
PARAM_DTYPES = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
TOP = ("model", "stage", "nproc", "seed", "mp", "init", "dropout")
"""The keys outside any table: what names the run."""
ENGINE_TABLE = "engine"
TABLES = {s.TABLE: s for s in SECTIONS}  # type: ignore[attr-defined]
"""TOML table name -> its section class ([engine] is the runtime's EngineOptions, spelled by its knobs)."""


@dataclass(kw_only=True, init=False)
class TrainConfig:
    """One training run: the keys that name it, then one section per TOML table.

    Built from any mix of section objects (`optim=OptimSection(lr=3e-4)`), tables as dicts
    (`optim={"lr": 3e-4}`) and flat keys (`lr=3e-4`, as flags and old TOML files spell them);
    a flat key wins over its table. `cfg.lr` reads `cfg.optim.lr`."""

    model: str = "tiny"
    """Named GPT size: tiny (<1M params, for tests), small (~25M) or medium (~120M); or a Hugging Face
    model, hf:gpt2-tiny or hf:llama-tiny (needs the hf extra)."""

    stage: int = 0
    """Sharding stage: 0 = DDP, 1 = optimizer state, 2 = + gradients, 3 = + parameters."""

    nproc: int = 2
    """Local processes to spawn. Ignored under torchrun, where WORLD_SIZE decides."""

    seed: int = 0
    """Seeds model init, the synthetic data and the sampler. Same seed, same run."""

    mp: str = "fp32"
    """Mixed precision: the compute (and all-gather) dtype of params, fp32, bf16 or fp16.
    Masters and optimizer state stay fp32 and gradients are reduced in fp32; fp16 adds dynamic
    loss scaling."""

    init: str = "auto"
    """How the model is initialised: 'meta' builds it on the meta device and materialises only
    this rank's shards (bitwise the same values), 'full' builds it whole on every rank, 'auto'
    picks meta above 50M params."""

    dropout: bool = True
    """Train with the model's own dropout (and other train-time randomness, such as an MoE router's
    jitter). False runs the model in eval mode, which turns it off: `zeroshard verify` does, since
    masks drawn on a sharded run and on one process differ. Models without dropout are unaffected."""

    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    parallel: ParallelSection = dataclasses.field(default_factory=ParallelSection)
    pipeline: PipelineSection = dataclasses.field(default_factory=PipelineSection)
    engine: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    """The runtime's knobs: activation checkpointing, offload, buckets, prefetch, resharding,
    reduction overlap, accumulation (zeroshard.runtime.options); [engine] spells them by knob."""
    comm: CommSection = dataclasses.field(default_factory=CommSection)
    compile: CompileSection = dataclasses.field(default_factory=CompileSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    observe: ObserveSection = dataclasses.field(default_factory=ObserveSection)
    lora: LoraSection = dataclasses.field(default_factory=LoraSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    heal: HealSection = dataclasses.field(default_factory=HealSection)

    def __init__(self, **values: Any) -> None:
        tables = _split(values)
        for name in TOP:
            setattr(self, name, values.pop(name, _DEFAULTS[name]))
        if values:
            raise TypeError(f"TrainConfig got unknown keys {sorted(values)}; valid keys are: {', '.join(field_names())}")
        check_types(self, TOP)
        for table, cls in TABLES.items():
            base, own = tables.get(table, (None, {}))
            fields = {**(dataclasses.asdict(base) if base is not None else {}), **own}
            setattr(self, table, cls(**fields))
        engine, flat_knobs = tables.get(ENGINE_TABLE, (None, {}))
        self.engine = EngineOptions.from_flat(flat_knobs, base=engine)
        self._check_ranges()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: a flat key read through its section.
        if name in FLAT:
            section, field = FLAT[name]
            return getattr(object.__getattribute__(self, section.TABLE), field)  # type: ignore[attr-defined]
        raise AttributeError(f"TrainConfig has no key {name!r}")

    def replace(self, **values: Any) -> TrainConfig:
        """A copy with ``values`` (flat keys, sections or tables) on top, checked again: what
        ``dataclasses.replace`` does, spelled so a type checker takes flat keys."""
        now: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in [n for n in values if n in TABLES and n in FLAT]:  # `data="x.txt"`, `compile=True`: one field
            section, field = FLAT[name]
            if not isinstance(values[name], (section, Mapping)):
                now[name] = dataclasses.replace(now[name], **{field: values.pop(name)})
        return TrainConfig(**{**now, **values})

    @property
    def dims(self) -> ParallelDims:
        """The layout of the `nproc` ranks that `parallel` asks for (checked when the config is built)."""
        return self.parallel.dims(self.nproc)

    def _check_model_layout(self, dims: ParallelDims) -> None:
        """What the degrees ask of the model, by its name: a tp plan, MoE layers for ep. The blocks pp
        cuts and the schedule's rules need the model and the schedules: zeroshard/trainer/config_checks.py."""
        tp, ep, pp = dims.tp, dims.ep, dims.pp
        if tp > 1 and self.model in MODEL_NAMES + HF_MODEL_NAMES and self.model not in TP_MODEL_NAMES:
            raise ValueError(f"model={self.model!r} has no tensor-parallel plan; use tp=1, one of "
                             f"{', '.join(TP_MODEL_NAMES)}, or a save_pretrained folder whose config declares one")
        if self.lora.enabled and (tp > 1 or pp > 1):
            raise ValueError(f"lora_r={self.lora.r} with {'tp' if tp > 1 else 'pp'} > 1 is not composed yet; LoRA "
                             "runs at stages 0-3 with ep, or drop --lora-r")
        if ep > 1 and pp > 1 and tp > 1:
            raise ValueError(f"ep={ep} with tp={tp} under pp={pp} is not composed yet; use tp=1 with pp and ep, or pp=1")
        if ep > 1 and self.model in MODEL_NAMES + HF_MODEL_NAMES and self.model not in MOE_MODEL_NAMES:
            # (a pretrained folder's layers are checked before launch, on a meta build of it)
            raise ValueError(f"ep={ep} needs a mixture-of-experts model, but {self.model} has no MoE layer; use "
                             f"ep=1, {', '.join(MOE_MODEL_NAMES)}, or an HF Mixtral or Qwen-MoE save_pretrained folder")

    def _check_ranges(self) -> None:
        """The top-level keys, then what needs more than one section (each section checked its own)."""
        if self.model not in MODEL_NAMES + HF_MODEL_NAMES and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model!r} is not a known model; use one of {MODEL_NAMES + HF_MODEL_NAMES} "
                             "or a folder written by save_pretrained (with config.json)")
        if self.stage not in STAGES:
            raise ValueError(f"stage={self.stage} is invalid; use 0 (DDP), 1, 2 or 3")
        if self.mp not in PARAM_DTYPES:
            raise ValueError(f"mp={self.mp!r} is invalid; use one of {PARAM_DTYPES}")
        if self.init not in ("auto", "meta", "full"):
            raise ValueError(f"init={self.init!r} is invalid; use 'auto', 'meta' or 'full'")
        if self.nproc < 1:
            raise ValueError(f"nproc={self.nproc} must be >= 1")
        dims = self.parallel.dims(self.nproc)  # the degrees against nproc: zeroshard/comm/dims.py's checks
        self._check_model_layout(dims)
        if self.engine.offload.kind == "disk" and not self.engine.offload.directory:
            raise ValueError("offload='disk' needs offload_dir: pass --offload-dir DIR")
        self.comm.check_stage(self.stage)
        if self.eval.data is not None and dims.pp > 1:
            raise ValueError("eval_data needs pp=1 (held-out loss through a pipeline is not written yet); "
                             "drop --eval-data or use pp=1")
        self.heal.check_with(self.checkpoint, dims)
        # Tensor-parallel ranks share a batch: it is split over the data-parallel ranks only.
        check_batch_split(self.data.batch, dims.dp, self.optim.accum)

    def to_dict(self) -> dict[str, Any]:
        """Flat, as flags and config.json spell it: `TrainConfig(**cfg.to_dict())` is `cfg` again."""
        out: dict[str, Any] = {name: getattr(self, name) for name in TOP}
        for table in TABLES:
            section = getattr(self, table)
            out.update({flat_name(type(section), f.name): getattr(section, f.name) for f in dataclasses.fields(section)})
        out.update(self.engine.flat())
        return out

    def to_tables(self) -> dict[str, Any]:
        """As a TOML file spells it: the top-level keys, then one table per section (unset keys left out)."""
        out: dict[str, Any] = {name: getattr(self, name) for name in TOP}
        for table in TABLES:
            section = getattr(self, table)
            out[table] = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                          if getattr(section, f.name) is not None}
        out[ENGINE_TABLE] = {k: v for k, v in self.engine.flat().items() if v is not None}
        return out


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in TOP}
_KNOB_TYPES = {knob.name: knob.type for knob in KNOBS}


def _split(values: dict[str, Any]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Take the sections' values out of ``values``: per table, (a section object or None, its fields).
    Objects and tables first, so that a flat key given beside them wins."""
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for table in (*TABLES, ENGINE_TABLE):
        cls = TABLES.get(table, EngineOptions)
        value = values.get(table)
        if isinstance(value, cls):
            out[table] = (values.pop(table), {})
        elif isinstance(value, Mapping):  # a table; `data = "x.txt"` and `compile = true` are flat keys
            out[table] = (None, table_fields(table, values.pop(table), source="TrainConfig"))
    for name in list(values):
        if name in FLAT or name in KNOB_NAMES:
            table, field = (FLAT[name][0].TABLE, FLAT[name][1]) if name in FLAT else (ENGINE_TABLE, name)  # type: ignore[attr-defined]
            out.setdefault(table, (None, {}))[1][field] = values.pop(name)
    if ENGINE_TABLE in out:
        base, knobs = out[ENGINE_TABLE]
        out[ENGINE_TABLE] = (base, check_values(knobs, _KNOB_TYPES))
    return out


def table_fields(table: str, values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """A table's keys, `-` read as `_`, checked against its section's fields (or the engine's knobs)."""
    cls = TABLES.get(table)
    known = [f.name for f in dataclasses.fields(cls)] if cls is not None else list(KNOB_NAMES)
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown key {key!r} in [{table}] of {source}; valid keys there are: {', '.join(known)}")
        out[name] = value
    return out


def check_batch_split(batch: int, world: int, accum: int = 1) -> None:
    """Every rank gets the same number of sequences, in `accum` equal micro-batches."""
    if batch % (world * accum) != 0:
        raise ValueError(
            f"global batch={batch} does not split evenly over {world} ranks x {accum} micro-steps; "
            f"use a batch that is a multiple of {world * accum}"
        )


def _flat_keys() -> dict[str, tuple[str | None, Any, str]]:
    """Every flat key -> (its table, None at the top; its annotation; its help)."""
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    out: dict[str, tuple[str | None, Any, str]] = {name: (None, hints[name], docs.get(name, "")) for name in TOP}
    for cls in SECTIONS:
        h, d = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            out[flat_name(cls, f.name)] = (cls.TABLE, h[f.name], d.get(f.name, ""))  # type: ignore[attr-defined]
    out.update({knob.name: (ENGINE_TABLE, knob.type, knob.help) for knob in KNOBS})
    return out


_KEYS = _flat_keys()


def field_names() -> list[str]:
    """Every key a config takes, flat: the top-level keys, each section's, then the engine's knobs."""
    return list(_KEYS)


def field_type(name: str) -> Any:
    """A key's annotation (``int``, ``str | None``, ...), for a flag's type."""
    return _KEYS[name][1]


def field_help(name: str) -> str:
    """The docstring under a field (or engine knob), reused as its --help text so the two never drift."""
    return _KEYS[name][2] if name in _KEYS else ""


def field_section(name: str) -> str | None:
    """The TOML table a flat key belongs to; None for a top-level key."""
    return _KEYS[name][0]


def table_spelling(name: str) -> str:
    """How a TOML file spells a flat key now: ``[pipeline] schedule`` for ``pp_schedule``."""
    table = field_section(name)
    if table is None:
        return name
    return f"[{table}] {FLAT[name][1] if name in FLAT else name}"


def load_toml(path: str | Path, *, note: Any = None) -> dict[str, Any]:
    """Read a TOML file of TrainConfig keys, as flat keys. Tables ([optim], [parallel], ...) are the
    spelling; flat keys at the top (the spelling before the tables) are read too, with one line to
    ``note`` (stderr by default) naming each one's table. A `[train]` wrapper table is accepted."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist; check the --config path")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from e
    if set(raw) == {"train"} and isinstance(raw["train"], dict):
        raw = raw["train"]
    flat: dict[str, Any] = {}
    old: list[str] = []
    for key, value in raw.items():
        name = key.replace("-", "_")
        if (name in TABLES or name == ENGINE_TABLE) and isinstance(value, dict):
            for field, v in table_fields(name, value, source=str(p)).items():
                flat[flat_name(TABLES[name], field) if name in TABLES else field] = v
            continue
        flat[key] = value
        if name in _KEYS and field_section(name) is not None:
            old.append(name)
    if old:
        print(f"zeroshard: note: {p} uses flat keys, read as before; write them as tables: "
              + ", ".join(f"{n} -> {table_spelling(n)}" for n in old), file=note or sys.stderr)
    return normalize_keys(flat, source=str(p))


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

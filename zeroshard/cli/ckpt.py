"""`zeroshard ckpt inspect|verify|repair|export|reshard|import-dcp|export-dcp`: offline checkpoint tools (no process group).

  inspect DIR            what a checkpoint holds: step, world, stage, versions, sizes, state
  verify DIR...          checksums, sizes, headers and coverage; a root verifies every checkpoint in it
  repair DIR             rebuild a lost or damaged manifest from intact rank files (a root: every
                         checkpoint in it that does not verify); the damaged manifest is kept
  export DIR OUT         one safetensors file for the plain model, streamed one param at a time
  export DIR --hf OUT    a from_pretrained folder (config.json, sharded safetensors, index); a LoRA run merged
  export DIR --adapter OUT  a LoRA run's adapter folder, for peft.PeftModel.from_pretrained
  reshard SRC DST -w M   rewrite as M rank files (any checkpoint loads at any world size anyway);
                         --tp T lays them out as (M/T, T) tensor-parallel ranks; --ep E splits the
                         experts over E ranks, each block sharded over M/E
  import-dcp DCP_DIR OUT a torch.distributed.checkpoint directory (FSDP2's dcp.save) -> a checkpoint
  export-dcp DIR OUT     a checkpoint -> a torch.distributed.checkpoint directory for dcp.load

DIR may be a checkpoint directory, a root with a `latest` pointer (verify and repair: every
checkpoint in the root), or that pointer file itself (`ckpt/latest`): every action reads it by the
one rule of zeroshard/checkpoint/discover.py `named`. Exit status 1 on any problem, with the file or
key named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:,.1f} GB"


def _err(message: str) -> int:
    print(f"zeroshard ckpt: error: {message}", file=sys.stderr, flush=True)
    return 1


def summary(directory: Path, manifest: dict) -> dict[str, Any]:
    numel = sum(_numel(p["shape"]) for p in manifest["params"])
    opt = manifest.get("optimizer")
    return {
        "path": str(directory), "step": manifest["step"], "world": manifest["world"], "stage": manifest["stage"],
        "ep": (manifest.get("mesh") or {}).get("ep_size", 1),
        "created": manifest.get("created"), "zeroshard": manifest.get("zeroshard"), "torch": manifest.get("torch"),
        "git": manifest.get("git"), "model": manifest.get("model"), "params": len(manifest["params"]),
        "param_elements": numel, "units": len(manifest.get("units", [])),
        "optimizer": None if opt is None else opt["class"],
        "optimizer_state": sorted({s for p in manifest["params"] for s in p["state"]}),
        "scheduler": manifest.get("scheduler") is not None, "scaler": manifest.get("scaler") is not None,
        "sampler": manifest.get("sampler"), "files": manifest["files"],
        "bytes": sum(f["bytes"] for f in manifest["files"].values()),
        "resharded_from": manifest.get("resharded_from"),
        "pipeline": manifest.get("pipeline"),
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _one(path: str) -> Path:
    """The one complete checkpoint ``path`` names, as every action reads it (CheckpointError if none)."""
    from zeroshard.checkpoint.discover import named

    return named(path).checkpoints[0]


def cmd_inspect(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.format import read_manifest

    try:
        directory = _one(args.dir)
        info = summary(directory, read_manifest(directory))
    except CheckpointError as e:
        return _err(str(e))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    model = info["model"] or {}
    print(f"checkpoint {info['path']}")
    experts = f", experts split over ep {info['ep']}" if info["ep"] > 1 else ""
    print(f"  step {info['step']}, saved on {info['world']} ranks at stage {info['stage']}{experts} ({info['created']})")
    print(f"  zeroshard {info['zeroshard']}, torch {info['torch']}, git {info['git'] or 'unknown'}")
    print(f"  model {model.get('class')} {json.dumps(model.get('config'))}")
    print(f"  {info['params']} params, {info['param_elements']:,} elements, {info['units']} units")
    print(f"  optimizer {info['optimizer'] or '-'} (state: {', '.join(info['optimizer_state']) or '-'}); "
          f"scheduler {'yes' if info['scheduler'] else 'no'}, scaler {'yes' if info['scaler'] else 'no'}, "
          f"sampler {json.dumps(info['sampler'])}")
    if info["pipeline"] is not None:
        print(f"  {_pipeline_line(info['pipeline'])}")
    print(f"  {len(info['files'])} files, {_fmt_bytes(info['bytes'])}:")
    for name, f in info["files"].items():
        print(f"    {name}  {_fmt_bytes(f['bytes'])}  sha256 {f['sha256'][:16]}...")
    return 0


def _pipeline_line(placement: dict) -> str:
    """The pp placement a checkpoint was saved with (zeroshard/checkpoint/stages.py), in one line."""
    stages = "; ".join(f"stage {s} on pp rank {r}: blocks {blocks[0]}-{blocks[-1]}, {len(names)} params"
                       for s, (r, blocks, names) in enumerate(zip(placement["pp_rank_of_stage"], placement["blocks"],
                                                                  placement["stage_params"])))
    tied = "".join(f"; tied {t['param']} = {t['copy']} (owned by stage {t['owner_stage']}, saved once)"
                   for t in placement["tied"])
    return f"pipeline: pp {placement['pp']}, {placement['stages']} stages ({placement['schedule']}): {stages}{tied}"


def cmd_verify(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError, problems
    from zeroshard.checkpoint.discover import interrupted_saves, named

    failed = False
    for target in args.dirs:
        try:
            found = named(target, every=True)
        except CheckpointError as e:
            print(f"FAIL {target}: {e}")
            failed = True
            continue
        if found.root is not None:  # a root: its saves that never committed are named too
            for partial in interrupted_saves(found.root):
                print(f"SKIP {partial}: interrupted save, never committed")
            if not found.checkpoints:
                print(f"FAIL {found.root}: no checkpoints found")
                failed = True
        for directory in found.checkpoints:
            faults = problems(directory)
            if faults:
                failed = True
                print(f"FAIL {directory}")
                for problem in faults:
                    print(f"  {problem}")
            else:
                print(f"OK   {directory}")
    return 1 if failed else 0


def cmd_repair(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.discover import named
    from zeroshard.checkpoint.repair import needs_repair, repair

    try:
        targets = named(args.dir, every=True).checkpoints
    except CheckpointError as e:
        return _err(f"{e}: nothing to repair")
    if not targets:
        return _err(f"no checkpoint in {args.dir}: nothing to repair")
    failed = False
    for directory in targets:
        if directory.is_dir() and not needs_repair(directory):
            print(f"OK       {directory}: verifies; left as it is")
            continue
        try:
            done = repair(directory)
        except CheckpointError as e:
            failed = True
            print(f"zeroshard ckpt: error: cannot repair {directory}: {e}", file=sys.stderr, flush=True)
            continue
        kept = f"; the damaged manifest is kept as {done.kept_as.name}" if done.kept_as is not None else ""
        print(f"REPAIRED {directory}: manifest rebuilt from {done.files} intact rank files and verified{kept}")
    return 1 if failed else 0


def cmd_export(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError, export
    from zeroshard.runtime.precision import parse_dtype

    if args.hf is not None or args.adapter is not None:
        return _export_hf(args)
    if args.out is None:
        return _err("export needs OUT (one safetensors file) or --hf OUT (a from_pretrained folder)")
    try:
        stats = export(_one(args.dir), args.out, dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    except (CheckpointError, ValueError) as e:
        return _err(str(e))
    print(f"wrote {stats.path}: {stats.tensors} tensors, {_fmt_bytes(stats.bytes)} "
          f"(largest param {_fmt_bytes(stats.largest_param_bytes)}, the export's working set)")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.hf import export_checkpoint
    from zeroshard.runtime.precision import parse_dtype

    given = [f for f in (args.out, args.hf, args.adapter) if f is not None]
    if len(given) > 1:
        return _err(f"give one of OUT, --hf OUT and --adapter OUT (got {' and '.join(given)})")
    try:
        out = export_checkpoint(_one(args.dir), args.hf or args.adapter, max_shard_size=args.max_shard_size,
                                dtype=parse_dtype(args.dtype), overwrite=args.overwrite, adapter=args.adapter is not None)
    except (CheckpointError, ValueError) as e:
        return _err(str(e))
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {len(files)} files ({', '.join(files)})")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError, reshard

    try:
        out = reshard(_one(args.src), args.dst, args.world, tp=args.tp, tp_plan=args.tp_plan, ep=args.ep,
                      overwrite=args.overwrite)
    except CheckpointError as e:
        return _err(str(e))
    experts = f"; experts split over ep {args.ep}, each sharded over {args.world // args.ep}" if args.ep > 1 else ""
    print(f"wrote {out}: {args.world} rank files ({args.world // args.tp} data-parallel x {args.tp} tp{experts})")
    return 0


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.dcp import import_dcp
    from zeroshard.runtime.precision import parse_dtype

    try:
        got = import_dcp(args.src, args.out, buffers=tuple(args.buffers),
                         optimizer=None if args.no_optimizer else args.optimizer, param_groups=args.param_groups,
                         dtype=parse_dtype(args.dtype), overwrite=args.overwrite,
                         batch_bytes=int(args.batch_mb * 2**20))
    except (CheckpointError, ValueError) as e:
        return _err(str(e))
    print(f"wrote {got.path}: {len(got.params)} params, {len(got.buffers)} buffers, {_fmt_bytes(got.bytes)}; "
          f"optimizer state {', '.join(got.optimizer_state) or '-'}; step {got.step}")
    for alias, owner in got.tied.items():
        print(f"  {alias} is tied to {owner}")
    if got.ignored:
        print(f"  not moved ({len(got.ignored)} keys): {', '.join(got.ignored[:4])}{' ...' if len(got.ignored) > 4 else ''}")
    return 0


def cmd_export_dcp(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.dcp import export_dcp

    try:
        got = export_dcp(_one(args.dir), args.out, optimizer=not args.no_optimizer, overwrite=args.overwrite)
    except (CheckpointError, ValueError) as e:
        return _err(str(e))
    print(f"wrote {got.path}: {got.model_keys} model keys, {got.optimizer_keys} optimizer state tensors, "
          f"{_fmt_bytes(got.bytes)} (largest param {_fmt_bytes(got.largest_param_bytes)})")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="inspect, verify, export, reshard checkpoints; move them to and from DCP (offline)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    q = cmds.add_parser("inspect", help="summarise a checkpoint")
    q.add_argument("dir")
    q.add_argument("--json", action="store_true", help="print the summary as JSON")
    q.set_defaults(run=cmd_inspect)
    q = cmds.add_parser("verify", help="check sizes, sha256, headers and coverage")
    q.add_argument("dirs", nargs="+", metavar="DIR")
    q.set_defaults(run=cmd_verify)
    q = cmds.add_parser("repair", help="rebuild a lost or damaged manifest from intact rank files")
    q.add_argument("dir", help="a checkpoint directory, or a root: every checkpoint in it that does not verify")
    q.set_defaults(run=cmd_repair)
    q = cmds.add_parser("export", help="consolidate into one safetensors file, one param at a time")
    q.add_argument("dir")
    q.add_argument("out", nargs="?", help="the safetensors file to write (or use --hf)")
    q.add_argument("--hf", metavar="OUT", default=None,
                   help="write a from_pretrained folder instead: config.json, sharded safetensors, index")
    q.add_argument("--adapter", metavar="OUT", default=None,
                   help="a LoRA run: write the adapter folder PeftModel.from_pretrained opens (--hf writes it merged)")
    q.add_argument("--max-shard-size", default="5GB", help="with --hf: largest safetensors file (default 5GB)")
    q.add_argument("--dtype", default=None, help="cast params to fp32, bf16 or fp16 (default: as saved)")
    q.add_argument("--overwrite", action="store_true")
    q.set_defaults(run=cmd_export)
    q = cmds.add_parser("reshard", help="rewrite as M rank files")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("-w", "--world", type=int, required=True, help="number of rank files to write")
    q.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the new layout (world = dp x tp)")
    q.add_argument("--tp-plan", default=None, metavar="NAME",
                   help="the model's TP plan, for a checkpoint saved without TP going to --tp > 1: gpt, or the "
                        "model_type of a transformers model whose config declares one (llama, mistral, ...)")
    q.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree of the new layout: each rank holds 1/ep of the experts (default 1)")
    q.add_argument("--overwrite", action="store_true")
    q.set_defaults(run=cmd_reshard)
    q = cmds.add_parser("import-dcp", help="a torch.distributed.checkpoint (FSDP2) directory -> a checkpoint")
    q.add_argument("src", metavar="DCP_DIR")
    q.add_argument("out", metavar="OUT")
    q.add_argument("--buffers", nargs="*", default=[], metavar="GLOB",
                   help="model tensors that are buffers, not params (e.g. '*.running_mean')")
    q.add_argument("--optimizer", default="torch.optim.AdamW",
                   help="the optimizer class the state belongs to (DCP does not record it; default AdamW)")
    q.add_argument("--no-optimizer", action="store_true", help="leave the optimizer state behind")
    q.add_argument("--param-groups", type=int, default=2,
                   help="param groups of the zs.optimizer that will load it (default 2: decay, no decay)")
    q.add_argument("--dtype", default=None, help="cast floating params and state (e.g. fp32 masters from bf16)")
    q.add_argument("--batch-mb", type=float, default=32.0, help="MiB read per dcp.load call (default 32)")
    q.add_argument("--overwrite", action="store_true")
    q.set_defaults(run=cmd_import_dcp)
    q = cmds.add_parser("export-dcp", help="a checkpoint -> a torch.distributed.checkpoint directory")
    q.add_argument("dir")
    q.add_argument("out", metavar="OUT")
    q.add_argument("--no-optimizer", action="store_true", help="write the model only")
    q.add_argument("--overwrite", action="store_true")
    q.set_defaults(run=cmd_export_dcp)

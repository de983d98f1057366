"""World-1 overhead, memory, MFU and a parity check on one GPU, in one process.

    bash bench/gpu.sh                                                   # on the GPU machine, $OUT set
    .venv/bin/python bench/gpu_overhead.py --device cpu --model tiny --steps 3   # CPU smoke test

At world 1 nothing needs communicating, so whatever zeroshard stage 3 and FSDP2 cost above plain
eager PyTorch is their own machinery: hooks, flat-buffer / all-gather copies, casts, bookkeeping.
For each model and precision three candidates train the same batch from the same weights:

- **eager**: the model alone (``torch.autocast`` for bf16), no process group involved;
- **zeroshard s3**: ``zs.shard(model, stage=3)`` (``zs.MixedPrecision(param_dtype=bf16)``);
- **FSDP2**: ``fully_shard`` on every block and on the root
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``).

Runs are interleaved (A B C, A B C, ...) so clock and thermal drift hit every candidate alike. A step
is timed from a device synchronize to the next, so host-side hook cost shows whenever it is not
hidden behind queued kernels. Without ``--batch`` the batch doubles until eager takes
``--target-ms``, so the figures are not pure launch latency.

Memory is per candidate although all three live in one process: resident bytes are what building
and warming it up left allocated, the step's transient peak is measured above whatever was live
when the step began; their sum is the candidate's own peak.

Results are printed and, with ``--out`` (default ``$OUT/gpu_results.json`` when ``$OUT`` is set),
written as JSON after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    # The GPU machine may run a system interpreter with no editable install of this package.
    sys.path.insert(0, str(REPO))

import zeroshard as zs  # noqa: E402
from zeroshard.models.gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.tools.benchmark.candidates import sharded_step  # noqa: E402
from zeroshard.trainer.step import plain_step  # noqa: E402
from zeroshard.observing.profile.alloc import allocation_profile, peak_allocated  # noqa: E402
from zeroshard.observing.profile.flops import calibrate_peak_flops, gpt_flops  # noqa: E402

LR = 3e-4
WEIGHT_DECAY = 0.1
SEED = 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2**20


# ----------------------------------------------------------------------------------------------
# Device helpers: one place that knows CPU has no allocator counters and no asynchronous queue.

@dataclasses.dataclass
class Dev:
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()  # engines and hooks form reference cycles; free their buffers before the next section
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def resident_after(self, fn: Callable[[], Any]) -> tuple[int, Any]:
        """Bytes ``fn`` left allocated, and its result."""
        if self.cuda:
            self.sync()
            before = torch.cuda.memory_allocated(self.device)
            result = fn()
            self.sync()
            return torch.cuda.memory_allocated(self.device) - before, result
        _, kept, result = allocation_profile(fn)
        return kept, result

    def transient_peak(self, fn: Callable[[], Any]) -> int:
        """Peak bytes above what was allocated when ``fn`` started."""
        if self.cuda:
            self.sync()
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            self.sync()
            return torch.cuda.max_memory_allocated(self.device) - base
        peak, _ = peak_allocated(fn)
        return peak

    def timed(self, fn: Callable[[], Any]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Candidates. Unlike zeroshard/tools/benchmark/candidates.py these run in one process at world 1, keep
# per-candidate memory and error fields, and give eager and FSDP2 the same weight-decay groups as
# zs.optimizer, so the optimizer work matches exactly; the zeroshard step is the bench's own.

@dataclasses.dataclass
class Candidate:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ours: bool = False
    resident_bytes: int | None = None
    transient_bytes: int | None = None
    comm_bytes: int | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def _gpt(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(SEED)  # every candidate starts from the same weights
    with torch.device(device):
        return GPT(cfg)


def _adamw(params, **kw):
    return torch.optim.AdamW(params, lr=LR, foreach=True, **kw)


def build_eager(cfg: GPTConfig, dtype: torch.dtype, device: torch.device) -> Candidate:
    model = _gpt(cfg, device)
    # zs.optim_groups: decay exactly the params zs.optimizer decays, so the optimizer work matches.
    opt = _adamw(zs.optim_groups(model, WEIGHT_DECAY))
    amp = dtype != torch.float32

    def step(x, y):
        return plain_step(model, opt, x, y, autocast_dtype=dtype if amp else None)
    return Candidate("eager", model, opt, step)


def build_zeroshard(cfg: GPTConfig, dtype: torch.dtype, device: torch.device) -> Candidate:
    mp = None if dtype == torch.float32 else zs.MixedPrecision(param_dtype=dtype)
    model = zs.shard(_gpt(cfg, device), stage=3, mp=mp)
    opt = zs.optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    return Candidate("zeroshard s3", model, opt, sharded_step(model, opt), ours=True)


_FSDP_MESH = None


def _fsdp_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return MixedPrecisionPolicy, fully_shard


def build_fsdp2(cfg: GPTConfig, dtype: torch.dtype, device: torch.device) -> Candidate:
    global _FSDP_MESH
    from torch.distributed.device_mesh import init_device_mesh

    MixedPrecisionPolicy, fully_shard = _fsdp_api()
    if _FSDP_MESH is None:
        _FSDP_MESH = init_device_mesh(device.type, (1,))
    model = _gpt(cfg, device)
    mp = (MixedPrecisionPolicy() if dtype == torch.float32
          else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
    for block in model.blocks:
        fully_shard(block, mesh=_FSDP_MESH, mp_policy=mp)
    fully_shard(model, mesh=_FSDP_MESH, mp_policy=mp)
    # Groups taken after fully_shard: it replaces the params with DTensors.
    opt = _adamw(zs.optim_groups(model, WEIGHT_DECAY))

    def step(x, y):
        return plain_step(model, opt, x, y)
    return Candidate("FSDP2", model, opt, step)


BUILDERS = {"eager": build_eager, "zeroshard": build_zeroshard, "fsdp2": build_fsdp2}


def batch_of(cfg: GPTConfig, batch: int, seq: int, device: torch.device, seed: int = SEED):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return x.to(device), y.to(device)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------
# Sections

def pick_batch(dev: Dev, cfg: GPTConfig, dtype: torch.dtype, args, target_ms: float,
               build: Callable = build_eager) -> tuple[int, list[dict]]:
    """Smallest power-of-two multiple of ``--start-batch`` whose step takes ``target_ms``."""
    if args.batch:
        return args.batch, []
    if not dev.cuda:
        return 4, []
    probes: list[dict] = []
    batch = _grow_batch(dev, build(cfg, dtype, dev.device), cfg, args, target_ms, probes)
    dev.free()  # the probe model is garbage once _grow_batch returns
    return batch, probes


def _grow_batch(dev: Dev, cand: Candidate, cfg: GPTConfig, args, target_ms: float, probes: list[dict]) -> int:
    batch = args.start_batch
    while True:
        x, y = batch_of(cfg, batch, cfg.seq_len, dev.device)
        try:
            for _ in range(2):
                cand.step(x, y)
            ms = 1e3 * statistics.median(dev.timed(lambda: cand.step(x, y)) for _ in range(3))
        except torch.cuda.OutOfMemoryError:
            probes.append({"batch": batch, "oom": True})
            return max(args.start_batch, batch // 2)
        probes.append({"batch": batch, "step_ms": round(ms, 3)})
        if ms >= target_ms or batch * 2 > args.max_batch:
            return batch
        batch *= 2


def overhead_section(dev: Dev, model_name: str, dtype_name: str, args, log) -> dict:
    dtype = DTYPES[dtype_name]
    cfg = GPTConfig.named(model_name, **({"seq_len": args.seq} if args.seq else {}))
    batch, probes = pick_batch(dev, cfg, dtype, args, args.target_ms)
    seq = cfg.seq_len
    x, y = batch_of(cfg, batch, seq, dev.device)
    flops = gpt_flops(cfg, recompute=False)["model"]
    log(f"[{model_name} {dtype_name}] batch {batch} x seq {seq}; probes {probes}")

    cands: list[Candidate] = []
    errors: dict[str, str] = {}
    for kind in args.candidates:
        try:
            def build_and_warm(kind=kind):
                cand = BUILDERS[kind](cfg, dtype, dev.device)
                for _ in range(args.warmup):
                    cand.step(x, y)
                return cand
            resident, cand = dev.resident_after(build_and_warm)
            cand.resident_bytes = resident
            ledger_before = zs.ledger().total_bytes()
            cand.transient_bytes = dev.transient_peak(lambda: cand.step(x, y))
            if cand.ours:
                cand.comm_bytes = zs.ledger().total_bytes() - ledger_before
            cands.append(cand)
        except Exception as exc:  # one broken candidate must not cost the others' figures
            errors[kind] = _err(exc)
            log(f"  {kind} failed to build/warm up: {errors[kind]}")
            traceback.print_exc()
        dev.free()

    for _ in range(args.rounds):
        for cand in cands:
            if cand.error:
                continue
            try:
                for _ in range(args.steps):
                    cand.times.append(dev.timed(lambda: cand.step(x, y)))
            except Exception as exc:
                cand.error = _err(exc)
                log(f"  {cand.name} failed while timed: {cand.error}")
                traceback.print_exc()

    tokens = batch * seq
    rows = []
    eager_med = None
    for cand in cands:
        if cand.name == "eager" and cand.times and not cand.error:
            eager_med = statistics.median(cand.times)
    for cand in cands:
        row: dict[str, Any] = {"candidate": cand.name, "error": cand.error, "steps_timed": len(cand.times)}
        if cand.times:
            med = statistics.median(cand.times)
            row.update(median_ms=1e3 * med, min_ms=1e3 * min(cand.times), max_ms=1e3 * max(cand.times),
                       tokens_per_s=tokens / med,
                       overhead_pct=None if eager_med is None else 100.0 * (med / eager_med - 1.0),
                       overhead_ms=None if eager_med is None else 1e3 * (med - eager_med),
                       # Against a bf16 peak only: an fp32 step measured against it would mislead.
                       mfu=(flops * tokens / med / args.peak_flops) if dtype != torch.float32 else None)
        resident, transient = cand.resident_bytes, cand.transient_bytes
        row.update(resident_bytes=resident, step_transient_bytes=transient,
                   peak_bytes=None if resident is None or transient is None else resident + transient,
                   comm_bytes_per_step=cand.comm_bytes)
        rows.append(row)
    for kind, msg in errors.items():
        rows.append({"candidate": kind, "error": msg})
    return {"model": model_name, "dtype": dtype_name, "batch": batch, "seq": seq, "tokens_per_step": tokens,
            "flops_per_token": flops, "batch_probes": probes, "rows": rows,
            "memory_method": "cuda allocator counters" if dev.cuda else "torch.profiler allocation events"}


def mfu_section(dev: Dev, args, log) -> dict:
    """zeroshard stage 3, bf16, at a batch big enough to be compute-bound; eager alongside."""
    cfg = GPTConfig.named(args.mfu_model, **({"seq_len": args.seq} if args.seq else {}))
    dtype = torch.bfloat16
    batch, probes = pick_batch(dev, cfg, dtype, args, args.mfu_target_ms, build=build_zeroshard)
    seq = cfg.seq_len
    x, y = batch_of(cfg, batch, seq, dev.device)
    flops = gpt_flops(cfg, recompute=False)
    log(f"[MFU {args.mfu_model} bf16] batch {batch} x seq {seq}; probes {probes}")
    cands = []
    for kind in ("zeroshard", "eager"):
        try:
            cand = BUILDERS[kind](cfg, dtype, dev.device)
            for _ in range(args.warmup):
                cand.step(x, y)
            cands.append(cand)
        except Exception as exc:
            log(f"  {kind} failed: {_err(exc)}")
            traceback.print_exc()
    for _ in range(max(1, args.mfu_steps // 2)):
        for cand in cands:
            cand.times += [dev.timed(lambda: cand.step(x, y)) for _ in range(2)]
    measured_peak = None
    try:
        measured_peak = calibrate_peak_flops(dev.device, dtype, seconds=0.5)
    except Exception as exc:
        log(f"  matmul calibration failed: {_err(exc)}")
    tokens = batch * seq
    rows = []
    for cand in cands:
        med = statistics.median(cand.times)
        achieved = flops["model"] * tokens / med
        rows.append({"candidate": cand.name, "median_ms": 1e3 * med, "tokens_per_s": tokens / med,
                     "achieved_flops": achieved, "mfu": achieved / args.peak_flops,
                     "mfu_vs_measured_matmul": None if not measured_peak else achieved / measured_peak})
    return {"model": args.mfu_model, "dtype": "bf16", "batch": batch, "seq": seq, "batch_probes": probes,
            "flops_per_token": flops["model"], "params": _num_params(cfg),
            "peak_flops_used": args.peak_flops, "peak_flops_source": args.peak_source,
            "measured_bf16_matmul_flops": measured_peak, "rows": rows}


def _num_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return GPT(cfg).num_params()


def parity_section(dev: Dev, args, log) -> dict:
    """Stage 3 at world 1 against plain eager, tiny fp32: the two must train the same weights."""
    cfg = GPTConfig.named("tiny")
    steps, batch = args.parity_steps, 8
    eager = _gpt(cfg, dev.device)
    eager_opt = torch.optim.AdamW(zs.optim_groups(eager, WEIGHT_DECAY), lr=1e-3, betas=(0.9, 0.95), foreach=True)
    ours = zs.shard(_gpt(cfg, dev.device), stage=3)
    ours_opt = zs.optimizer(ours, torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY,
                            foreach=True)
    eager_step = partial(plain_step, eager, eager_opt)
    ours_step = sharded_step(ours, ours_opt)
    loss_diff = 0.0
    for i in range(steps):
        x, y = batch_of(cfg, batch, cfg.seq_len, dev.device, seed=100 + i)
        losses = [float(step(x, y)) for step in (eager_step, ours_step)]
        loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
    ref = dict(eager.state_dict())
    got = zs.full_state_dict(ours)
    common = sorted(set(ref) & set(got))
    per_param = {k: (ref[k].float() - got[k].to(ref[k].device).float()).abs().max().item() for k in common}
    worst = max(per_param, key=per_param.get)
    result = {"model": "tiny", "dtype": "fp32", "steps": steps, "batch": batch,
              "max_abs_param_diff": per_param[worst], "worst_param": worst, "max_abs_loss_diff": loss_diff,
              "params_compared": len(common), "missing": sorted(set(ref) ^ set(got)),
              "tolerance": args.parity_tol}
    result["ok"] = per_param[worst] <= args.parity_tol and not result["missing"]
    return result


# ----------------------------------------------------------------------------------------------
# Environment, output

def environment(dev: Dev, args) -> dict:
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "zeroshard": getattr(zs, "__version__", None), "device": str(dev.device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(), "tf32": args.tf32,
    }
    if dev.cuda:
        props = torch.cuda.get_device_properties(dev.device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sm_count=props.multi_processor_count)
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            env["nccl"] = None
    else:
        env["cpu_threads"] = torch.get_num_threads()
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["git_commit"] = None
    return env


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


class Printer:
    """rich tables when rich is importable (it is a dependency, but a bare system python may lack it)."""

    def __init__(self) -> None:
        try:
            from rich.console import Console
            self.console = Console(width=160)
        except ImportError:
            self.console = None

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        if self.console is not None:
            from rich.table import Table
            t = Table(title=title)
            for i, h in enumerate(header):
                t.add_column(h, justify="left" if i == 0 else "right")
            for r in rows:
                t.add_row(*r)
            self.console.print(t)
        else:
            widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
            print(f"\n{title}")
            print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
            for r in rows:
                print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        sys.stdout.flush()


def print_overhead(p: Printer, sec: dict) -> None:
    header = ["candidate", "median ms", "min-max ms", "tok/s", "overhead", "+ms", "resident MiB", "step peak MiB",
              "peak MiB", "comm MiB/step", "MFU"]
    rows = []
    for r in sec["rows"]:
        if "median_ms" not in r:
            rows.append([r["candidate"], "FAILED", (r.get("error") or "")[:60]] + [""] * (len(header) - 3))
            continue
        rows.append([r["candidate"] + (" (failed later)" if r.get("error") else ""), f"{r['median_ms']:.2f}",
                     f"{r['min_ms']:.1f}-{r['max_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                     _fmt(r["overhead_pct"], "+.1f", "%"), _fmt(r["overhead_ms"], "+.2f"),
                     _fmt_bytes(r["resident_bytes"]), _fmt_bytes(r["step_transient_bytes"]),
                     _fmt_bytes(r["peak_bytes"]), _fmt_bytes(r["comm_bytes_per_step"]),
                     _fmt(r["mfu"] and 100 * r["mfu"], ".1f", "%")])
    p.table(f"{sec['model']} {sec['dtype']}: batch {sec['batch']} x seq {sec['seq']}, median of "
            f"{max((r.get('steps_timed', 0) for r in sec['rows']), default=0)} interleaved steps", header, rows)


def print_mfu(p: Printer, sec: dict) -> None:
    rows = [[r["candidate"], f"{r['median_ms']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['achieved_flops'] / 1e12:.3g}",
             f"{100 * r['mfu']:.1f}%", _fmt(r["mfu_vs_measured_matmul"] and 100 * r["mfu_vs_measured_matmul"],
                                              ".1f", "%")] for r in sec["rows"]]
    measured = sec["measured_bf16_matmul_flops"]
    p.table(f"MFU {sec['model']} bf16, batch {sec['batch']} x seq {sec['seq']}, {sec['params']:,} params, "
            f"{sec['flops_per_token'] / 1e6:,.1f} MFLOP/token; peak {sec['peak_flops_used'] / 1e12:.0f} TFLOP/s "
            f"({sec['peak_flops_source']}); measured bf16 matmul "
            f"{'-' if measured is None else f'{measured / 1e12:.3g}'} TFLOP/s",
            ["candidate", "median ms", "tok/s", "TFLOP/s", "MFU", "of measured matmul"], rows)


def print_parity(p: Printer, sec: dict) -> None:
    p.table(f"parity: zeroshard stage 3 world 1 vs eager, tiny fp32, {sec['steps']} AdamW steps",
            ["check", "value"],
            [["max |param diff|", f"{sec['max_abs_param_diff']:.3g} ({sec['worst_param']})"],
             ["max |loss diff|", f"{sec['max_abs_loss_diff']:.3g}"],
             ["params compared", str(sec["params_compared"])],
             ["names missing on one side", ", ".join(sec["missing"]) or "none"],
             ["verdict", ("PASS" if sec["ok"] else "FAIL") + f" (tol {sec['tolerance']:g})"]])


class Results:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {"overhead": [], "mfu": None, "parity": None, "errors": [], "skipped": []}

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


# ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", "--models", dest="models", default=None,
                    help="comma list of GPT presets (default small,medium on cuda, tiny on cpu)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--candidates", default="eager,zeroshard,fsdp2")
    ap.add_argument("--batch", type=int, default=None, help="fixed batch; default: grow until --target-ms (cuda)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's seq_len)")
    ap.add_argument("--start-batch", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--target-ms", type=float, default=20.0, help="eager step time the auto batch aims for")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per candidate per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B C, A B C, ...)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-flops", type=float, default=None,
                    help="peak dense bf16 FLOP/s for MFU (default 989e12, H100/H200 SXM dense bf16)")
    ap.add_argument("--mfu-model", default=None, help="default medium if measured, else the last --model")
    ap.add_argument("--mfu-target-ms", type=float, default=100.0)
    ap.add_argument("--mfu-steps", type=int, default=10)
    ap.add_argument("--no-mfu", action="store_true")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--parity-steps", type=int, default=10)
    ap.add_argument("--parity-tol", type=float, default=1e-5)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 for fp32 matmuls (torch's default is off)")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (cpu device only)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="soft wall-clock budget: sections that would start after it are skipped")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_results.json when $OUT is set)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False; use --device cpu for a smoke test")
    args.models = (args.models or ("small,medium" if args.device == "cuda" else "tiny")).split(",")
    args.dtypes = args.dtypes.split(",")
    args.candidates = args.candidates.split(",")
    for name in args.models + ([args.mfu_model] if args.mfu_model else []):
        GPTConfig.named(name)  # fail on a typo before any work
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; use {', '.join(DTYPES)}")
    for c in args.candidates:
        if c not in BUILDERS:
            ap.error(f"unknown candidate {c!r}; use {', '.join(BUILDERS)}")
    args.mfu_model = args.mfu_model or ("medium" if "medium" in args.models else args.models[-1])
    args.peak_source = "--peak-flops" if args.peak_flops is not None else "default: H200 dense bf16"
    args.peak_flops = args.peak_flops or 989e12
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "gpu_results.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        # cuBLAS keeps a workspace per handle in the caching allocator; create it now so it is not
        # counted as the first candidate's resident memory.
        for dtype in DTYPES.values():
            a = torch.randn(256, 256, device=device, dtype=dtype, requires_grad=True)
            (a @ a).sum().backward()
        del a
        torch.cuda.synchronize(device)
    dev = Dev(device)
    printer = Printer()
    results = Results(Path(args.out) if args.out else None)
    results.data["args"] = {k: v for k, v in vars(args).items()}
    results.data["env"] = environment(dev, args)
    p = results.data["env"]
    log("environment: " + ", ".join(f"{k}={v}" for k, v in p.items()))
    log(f"MFU peak: {args.peak_flops:.4g} FLOP/s ({args.peak_source})")

    # One process, world 1: zs.init builds a HashStore group; FSDP2's device mesh reuses it.
    zs.init(backend="nccl" if dev.cuda else "gloo", timeout_s=120.0)
    results.data["env"]["backend"] = zs.get_mesh().backend
    results.write()

    def over_budget(name: str) -> bool:
        if args.budget_s is not None and time.monotonic() - t0 > args.budget_s:
            log(f"skipping {name}: soft budget of {args.budget_s:.0f}s spent")
            results.data["skipped"].append(name)
            return True
        return False

    def run(name: str, fn: Callable[[], Any], on_ok: Callable[[Any], None]) -> None:
        if over_budget(name):
            return
        log(f"{name} ...")
        try:
            out = fn()
        except Exception as exc:
            log(f"{name} FAILED: {_err(exc)}")
            traceback.print_exc()
            results.data["errors"].append({"section": name, "error": _err(exc), "traceback": traceback.format_exc()})
        else:
            on_ok(out)
        dev.free()  # the section's models and optimizers are unreachable now
        results.write()

    # Parity first: cheap, and if stage 3 is wrong on this device the timings below mean little.
    if not args.no_parity:
        run("parity", lambda: parity_section(dev, args, log),
            lambda sec: (results.data.__setitem__("parity", sec), print_parity(printer, sec)))

    # Order: what the MFU figure needs first, the slowest (medium fp32) last.
    plan = [(m, d) for m in args.models for d in args.dtypes]
    plan.sort(key=lambda md: (md[0] == args.mfu_model and md[1] == "fp32", args.models.index(md[0])))
    for model_name, dtype_name in plan:
        run(f"overhead {model_name} {dtype_name}", lambda: overhead_section(dev, model_name, dtype_name, args, log),
            lambda sec: (results.data["overhead"].append(sec), print_overhead(printer, sec)))
        if not args.no_mfu and results.data["mfu"] is None and model_name == args.mfu_model and dtype_name == "bf16":
            run("mfu", lambda: mfu_section(dev, args, log),
                lambda sec: (results.data.__setitem__("mfu", sec), print_mfu(printer, sec)))
    if not args.no_mfu and results.data["mfu"] is None and "mfu" not in results.data["skipped"]:
        run("mfu", lambda: mfu_section(dev, args, log),
            lambda sec: (results.data.__setitem__("mfu", sec), print_mfu(printer, sec)))

    summary = []
    for sec in results.data["overhead"]:
        for r in sec["rows"]:
            if r["candidate"] != "eager":
                summary.append([f"{sec['model']} {sec['dtype']}", r["candidate"],
                                _fmt(r.get("overhead_pct"), "+.1f", "%"), _fmt_bytes(r.get("peak_bytes"))])
    if summary:
        printer.table("summary: step-time overhead vs eager at world 1, own peak memory",
                      ["model dtype", "candidate", "overhead", "peak MiB"], summary)
    if results.data["mfu"]:
        r = results.data["mfu"]["rows"][0]
        log(f"MFU {results.data['mfu']['model']} bf16 {r['candidate']}: {100 * r['mfu']:.1f}% of "
            f"{args.peak_flops / 1e12:.0f} TFLOP/s")
    results.data["elapsed_s"] = time.monotonic() - t0
    results.write()
    log(f"done in {results.data['elapsed_s']:.1f}s; errors: {len(results.data['errors'])}; "
        f"skipped: {results.data['skipped'] or 'none'}" + (f"; JSON: {args.out}" if args.out else ""))
    zs.shutdown()
    failed_rows = [f"{sec['model']} {sec['dtype']} {r['candidate']}" for sec in results.data["overhead"]
                   for r in sec["rows"] if r.get("error")]
    if failed_rows:
        log(f"candidates that failed: {', '.join(failed_rows)}")
    failed = results.data["errors"] or failed_rows or (results.data["parity"] and not results.data["parity"]["ok"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""`zeroshard verify`: is the distributed run numerically the single-process run?

It trains the same model on the same data and global batch three ways:
  (a) plain single-process PyTorch (no zeroshard runtime) in this process,
  (b) the requested stage on `nproc` spawned ranks,
  (c) stage 0 (our DDP) on `nproc` ranks (reused from (b) when the stage is 0),
then compares per-step losses and the final parameters. It exits non-zero when a difference
exceeds its tolerance, so it can gate CI.

With `--tp N`, (b) and (c) are both tensor parallel (nproc/N data-parallel ranks x N), so (c) isolates
ZeRO's sharding and (a) the whole composition: (a) is still the unsplit model, and the distributed
params are compared after `zs.full_state_dict` has joined their tp parts into the model's own
layout. TP changes only the summation order of the split contractions, so fp32 keeps its 1e-5 bounds
(docs/tensor_parallel.md).

With `--ep N` (an MoE model such as tiny-moe), (b) and (c) split every MoE layer's experts over N
ranks and route tokens by all-to-all; `zs.full_state_dict` gathers the experts back over ep, so
(a) is again the unsplit model and fp32 keeps its bounds (docs/expert_parallel.md).

With lossy communication (`--comm-quant`: int8 weights and/or grads on the wire) the distributed
run is *meant* to differ from the single process by the rounding of what it sends, so verify
switches to its lossy-communication tolerances (`LOSSY_COMM_TOLERANCES`, docs/quantized_comm.md)
and runs the stage-0 reference with exact communication.

In fp32 with exact communication, when the params end over the tolerance from the fp32 process,
verify also runs that process in float64 (`zeroshard.trainer.exact`) and passes when the distributed
params are within the tolerance of it: the distributed run is then as near the exact answer as the
tolerance asks, and the excess is the fp32 reference's own rounding (AdamW turns a last-bit
difference in a grad 1e-5 of its tensor's largest into a step of the learning rate's order). The
report shows how far each fp32 run is from the float64 one (docs/tensor_parallel.md).

Dropout is off for all three runs (`dropout = false`, eval mode): its masks are drawn per rank, so a
sharded run and one process would train different functions and any difference would be
meaningless. The report says so when the model's config asks for dropout, and `--dropout`, which
would keep it on, is refused with that reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from zeroshard.cli.train import add_config_flags, check_before_launch, config_from_args, fail, one_line
from zeroshard.trainer.config import TrainConfig
from zeroshard.trainer.adapter import dropout_settings

# Short by default: verification is about agreement, not about reaching the floor. Dropout off:
# its masks are drawn per rank, so a sharded run and one process would never see the same function.
VERIFY_DEFAULTS: dict[str, Any] = {"steps": 20, "warmup": 5, "num_samples": 1024, "dropout": False}


def _params_max_diff(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, list[str]]:
    """Largest |a - b| over all parameters, plus the names that exist on one side only."""
    mismatched = sorted(set(a) ^ set(b))
    # In float64: exact for two fp32 tensors, and a float64 reference keeps its own bits.
    diffs = [float((a[k].double() - b[k].double()).abs().max()) for k in sorted(set(a) & set(b))]
    return (max(diffs) if diffs else float("inf")), mismatched


def _loss_diffs(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b, strict=True)]


def compare(cfg: TrainConfig, ref: dict, dist: dict, stage0: dict, *, tol: float, loss_tol: float,
            exact: dict | None = None) -> dict:
    """``exact``: the float64 reference (``float64_reference``), when the fp32 one was over ``tol``;
    the params then pass when within ``tol`` of it."""
    p_single, miss_single = _params_max_diff(dist["params"], ref["params"])
    p_stage0, miss_stage0 = _params_max_diff(dist["params"], stage0["params"])
    loss_diffs = _loss_diffs(dist["losses"], ref["losses"])
    missing = sorted(set(miss_single) | set(miss_stage0))
    result: dict[str, Any] = {
        "model": cfg.model, "stage": cfg.stage, "nproc": cfg.nproc, "tp": cfg.tp, "ep": cfg.ep, "steps": cfg.steps,
        **({"pp": cfg.pp, "pp_schedule": cfg.pp_schedule, "pp_grad_reduce": cfg.engine.pp_grad_reduce}
           if cfg.pp > 1 else {}),
        "global_batch": cfg.batch, "seq_len": cfg.seq_len, "mp": cfg.mp, "accum": cfg.accum,
        "tol": tol, "loss_tol": loss_tol, "comm_quant": cfg.comm_quant,
        "tolerance_mode": "lossy communication" if cfg.comm_quant != "none" else
        "bf16 orthogonalisation (Muon)" if uses_muon(cfg.optimizer) and cfg.mp == "fp32" else "exact communication",
        "max_abs_param_diff_vs_single": p_single,
        "max_abs_loss_diff_vs_single": max(loss_diffs),
        "max_abs_param_diff_vs_stage0": p_stage0,
        "loss_diff_per_step": loss_diffs,
        "losses": {"single": ref["losses"], "distributed": dist["losses"], "stage0": stage0["losses"]},
        "mismatched_param_names": missing,
        "dropout": {"on": cfg.dropout, "model_asks": dropout_settings(cfg.model)},
    }
    params_ok = p_single <= tol
    if exact is not None:
        p_exact = _params_max_diff(dist["params"], exact["params"])[0]
        result["max_abs_param_diff_vs_float64"] = p_exact
        result["max_abs_param_diff_single_vs_float64"] = _params_max_diff(ref["params"], exact["params"])[0]
        params_ok = params_ok or p_exact <= tol
    result["passed"] = bool(
        not missing and params_ok and p_stage0 <= tol and result["max_abs_loss_diff_vs_single"] <= loss_tol
    )
    return result


def wants_float64_reference(cfg: TrainConfig, result: dict, tol: float) -> bool:
    """The params alone are over ``tol`` in fp32 with exact communication (not Muon's bf16): the case
    where the fp32 reference's own rounding may be the excess, which a float64 run settles."""
    exact_comm = cfg.comm_quant == "none" and not uses_muon(cfg.optimizer)
    return (cfg.mp == "fp32" and exact_comm and not result["passed"] and not result["mismatched_param_names"]
            and result["max_abs_param_diff_vs_single"] > tol and result["max_abs_param_diff_vs_stage0"] <= tol
            and result["max_abs_loss_diff_vs_single"] <= result["loss_tol"])


def print_report(result: dict, console: Console) -> None:
    tp = result.get("tp", 1)
    where = f"{result['nproc']} ranks" + (f" ({result['nproc'] // tp} data-parallel x tp {tp})" if tp > 1 else "")
    ep = result.get("ep", 1)
    where += f" (experts split over ep {ep}, each sharded over {result['nproc'] // ep})" if ep > 1 else ""
    if result.get("pp", 1) > 1:
        where += f" (pp {result['pp']}, {result['pp_schedule']})"
    steps = Table(title=f"zeroshard verify: stage {result['stage']} on {where} vs single process")
    for col in ("step", "loss (single)", f"loss (stage {result['stage']})", "|diff|"):
        steps.add_column(col, justify="right")
    losses = result["losses"]
    for i, d in enumerate(result["loss_diff_per_step"]):
        steps.add_row(str(i + 1), f"{losses['single'][i]:.6f}", f"{losses['distributed'][i]:.6f}", f"{d:.2e}")
    console.print(steps)
    final = Table(show_header=True)
    final.add_column("check")
    final.add_column("max |diff|", justify="right")
    final.add_column("tolerance", justify="right")
    final.add_row("params vs single process", f"{result['max_abs_param_diff_vs_single']:.3e}", f"{result['tol']:.0e}")
    final.add_row("params vs stage 0", f"{result['max_abs_param_diff_vs_stage0']:.3e}", f"{result['tol']:.0e}")
    final.add_row("loss vs single process", f"{result['max_abs_loss_diff_vs_single']:.3e}", f"{result['loss_tol']:.0e}")
    if "max_abs_param_diff_vs_float64" in result:
        final.add_row("params vs single process in float64", f"{result['max_abs_param_diff_vs_float64']:.3e}",
                      f"{result['tol']:.0e}")
    console.print(final)
    if "max_abs_param_diff_vs_float64" in result:
        console.print(f"params over the tolerance from the fp32 process: both runs against the same process in "
                      f"float64, the fp32 process {result['max_abs_param_diff_single_vs_float64']:.3e}, this run "
                      f"{result['max_abs_param_diff_vs_float64']:.3e} (within the tolerance of it passes)")
    if result.get("comm_quant", "none") != "none":
        console.print(f"tolerance mode: lossy communication (comm_quant={result['comm_quant']}); the "
                      "distributed run rounds what it sends to int8 (docs/quantized_comm.md)")
    asks = result.get("dropout", {}).get("model_asks")
    if asks:
        console.print(f"dropout: off for both runs (the model asks for {', '.join(f'{k}={v:g}' for k, v in asks.items())}; "
                      "masks drawn on a sharded run and on one process differ, so both run in eval mode)")
    if result["mismatched_param_names"]:
        console.print(f"[red]parameter names differ between runs: {result['mismatched_param_names']}")
    console.print("[bold green]PASSED" if result["passed"] else "[bold red]FAILED: a tolerance was exceeded")


LOSSY_COMM_TOLERANCES = (5e-2, 5e-2)
"""(param, loss) with quantized communication. int8 with one scale per block rounds each value sent
by up to half a step (absmax/254 of its block), and training compounds it: on tiny over 20 steps the
measured worst loss difference is 7.4e-3 and the worst param difference 1.2e-2 (qwZ+qgZ, block
256). These bounds leave about 4x margin and still catch a broken path (a wrong scale or piece
moves the loss by tenths at the first step)."""


BF16_ORTHOGONALISATION_TOLERANCES = (5e-3, 1e-4)
"""torch's Muon orthogonalises each update in bf16, so a grad that differs from one process's in its
last fp32 bit (any reduction's summation order) can move an update by a bf16 ulp: the param bound
for ``--optimizer muon`` in fp32 (stages 1-3 against our stage 0 stay exact all the same)."""


def uses_muon(optimizer: object) -> bool:
    name = optimizer.get("name") if isinstance(optimizer, dict) else optimizer
    return isinstance(name, str) and name.strip().lower() == "muon"


def default_tolerances(mp: str, comm_quant: str = "none", optimizer: object = "adamw") -> tuple[float, float]:
    """(param, loss) tolerances against the fp32 single process.

    In fp32 only summation order differs, so 1e-5 holds. With bf16/fp16 compute the run is
    *meant* to differ from fp32 by the rounding of the compute dtype; 2e-2 is the loss bound the
    project holds mixed precision to. Stage 3 vs our stage 0 stays exact at two ranks either way.
    Quantized communication is lossier still: ``LOSSY_COMM_TOLERANCES``.
    """
    if comm_quant != "none":
        return LOSSY_COMM_TOLERANCES
    if mp == "fp32" and uses_muon(optimizer):
        return BF16_ORTHOGONALISATION_TOLERANCES
    return (1e-5, 1e-5) if mp == "fp32" else (2e-2, 2e-2)


def _distributed(cfg: TrainConfig) -> dict:
    from zeroshard.trainer.launch import spawn
    from zeroshard.trainer.train import verify_worker

    # A dead rank is detected at once; a stuck collective fails after cfg.hang_timeout_s.
    return spawn(verify_worker, cfg.nproc, args=(cfg,), timeout_s=math.inf)[0]


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args, defaults=VERIFY_DEFAULTS)
        check_before_launch(cfg)
    except ValueError as e:
        return fail("verify", str(e))
    asks = dropout_settings(cfg.model)
    if cfg.dropout and asks:
        return fail("verify", f"--dropout keeps the model's dropout ({', '.join(f'{k}={v:g}' for k, v in asks.items())}) "
                    "on, but its masks are drawn differently on a sharded run and on one process, so the comparison "
                    "would mean nothing; drop --dropout (verify turns dropout off for both runs)")
    from zeroshard.trainer.launch import WorkerError
    from zeroshard.trainer.train import reference_train

    try:
        ref = reference_train(cfg)
        dist = _distributed(cfg)
        # The stage-0 reference communicates exactly (stage 0 cannot quantize: it all-reduces), and
        # reduces once per step under a pipeline (it keeps full grads; pp_grad_reduce="microbatch" is refused there).
        stage0 = dist if cfg.stage == 0 else _distributed(cfg.replace(
            stage=0, comm_quant="none", engine=dataclasses.replace(cfg.engine, pp_grad_reduce="step")))
    except WorkerError as e:
        return fail("verify", one_line(e))
    except ValueError as e:
        return fail("verify", str(e))
    tol, loss_tol = default_tolerances(cfg.mp, cfg.comm_quant, cfg.optimizer)
    tol = args.tol if args.tol is not None else tol
    loss_tol = args.loss_tol if args.loss_tol is not None else loss_tol
    result = compare(cfg, ref, dist, stage0, tol=tol, loss_tol=loss_tol)
    if wants_float64_reference(cfg, result, tol):
        from zeroshard.trainer.exact import float64_reference

        result = compare(cfg, ref, dist, stage0, tol=tol, loss_tol=loss_tol, exact=float64_reference(cfg))
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print_report(result, Console())
    return 0 if result["passed"] else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "verify", help="compare a distributed run against single-process PyTorch",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--tol", type=float, default=None,
                   help="max abs parameter difference (default 1e-5 in fp32, 2e-2 with --mp bf16/fp16, "
                        "5e-2 with --comm-quant)")
    p.add_argument("--loss-tol", type=float, default=None,
                   help="max abs per-step loss difference (default 1e-5 in fp32, 2e-2 with --mp bf16/fp16, "
                        "5e-2 with --comm-quant)")
    add_config_flags(p, skip=("run_dir", "log_every"), defaults=VERIFY_DEFAULTS)
    p.set_defaults(run=run)

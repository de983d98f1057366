"""`zeroshard train`: build a TrainConfig from a TOML file and flags, then run it.

Locally it spawns `nproc` gloo processes on a free port; under torchrun (RANK/WORLD_SIZE set)
this process is one rank of that world and trains directly. Rank 0 draws the progress bar and
the summary; if any rank fails, the command exits non-zero with one line naming the rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zeroshard.comm import fault_points as fault_points
from zeroshard.comm.topology import placement_text
from zeroshard.observing.heal_view import summary_rows
from zeroshard.cli.typed_flags import add_typed_flag
from zeroshard.trainer.config_checks import check_runnable
from zeroshard.trainer.config import (TrainConfig, field_help, field_names, field_section, field_type, load_toml, merge_config,
                                      table_spelling)


# --------------------------------------------------------------------------- flags shared with verify


def add_config_flags(
    parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None, with_config_file: bool = True,
) -> None:
    """One flag per TrainConfig field, help text taken from the field's docstring; and --config
    unless ``with_config_file`` is False (a command that writes the TOML rather than reads one).

    Every argparse default is None so that `config_from_args` can tell "not given" from "given",
    which is what lets a flag override the TOML file; the real default is shown in the help.
    """
    if with_config_file:
        parser.add_argument("--config", metavar="FILE.toml", help="TOML file of config keys; flags override it")
    shown = {**TrainConfig().to_dict(), **(defaults or {})}
    groups: dict[str | None, Any] = {}
    for name in field_names():
        if name in skip:
            continue
        table = field_section(name)
        if table not in groups:  # one --help group per TOML table, in the config's order
            groups[table] = parser.add_argument_group(
                "run" if table is None else f"[{table}]",
                "the keys that name the run (top-level TOML keys)" if table is None else
                f"TOML table [{table}]; each flag below is a key there")
        where = "" if table is None else f"; TOML: {table_spelling(name)}"
        add_typed_flag(groups[table], name, field_type(name), f"{field_help(name)} (default: {shown[name]}{where})")


def config_from_args(
    args: argparse.Namespace, *, defaults: dict[str, Any] | None = None,
    forced: dict[str, Any] | None = None,
) -> TrainConfig:
    """Command defaults, then the --config file, then flags (flags win), then `forced`."""
    file_values = dict(defaults or {})
    if args.config is not None:
        file_values.update(load_toml(args.config))
    flags = {name: getattr(args, name, None) for name in field_names()}
    return check_runnable(merge_config(file_values, {**flags, **(forced or {})}))


def check_before_launch(cfg: TrainConfig) -> None:
    """What TrainConfig cannot check without torch, checked before any rank starts so that it is one
    line rather than every rank's failure: a pipeline the model or its schedule cannot run, a tp the
    model's plan cannot split (heads, MLP width), more local ranks than GPUs on NCCL."""
    check_runnable(cfg)
    from zeroshard.trainer.launch import running_under_torchrun

    if not running_under_torchrun():  # torchrun's ranks check their own host (zeroshard/comm/devices.py)
        from zeroshard.comm.devices import check_local_ranks, choose_backend

        check_local_ranks(choose_backend(cfg.backend), cfg.nproc)
    if cfg.tp > 1:  # a meta build of the model: nothing allocated, but torch imported
        from zeroshard.trainer.tp_setup import check_tensor_parallel

        check_tensor_parallel(cfg)
    if cfg.ep > 1:  # likewise: the model has MoE layers whose experts ep divides
        from zeroshard.trainer.ep_setup import check_expert_parallel

        check_expert_parallel(cfg)


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else repr(err)


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def fail(command: str, message: str) -> int:
    print(f"zeroshard {command}: error: {message}", file=sys.stderr, flush=True)
    return 1


# --------------------------------------------------------------------------- rank-0 reporting


def _fmt_floor(floor: float | None) -> str:
    return "unknown (text data)" if floor is None else f"{floor:.4f} nats/token"


class RichReporter:
    """Progress bar (on a terminal) plus a loss line every `log_every` steps, then a summary."""

    def __init__(self, *, log_every: int, console: Console | None = None, train: dict[str, Any] | None = None) -> None:
        self.console = console or Console()
        self.log_every = log_every
        self.train = train
        """The run's TrainConfig as a dict, for the planner's shard-group advice at start."""
        self.progress: Progress | None = None
        self.task: Any = None
        self.info: dict[str, Any] = {}
        self.window: list[float] = []  # losses since the last printed line

    def start(self, info: dict[str, Any]) -> None:
        self.info = info
        c = self.console
        c.print(
            f"[bold]zeroshard train[/]: {info['model']} ({info['params']:,} params), "
            f"stage {info['stage']}, {info['world']} ranks"
            + (f" ({info['world'] // info['tp']} data-parallel x tp {info['tp']})" if info.get("tp", 1) > 1 else "")
            + (f" (experts split over ep {info['ep']})" if info.get("ep", 1) > 1 else "")
            + (f" in {info['pp']} pipeline stages" if info.get("pp", 1) > 1 else "")
            + f" on {info['backend']}, "
            f"batch {info['global_batch']}x{info['seq_len']}"
        )
        c.print(f"entropy floor of the data: {_fmt_floor(info['entropy_floor'])}")
        c.print(f"run dir: {info['run_dir']}")
        from zeroshard.cli.placement import topology_lines

        for line in topology_lines(info, self.train):
            c.print(line, highlight=False, soft_wrap=True)  # one line each, for logs and grep
        if not c.is_terminal:
            return
        self.progress = Progress(
            TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[ms]} ms/step"), TimeElapsedColumn(), console=c,
        )
        self.task = self.progress.add_task("train", total=info["steps"], loss="-", tps="-", ms="-")
        self.progress.start()

    def step(self, rec: Any) -> None:
        if self.progress is not None:
            self.progress.update(
                self.task, advance=1, loss=f"{rec.loss:.4f}", tps=f"{rec.tokens_per_s:,.0f}",
                ms=f"{rec.step_time_s * 1e3:.0f}",
            )
        if getattr(rec, "skipped", False):
            self.console.print(f"step {rec.step:>5}/{self.info['steps']}  skipped on every rank: the loss or the grad "
                               "norm is not finite (RUN_DIR/nonfinite.json names the rank and unit)", highlight=False)
        self.window.append(rec.loss)
        if rec.step % self.log_every == 0 or rec.step == 1 or rec.step == self.info["steps"]:
            # The mean since the last line: a single batch's loss is too noisy to compare with
            # the floor (it can even dip below it).
            mean = sum(self.window) / len(self.window)
            floor = self.info["entropy_floor"]
            gap = "" if floor is None else f"  gap to floor {mean - floor:+.4f}"
            self.console.print(
                f"step {rec.step:>5}/{self.info['steps']}  loss {rec.loss:.4f}  "
                f"mean(last {len(self.window)}) {mean:.4f}{gap}  {rec.step_time_s * 1e3:3.0f} ms",
                highlight=False,
            )
            self.window.clear()
        if rec.eval is not None:
            self.console.print(f"step {rec.step:>5}/{self.info['steps']}  eval loss {rec.eval['eval_loss']:.4f}  "
                               f"perplexity {rec.eval['eval_perplexity']:.3f}  ({rec.eval['eval_tokens']:,} tokens)",
                               highlight=False)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.console.print(summary_table(summary))


def summary_table(s: dict[str, Any]) -> Table:
    table = Table(title="zeroshard train: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    floor = s["entropy_floor"]
    rows = [
        ("model", f"{s['model']} ({s['params']:,} params)"),
        ("stage", str(s["stage"])),
        ("world / backend", f"{s['world']} / {s['backend']} ({s['device']})"),
        *([("topology", placement_text(s["topology"]))] if s.get("topology") else []),
        ("steps", f"{s['steps']} x {s['global_batch']} seq x {s['seq_len']} tokens"),
        ("loss first -> final", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"),
        (f"mean loss, last {s['tail_steps']} steps", f"{s['tail_mean_loss']:.4f}"),
        ("entropy floor", _fmt_floor(floor)),
    ]
    if floor is not None:
        rows.append(("gap to floor (that mean)", f"{s['tail_mean_loss'] - floor:+.4f} nats/token"))
    rows += [
        ("tokens/s (global)", f"{s['tokens_per_s']:,.0f}"),
        ("mean step time", f"{s['mean_step_time_s'] * 1e3:.1f} ms (over {s['timed_steps']} steps)"),
        ("comm bytes/step (rank 0)", f"{s['comm_bytes_per_step']:,.0f}"),
        ("peak RSS (max over ranks)", f"{s['peak_rss_mb']:,.0f} MB"),
        ("grad accumulation", f"{s['accum']} micro-steps/step"),
    ]
    p = s["precision"]
    rows += [
        ("compute / all-gather dtype", f"{p['param_compute_dtype']} / {p['all_gather_dtype'] or '-'}"),
        ("reduce / master / optim state", f"{p['reduce_dtype']} / {p['master_dtype']} / "
                                           f"{', '.join(p['optimizer_state_dtypes'] or ['-'])}"),
        ("grad accumulation dtype", f"{p['grad_accumulation_dtype']} ({p['grad_accumulation']})"),
        *([("weight all-gather wire", f"{p['weight_wire_dtype']} + {p['weight_wire_scale_dtype']} scale per "
                                      f"{p['weight_wire_block_size']} elements "
                                      f"({p['weight_wire_quantized_groups']} groups)")]
          if p.get("weight_wire_dtype") else []),
        *([("grad reduce wire", f"{p['grad_wire_dtype']} pieces via all-to-all, block {p['grad_wire_block_size']} "
                                f"({p['grad_wire_quantized_groups']} groups)"
                                + (f", error feedback {p['grad_error_feedback_bytes'] / 2**20:.1f} MiB/rank"
                                   if p.get("grad_error_feedback") else ""))]
          if p.get("grad_wire_dtype") else []),
        *([("int8 codec", p["wire_codec"])] if p.get("wire_codec") else []),
        ("units", f"{len(p['units'])}"),
        ("init path", s["init_path"]),
    ]
    if s["skipped_steps"]:
        rows.append(("steps skipped (fp16 overflow)", str(s["skipped_steps"])))
    rows += summary_rows(s)  # skipped steps, rollbacks, replica changes
    if s.get("profile"):
        from zeroshard.observing.profile.render import profile_rows

        rows += profile_rows(s["profile"])
    rows.append(("run dir", str(s["run_dir"])))
    for what, value in rows:
        table.add_row(what, value)
    return table


# --------------------------------------------------------------------------- command


def _rank_main(cfg: TrainConfig) -> dict[str, Any]:
    """Spawn target (module level so it pickles): one rank of a local run."""
    from zeroshard.trainer.train import train_worker

    return train_worker(cfg, RichReporter(log_every=cfg.log_every, train=cfg.to_dict()))


def run(args: argparse.Namespace) -> int:
    from zeroshard.trainer.launch import WorkerError, running_under_torchrun, spawn

    under_torchrun = running_under_torchrun()
    # Under torchrun the world size is torchrun's, whatever --nproc or the file says.
    forced = {"nproc": int(os.environ["WORLD_SIZE"])} if under_torchrun else {}
    try:
        cfg = config_from_args(args, forced=forced)
        fault_points.configure()  # a malformed ZEROSHARD_*FAULT variable is a one-line error before launch
        from zeroshard.observing.loggers import check_installed, parse_log

        check_installed(parse_log(cfg.log))  # a logger's missing package, before any rank starts
        check_before_launch(cfg)
    except ValueError as e:
        return fail("train", str(e))
    if cfg.data.path is not None or cfg.eval.data is not None:
        from zeroshard.trainer.data import check_data_path, data_tokenizer

        try:  # before any rank starts or the run dir is made: a bad token folder or record file writes nothing
            for path in (cfg.data.path, cfg.eval.data):
                check_data_path(path, cfg.seq_len, data_tokenizer(cfg.model, cfg.data.tokenizer))
        except ValueError as e:
            return fail("train", str(e))
    if under_torchrun:
        try:
            _rank_main(cfg)
        except Exception as e:  # noqa: BLE001 - one line naming this rank, then a non-zero exit
            from zeroshard.cli.placement import failure_text

            fail("train", f"rank {rank_from_env()} failed: {failure_text(e, cfg.to_dict())}")
            sys.stdout.flush()
            # Skip interpreter teardown: destroying a process group that peers still wait on can
            # block, and torchrun stops the peers once this process is gone.
            os._exit(1)
        return 0
    try:
        # No wall-clock limit on the job: a dead rank is detected at once by the launcher and a
        # stuck collective fails after cfg.hang_timeout_s (the process-group timeout).
        spawn(_rank_main, cfg.nproc, args=(cfg,), timeout_s=math.inf)
    except WorkerError as e:
        message = one_line(e)
        if cfg.run_dir and "zeroshard doctor" not in message:
            message += f"; every rank's collective ledger is in {cfg.run_dir}/ledger: run `zeroshard doctor {cfg.run_dir}`"
        return fail("train", message)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train", help="train a GPT on N local gloo ranks (or under torchrun)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_flags(p)
    p.set_defaults(run=run)

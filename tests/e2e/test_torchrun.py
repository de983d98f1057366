"""`zeroshard train` launched the way clusters launch it: by torchrun.

- Elastic restart: `torchrun --max-restarts 1` with `--save-every K --resume auto`; one rank is
  SIGKILLed mid-training, torchrun restarts the group, the group resumes from the newest verified
  checkpoint and ends bitwise equal to an uninterrupted run.
- Two hosts on one machine: two network namespaces joined by a veth pair (scripts/two_hosts.sh),
  each with a hostname of its own and running `torchrun --nnodes 2 --nproc-per-node 2` with static
  rendezvous, training with hybrid sharding (shard inside a host, replicate across hosts). It must
  match a 4-process single-host run, and report the topology: 2 hosts x 2 ranks, shard inside a host,
  replicate across, and the straggler's host. With one rank per host, tp 2 spans the hosts and is
  refused, naming the override.

Final params are compared through the last checkpoint (`--steps` is a multiple of `--save-every`):
its export holds every param, and its rank files hold the masters and the optimizer state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_cli import FAST, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from chaos import bitwise, clean_env, final_state, torchrun, worker_pid  # noqa: E402 - bench/ is a folder of scripts


ROOT = Path(__file__).resolve().parents[2]
TWO_HOSTS = ROOT / "scripts" / "two_hosts.sh"
TIMEOUT_S = 180
TRAIN = ["-m", "zeroshard.cli.main", "train", *FAST, "--warmup", "2", "--lr", "3e-3", "--stage", "3"]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# --------------------------------------------------------------------------- elastic restart

STEPS, SAVE_EVERY, KILL_AFTER = 60, 10, 15


def _logged_steps(run_dir: Path) -> int:
    try:
        # Step records only (the header line has no step); the last line may still be half written.
        return sum(line.startswith('{"step"') for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _elastic(tmp: Path, name: str, *, kill: bool) -> tuple[subprocess.CompletedProcess[str], int | None]:
    ckpt, run_dir = tmp / f"{name}-ck", tmp / f"{name}-run"
    cmd = [*torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
           *TRAIN, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--ckpt-dir", str(ckpt),
           "--resume", "auto", "--run-dir", str(run_dir), "--log-every", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
                            cwd=tmp, start_new_session=True)
    killed_at = None
    try:
        if kill:
            deadline = time.monotonic() + TIMEOUT_S
            while _logged_steps(run_dir) < KILL_AFTER and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            victim = worker_pid(proc.pid, rank=1, attempt=0)
            assert victim is not None, "rank 1 of the first attempt was not found under torchrun"
            os.kill(victim, signal.SIGKILL)
            killed_at = _logged_steps(run_dir)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: torchrun and its workers
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, ""), killed_at


def test_elastic_restart_after_sigkill_resumes_and_matches_uninterrupted_run(tmp_path: Path) -> None:
    plain, _ = _elastic(tmp_path, "plain", kill=False)
    assert plain.returncode == 0, plain.stdout[-4000:]
    killed, killed_at = _elastic(tmp_path, "killed", kill=True)
    assert killed.returncode == 0, killed.stdout[-4000:]
    assert killed_at is not None and killed_at < STEPS, f"the kill came too late (step {killed_at})"

    resumed = re.search(r"resumed from (\S+) at step (\d+)", killed.stdout)
    assert resumed, "the restarted group did not resume from a checkpoint:\n" + killed.stdout[-4000:]
    resumed_step = int(resumed.group(2))
    # The newest checkpoint that verified when the group restarted: a save may have been in flight.
    assert resumed_step % SAVE_EVERY == 0 and resumed_step <= killed_at + 1, (resumed_step, killed_at)
    assert resumed_step >= (killed_at // SAVE_EVERY - 1) * SAVE_EVERY, (resumed_step, killed_at)

    params_a, files_a = final_state(tmp_path / "plain-ck", tmp_path)
    params_b, files_b = final_state(tmp_path / "killed-ck", tmp_path)
    diff = max_diff(params_a, params_b)
    print(f"elastic: rank 1 SIGKILLed after step {killed_at} was logged; resumed from step {resumed_step}; "
          f"max |param - uninterrupted| = {diff:.3e}; masters + optimizer state bitwise: {bitwise(files_a, files_b)}")
    assert bitwise(params_a, params_b), f"params differ from the uninterrupted run by up to {diff:.3e}"
    assert bitwise(files_a, files_b), "masters or optimizer state differ from the uninterrupted run"


# --------------------------------------------------------------------------- two hosts


def _two_hosts_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = subprocess.run(["bash", str(TWO_HOSTS), "check"], capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip() or "scripts/two_hosts.sh check failed"


HOSTS_STEPS = 8
HYBRID = ["--steps", str(HOSTS_STEPS), "--save-every", str(HOSTS_STEPS), "--shard-size", "2"]


def _run_two_hosts(tmp: Path, name: str, train: list[str], *, nproc_per_node: int = 2,
                   expect_ok: bool = True) -> tuple[list[str], dict[str, int], dict[str, str]]:
    """(each host's output, host 0's veth byte counts, the namespaces' names and addresses)."""
    setup = subprocess.run(["bash", str(TWO_HOSTS), "setup", name], capture_output=True, text=True, check=True)
    net = dict(line.split("=", 1) for line in setup.stdout.split())
    procs = []
    try:
        for host in (0, 1):
            cmd = ["bash", str(TWO_HOSTS), "exec", name, str(host), *torchrun(), "--nnodes", "2",
                   "--nproc-per-node", str(nproc_per_node), "--node-rank", str(host), "--rdzv-backend", "static",
                   "--master-addr", net["ADDR0"], "--master-port", "29500", *train,
                   "--run-dir", str(tmp / f"hosts-run{host}")]
            # A wide console: the summary table's rows stay one line each.
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=clean_env(COLUMNS="240"), cwd=tmp))
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        link = subprocess.run(["ip", "-n", net["NS0"], "-s", "-j", "link", "show", net["IF0"]],
                              capture_output=True, text=True, check=True).stdout
        stats = {k: int(v) for k, v in re.findall(r'"(tx|rx)":\{"bytes":(\d+)', link)}
        for host, (p, out) in enumerate(zip(procs, outs)):
            assert (p.returncode == 0) == expect_ok, f"host {host} exited {p.returncode}:\n{out[-4000:]}"
        return outs, stats, net
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["bash", str(TWO_HOSTS), "teardown", name], capture_output=True, text=True)


def test_two_hosts_hybrid_sharding_matches_one_host(tmp_path: Path) -> None:
    reason = _two_hosts_unavailable()
    if reason:
        pytest.skip(f"two-host torchrun test: {reason}")
    name = f"zs{os.getpid() % 100000}"
    outs, traffic, net = _run_two_hosts(tmp_path, name, [*TRAIN, *HYBRID, "--ckpt-dir", str(tmp_path / "hosts-ck")])
    assert "4 ranks on gloo" in outs[0], outs[0][-2000:]
    # Each namespace is a host of its own name: shard 2 stays inside each, replicate 2 crosses.
    topology = re.search(r"topology: (.*)", outs[0])
    assert topology and topology.group(1) == "2 hosts x 2 ranks; inside a host: shard; across hosts: replicate"
    summary = json.loads((tmp_path / "hosts-run0" / "summary.json").read_text())["topology"]
    assert summary["rank_hosts"] == [net["NS0"]] * 2 + [net["NS1"]] * 2
    assert [summary["facts"][net[f"NS{h}"]]["interface"] for h in (0, 1)] == [net["IF0"], net["IF1"]]
    assert [summary["facts"][net[f"NS{h}"]]["address"] for h in (0, 1)] == [net["ADDR0"], net["ADDR1"]]
    straggler = re.search(r"straggler\W+rank (\d) on host (\S+)", outs[0])
    assert straggler, outs[0][-3000:]
    assert straggler.group(2) == summary["rank_hosts"][int(straggler.group(1))]
    print(f"two hosts: {topology.group(0)}; straggler rank {straggler.group(1)} on host {straggler.group(2)}")

    local = run_cli(["train", *TRAIN[3:], *HYBRID, "--nproc", "4", "--ckpt-dir", str(tmp_path / "local-ck"),
                     "--run-dir", str(tmp_path / "local-run")], timeout=TIMEOUT_S)
    assert local.returncode == 0, local.stdout + local.stderr
    params_a, files_a = final_state(tmp_path / "hosts-ck", tmp_path)
    params_b, files_b = final_state(tmp_path / "local-ck", tmp_path)
    diff = max_diff(params_a, params_b)
    print(f"two hosts (2 x torchrun --nproc-per-node 2, shard 2 x replicate 2, stage 3, {HOSTS_STEPS} steps): "
          f"max |param - 4-process single host| = {diff:.3e}, bitwise {bitwise(params_a, params_b)}; "
          f"veth traffic host 0: tx {traffic.get('tx', 0):,} B, rx {traffic.get('rx', 0):,} B")
    assert diff <= 1e-5
    assert bitwise(params_a, params_b) and bitwise(files_a, files_b)
    # The replicate all-reduce crossed the veth: at least one fp32 copy of the host's shard each step.
    assert traffic.get("tx", 0) > HOSTS_STEPS * 4 * 200_000 / 2


def test_two_hosts_tp_across_the_hosts_is_refused_naming_the_override(tmp_path: Path) -> None:
    reason = _two_hosts_unavailable()
    if reason:
        pytest.skip(f"two-host torchrun test: {reason}")
    # One rank per host: the two ranks of tp 2 are on different hosts.
    outs, _, net = _run_two_hosts(tmp_path, f"zt{os.getpid() % 100000}", [*TRAIN[:-2], "--stage", "0", "--tp", "2"],
                                  nproc_per_node=1, expect_ok=False)
    refusal = re.search(r"zeroshard train: error: rank 0 failed: (CrossHostError: .*)", outs[0])
    assert refusal, outs[0][-3000:]
    print(f"two hosts x 1 rank, tp 2: {refusal.group(1)}")
    assert f"tp group of ranks 0,1 is on {net['NS0']}, {net['NS1']}" in refusal.group(1)
    assert "--allow-cross-host" in refusal.group(1) and "TOML allow_cross_host = true" in refusal.group(1)
    assert "modelled cost: tp's collectives move" in refusal.group(1)

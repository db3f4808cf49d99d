"""examples/train.py run as a plain process, without Slurm: the SLURM_* variables it
reads are set by hand, steps take no time, and the checkpoint dir is a tmp dir.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TRAIN_PY = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def slurm_env(restart: int | None = None, rank: int = 0, ntasks: int = 1) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_NODEID=str(rank),
               SLURMD_NODENAME=f"node{rank + 1}", SLURM_JOB_ID="4242")
    if restart is not None:
        env["SLURM_RESTART_COUNT"] = str(restart)
    return env


def train(ckpt: Path, *args: str, restart: int | None = None, rank: int = 0,
          ntasks: int = 1) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(TRAIN_PY), "--ckpt-dir", str(ckpt),
            "--step-time", "0", *args]
    return subprocess.run(argv, env=slurm_env(restart, rank, ntasks), capture_output=True,
                          text=True, timeout=60)


def steps_logged(stdout: str) -> list[int]:
    return [int(m) for m in re.findall(r" step (\d+)/\d+ loss ", stdout)]


def test_fresh_run_writes_checkpoints_and_finishes(tmp_path):
    ckpt = tmp_path / "ckpt"  # created by the script
    run = train(ckpt, "--steps", "25", "--ckpt-every", "10", "--log-every", "5")

    assert run.returncode == 0, run.stderr
    assert "starting fresh" in run.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "step-000010.json", "step-000020.json", "step-000025.json"]  # no temp files left
    state = json.loads((ckpt / "step-000020.json").read_text())
    assert state["step"] == 20 and state["job_id"] == "4242" and state["restart"] == 0
    assert f"checkpoint saved: {ckpt / 'step-000020.json'} step=20" in run.stdout
    assert steps_logged(run.stdout) == [5, 10, 15, 20, 25]
    assert re.search(r"^\[\d{4}-\d\d-\d\dT[\d:.]+Z\] rank 0/1 node1 step 5/25 loss \d+\.\d{4} "
                     r"\(restart 0\)$", run.stdout, re.M)
    assert run.stdout.rstrip().splitlines()[-1].endswith(
        "training finished at step 25 (last checkpoint step=25)")


def test_restart_resumes_from_the_newest_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for step in (10, 30, 20):
        (ckpt / f"step-{step:06d}.json").write_text(json.dumps({"step": step}))
    (ckpt / ".step-000040.json.99.tmp").write_text('{"step": 4')  # a writer that died

    run = train(ckpt, "--steps", "50", "--ckpt-every", "10", "--log-every", "10", restart=1)

    assert run.returncode == 0, run.stderr
    newest = ckpt / "step-000030.json"
    assert f"resuming from checkpoint {newest} at step 30 (restart 1)" in run.stdout
    assert "starting fresh" not in run.stdout
    assert steps_logged(run.stdout) == [40, 50]  # steps 1..30 are not redone
    assert "step 50/50 loss" in run.stdout and run.stdout.count("(restart 1)") >= 3
    assert json.loads((ckpt / "step-000050.json").read_text())["restart"] == 1
    assert "training finished at step 50" in run.stdout


def test_unreadable_newest_checkpoint_falls_back_to_an_older_one(tmp_path):
    (tmp_path / "step-000010.json").write_text(json.dumps({"step": 10}))
    (tmp_path / "step-000020.json").write_text("{not json")

    run = train(tmp_path, "--steps", "20", "--log-every", "5")

    assert run.returncode == 0, run.stderr
    assert f"resuming from checkpoint {tmp_path / 'step-000010.json'} at step 10" in run.stdout
    assert steps_logged(run.stdout) == [15, 20]


def test_only_rank_zero_writes_checkpoints(tmp_path):
    run = train(tmp_path, "--steps", "20", "--ckpt-every", "10", rank=1, ntasks=2)

    assert run.returncode == 0, run.stderr
    assert "rank 1/2 node2 step 20/20" in run.stdout
    assert list(tmp_path.iterdir()) == []
    assert "checkpoint saved" not in run.stdout


def test_fail_at_step_crashes_the_first_attempt_only(tmp_path):
    args = ("--steps", "40", "--ckpt-every", "10", "--fail-at-step", "25", "--fail-rank", "0")

    first = train(tmp_path, *args)  # SLURM_RESTART_COUNT unset: the first attempt
    assert first.returncode == 1
    assert "RuntimeError: simulated crash on rank 0 at step 25" in first.stderr
    assert "training finished" not in first.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010.json", "step-000020.json"]

    also_first = train(tmp_path / "other", *args, restart=0)
    assert also_first.returncode == 1

    second = train(tmp_path, *args, restart=1)
    assert second.returncode == 0, second.stderr
    assert "resuming from checkpoint" in second.stdout and "at step 20 (restart 1)" in second.stdout
    assert "training finished at step 40" in second.stdout


def test_fail_rank_spares_the_other_ranks(tmp_path):
    run = train(tmp_path, "--steps", "30", "--fail-at-step", "5", "--fail-rank", "1")

    assert run.returncode == 0, run.stderr
    assert "training finished at step 30" in run.stdout


def test_sigterm_exits_143_with_a_message(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--ckpt-dir", str(tmp_path), "--steps", "10000",
         "--step-time", "0.01"],
        env=slurm_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "starting fresh" in proc.stdout.readline() + proc.stdout.readline()
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "rank 0/1 node1 received SIGTERM" in out


def running(ckpt: Path, *args: str, rank: int = 0, ntasks: int = 1,
            env: dict | None = None) -> subprocess.Popen:
    """A long run (steps of 10 ms, no periodic checkpoint before step 10000)."""
    return subprocess.Popen(
        [sys.executable, str(TRAIN_PY), "--ckpt-dir", str(ckpt), "--steps", "10000",
         "--step-time", "0.01", "--ckpt-every", "10000", "--log-every", "100000", *args],
        env={**slurm_env(rank=rank, ntasks=ntasks), **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def lines_until(proc: subprocess.Popen, text: str, limit: int = 20) -> list[str]:
    seen = []
    for _ in range(limit):
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no {text!r} in {seen!r}")


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("signame, args, env", [
    ("USR1", (), {}),                                     # the default
    ("USR2", ("--ckpt-signal", "SIGUSR2"), {}),           # by option, SIG prefix taken
    ("USR2", (), {"TRAIN_CKPT_SIGNAL": "usr2"}),          # by the environment
], ids=["default-usr1", "option-usr2", "env-usr2"])
def test_the_checkpoint_signal_saves_at_the_next_step_and_training_goes_on(
        tmp_path, signame, args, env):
    proc = running(tmp_path, *args, env=env)
    try:
        lines_until(proc, "starting fresh")
        time.sleep(0.3)
        proc.send_signal(getattr(signal, f"SIG{signame}"))
        asked = lines_until(proc, "asks for a checkpoint")[-1]
        saved = proc.stdout.readline()
    finally:
        out, err = stop(proc)
    step = int(re.search(r" step (\d+): SIG" + signame + r" asks for a checkpoint now$",
                         asked).group(1))
    assert 0 < step < 10000
    path = tmp_path / f"step-{step:06d}.json"
    assert saved.rstrip().endswith(f"checkpoint saved: {path} step={step}")
    assert json.loads(path.read_text())["step"] == step
    assert [p.name for p in tmp_path.iterdir()] == [path.name]   # one save, no temp file
    assert proc.returncode == 143, err                            # it trained on until TERM
    assert "received SIGTERM" in out


def test_a_second_signal_saves_again_and_a_resume_starts_there(tmp_path):
    proc = running(tmp_path)
    try:
        lines_until(proc, "starting fresh")
        steps = []
        for _ in range(2):
            time.sleep(0.2)
            proc.send_signal(signal.SIGUSR1)
            lines_until(proc, "asks for a checkpoint")
            steps.append(int(re.search(r"step=(\d+)", proc.stdout.readline()).group(1)))
    finally:
        stop(proc)
    assert steps[0] < steps[1]
    again = train(tmp_path, "--steps", str(steps[1] + 5), restart=1)
    assert f"at step {steps[1]} (restart 1)" in again.stdout


def test_the_signal_on_another_rank_saves_nothing(tmp_path):
    proc = running(tmp_path, rank=1, ntasks=2)
    try:
        lines_until(proc, "starting fresh")
        time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        asked = lines_until(proc, "asks for a checkpoint")[-1]
        time.sleep(0.2)
    finally:
        out, _ = stop(proc)
    assert asked.rstrip().endswith("asks for a checkpoint (rank 0 saves it)")
    assert list(tmp_path.iterdir()) == []
    assert "checkpoint saved" not in out


def test_ckpt_signal_none_installs_no_handler(tmp_path):
    """No convention: USR1 keeps its default action (the process ends), as for
    any program that never asked for it."""
    proc = running(tmp_path, "--ckpt-signal", "none")
    try:
        lines_until(proc, "starting fresh")
        proc.send_signal(signal.SIGUSR1)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGUSR1
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_checkpoint_signal_is_refused(tmp_path):
    run = train(tmp_path, "--ckpt-signal", "HUP")

    assert run.returncode == 2
    assert "USR1, USR2, none" in run.stderr


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--ckpt-every", "0"], ["--step-time", "-1"]])
def test_bad_flags_are_refused(tmp_path, bad):
    run = train(tmp_path, *bad)

    assert run.returncode == 2
    assert "must" in run.stderr


def test_help_explains_flags_and_environment():
    run = subprocess.run([sys.executable, str(TRAIN_PY), "--help"], capture_output=True,
                         text=True, timeout=30)

    assert run.returncode == 0
    for word in ("--ckpt-dir", "--fail-at-step", "--ckpt-signal", "SLURM_RESTART_COUNT",
                 "TRAIN_CKPT_SIGNAL", "exit status"):
        assert word in run.stdout

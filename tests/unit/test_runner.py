"""The argv seam: no shell, a timeout, and errors that carry argv/rc/stderr."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from recovery_agent.errors import SchedulerError
from recovery_agent.scheduler.runner import SlurmRunner


def fake_command(bin_dir: Path, name: str, body: str) -> Path:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_runs_argv_without_a_shell(tmp_path):
    fake_command(tmp_path, "squeue", 'printf "%s|" "$@"')
    runner = SlurmRunner(bin_dir=str(tmp_path))
    out = runner.run(["squeue", "--json", "a b; rm -rf /", "$(id)"]).stdout
    # each argument arrives whole and unexpanded: nothing was interpreted by a shell
    assert out == "--json|a b; rm -rf /|$(id)|"
    assert runner.calls == {"squeue": 1}


def test_refuses_a_string(tmp_path):
    with pytest.raises(TypeError):
        SlurmRunner(bin_dir=str(tmp_path)).run("squeue --json")


def test_timeout_becomes_scheduler_error(tmp_path):
    fake_command(tmp_path, "scontrol", "echo starting >&2; exec sleep 30")
    runner = SlurmRunner(bin_dir=str(tmp_path), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(SchedulerError) as info:
        runner.run(["scontrol", "ping"])
    assert time.monotonic() - started < 10
    assert info.value.returncode is None
    assert info.value.argv == ["scontrol", "ping"]
    assert "timed out" in str(info.value)


def test_nonzero_exit_carries_rc_and_stderr(tmp_path):
    fake_command(tmp_path, "scontrol", "echo 'scontrol: error: Invalid job id specified' >&2; exit 1")
    with pytest.raises(SchedulerError) as info:
        SlurmRunner(bin_dir=str(tmp_path)).run(["scontrol", "requeuehold", "42"])
    err = info.value
    assert err.returncode == 1 and err.argv == ["scontrol", "requeuehold", "42"]
    assert "Invalid job id" in err.stderr and "Invalid job id" in str(err)


def test_check_false_returns_the_failure(tmp_path):
    fake_command(tmp_path, "sinfo", "exit 3")
    proc = SlurmRunner(bin_dir=str(tmp_path)).run(["sinfo"], check=False)
    assert proc.returncode == 3


def test_missing_command(tmp_path):
    with pytest.raises(SchedulerError) as info:
        SlurmRunner(bin_dir=str(tmp_path)).run(["squeue"])
    assert info.value.returncode == 127 and "not found" in str(info.value)


def test_slurm_conf_reaches_the_child(tmp_path):
    fake_command(tmp_path, "sinfo", 'echo "$SLURM_CONF"')
    runner = SlurmRunner(bin_dir=str(tmp_path), slurm_conf="/tmp/x/slurm.conf")
    assert runner.run(["sinfo"]).stdout.strip() == "/tmp/x/slurm.conf"
    assert os.environ.get("SLURM_CONF") != "/tmp/x/slurm.conf"  # ours is untouched


def test_binary_mode_keeps_stdout_as_bytes_and_stderr_as_text(tmp_path):
    fake_command(tmp_path, "squeue", "printf '{\\n}\\377'; echo 'warn: x' >&2")
    runner = SlurmRunner(bin_dir=str(tmp_path))
    proc = runner.run(["squeue", "--json"], binary=True)
    assert isinstance(proc.stdout, bytes) and proc.stdout.endswith(b"\xff")
    assert proc.stderr == "warn: x\n"
    # a failing binary-mode command still carries its stderr as text
    fake_command(tmp_path, "sinfo", "echo 'sinfo: error: down' >&2; exit 1")
    with pytest.raises(SchedulerError) as info:
        runner.run(["sinfo", "--json"], binary=True)
    assert "down" in info.value.stderr

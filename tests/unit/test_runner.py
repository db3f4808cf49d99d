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


# -- SSH mode ---------------------------------------------------------------

def ssh_runner(tmp_path, **kw) -> SlurmRunner:
    """A runner in SSH mode whose ``ssh`` is a stand-in: it records its argv and
    runs the remote command string with a shell, as sshd would."""
    bin_dir = tmp_path / "sshbin"
    bin_dir.mkdir(exist_ok=True)
    fake_command(bin_dir, "ssh", f'printf "%s\\n" "$@" > {tmp_path}/ssh-argv\n'
                                 'for last; do :; done\nexec sh -c "$last"')
    return SlurmRunner(ssh_host="slurm@login1", ssh_options=("-p", "2222"),
                       extra_env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}, **kw)


def test_ssh_mode_quotes_every_argument_for_the_remote_shell(tmp_path):
    remote_bin = tmp_path / "remote"
    remote_bin.mkdir()
    fake_command(remote_bin, "scontrol", 'printf "%s|" "$@"; printf "%s" "$SLURM_CONF"')
    runner = ssh_runner(tmp_path, bin_dir=str(remote_bin), slurm_conf="/etc/slurm/x y.conf")
    out = runner.run(["scontrol", "update", "jobid=7", "Name=a b; rm -rf / $(id) `id`"]).stdout
    assert out == "update|jobid=7|Name=a b; rm -rf / $(id) `id`|/etc/slurm/x y.conf"
    argv = (tmp_path / "ssh-argv").read_text().splitlines()
    assert argv[:3] == ["-T", "-o", "BatchMode=yes"]
    assert "-p" in argv and "2222" in argv
    assert argv[-3:-1] == ["--", "slurm@login1"]          # the host can never be an option
    assert runner.calls == {"scontrol": 1}


def test_ssh_failure_is_a_scheduler_error_naming_the_host(tmp_path):
    runner = ssh_runner(tmp_path)
    fake_command(tmp_path / "sshbin", "ssh", "echo 'ssh: connect to host login1 port 22: "
                                              "Connection refused' >&2; exit 255")
    with pytest.raises(SchedulerError) as info:
        runner.run(["squeue", "--json"], binary=True)
    assert "ssh to slurm@login1 failed" in str(info.value) and "refused" in str(info.value)
    assert info.value.returncode == 255


def test_ssh_mode_times_out_like_a_local_command(tmp_path):
    runner = ssh_runner(tmp_path, timeout=0.5)
    fake_command(tmp_path / "sshbin", "ssh", "exec sleep 30")
    started = time.monotonic()
    with pytest.raises(SchedulerError, match="timed out"):
        runner.run(["sinfo", "--json"])
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("host", ["-oProxyCommand=x", "a b", "user@-x", "h;id"])
def test_ssh_host_that_could_be_an_option_is_refused(host):
    from recovery_agent.config import from_mapping
    from recovery_agent.errors import ConfigError
    with pytest.raises(ConfigError, match="ssh_host"):
        from_mapping({"scheduler": {"ssh_host": host}})


def test_runner_from_config_in_ssh_mode():
    from recovery_agent.config import from_mapping
    cfg = from_mapping({"scheduler": {"ssh_host": "root@10.0.0.5",
                                      "ssh_options": "-i '/etc/key file' -p 22"}})
    runner = SlurmRunner.from_config(cfg.scheduler)
    assert runner.ssh_host == "root@10.0.0.5"
    assert runner.ssh_options == ("-i", "/etc/key file", "-p", "22")

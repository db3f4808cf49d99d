"""SSH mode, live: the agent runs "outside" the cluster and every Slurm command
goes through ssh to a login host (here a real sshd from Debian's
openssh-server on a loopback port), through the same argv seam and timeouts.

The sshd forces every session through a wrapper that logs the command it was
asked to run, so the test can see that the recovery's reads and writes really
went over ssh. The hooks keep reporting to the agent's URL as in the default
mode.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import TEST_PORT, job_row, wait_for
from tests.integration.test_recovery_live import (final_rec, own_agent, running_again,
                                                  xid_under_job)

pytestmark = pytest.mark.live
SSHD = "/usr/sbin/sshd"
SSH_PORT = TEST_PORT + 12505    # 39322 beside the default cluster; apart for a share's


class Sshd:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.log = root / "commands.log"
        self.proc: subprocess.Popen | None = None
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            str(root / name)], check=True)
        (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
        wrapper = root / "logwrap"
        wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$SSH_ORIGINAL_COMMAND" >> {self.log}\n'
                           'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"\n')
        wrapper.chmod(0o755)
        (root / "sshd_config").write_text("\n".join([
            f"Port {SSH_PORT}", "ListenAddress 127.0.0.1", f"HostKey {root / 'host_key'}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            f"ForceCommand {wrapper}", "LogLevel ERROR", ""]))

    def start(self) -> None:
        os.makedirs("/run/sshd", exist_ok=True)   # privilege separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.root / "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self.answers(), 20, "sshd accepting")

    def answers(self) -> bool:
        result = subprocess.run(["ssh", *self.options(), "root@127.0.0.1", "true"],
                                capture_output=True, timeout=20)
        return result.returncode == 0

    def options(self) -> list[str]:
        return ["-T", "-o", "BatchMode=yes", "-p", str(SSH_PORT), "-i",
                str(self.root / "client_key"), "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def commands(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def sshd(tmp_path):
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        pytest.fail("SSH mode needs Debian's openssh-server (make test installs it)")
    server = Sshd(tmp_path)
    server.start()
    yield server
    server.stop()


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.mark.resilience("SSH mode: the login host goes down",
                        "the agent keeps running, /healthz turns red, nothing is done; it "
                        "carries on when ssh answers again")
def test_ssh_mode_recovers_a_job_and_survives_the_host_going_down(devcluster, submit,
                                                                  tmp_path, cleanup, sshd):
    agent = own_agent(devcluster, tmp_path,
                      RECOVERY_SCHEDULER_SSH_HOST="root@127.0.0.1",
                      RECOVERY_SCHEDULER_SSH_OPTIONS=" ".join(sshd.options()[3:]),
                      RECOVERY_SCHEDULER_SLURM_CONF=str(devcluster.slurm_conf))
    agent.start()
    try:
        sched = devcluster.scheduler()
        job_id, _out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, agent)
        rec = final_rec(agent, job_row(agent, job_id)[0], timeout=90)
        assert (rec["status"], rec["exclude"]) == ("done", [bad])
        job = wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
        assert bad not in job.nodes
        ran = sshd.commands()
        # the reads and every write of the recovery went through ssh
        assert any(c.startswith(f"env SLURM_CONF={devcluster.slurm_conf} squeue --json")
                   for c in ran)
        for verb in (f"scontrol requeuehold {job_id}", f"scontrol release {job_id}",
                     f"scontrol update jobid={job_id} ExcNodeList={bad}"):
            assert any(verb in c for c in ran), (verb, ran[-10:])

        # the login host goes away: the agent stays up, says so, and acts on nothing
        sshd.stop()
        wait_for(lambda: healthz(agent.port) == 503, 60, "/healthz red without ssh")
        assert agent.proc.poll() is None
        recs_before = agent.query("select count(*) from recommendations")
        time.sleep(3)
        assert agent.query("select count(*) from recommendations") == recs_before
        sshd.start()
        wait_for(lambda: healthz(agent.port) == 200, 60, "/healthz green again")
    finally:
        agent.stop()

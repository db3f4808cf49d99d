"""The live dev cluster for integration tests.

One cluster per test session. `make test` starts it first and points
RECOVERY_DEVCLUSTER_DIR at it; run alone, pytest starts (and stops) its own.
There is no fallback to a mock: without Slurm these tests error out.
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from recovery_agent.errors import RecoveryError, SchedulerError
from recovery_devtools.devcluster.cluster import DevCluster
from recovery_devtools.devcluster.config import local_spec
from recovery_devtools.devcluster.inject import clear_node
from tests.step_faults import ENV as STEP_FAULTS

TEST_PORT = int(os.environ.get("RECOVERY_TEST_PORT", "26817"))


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             interval: float = 0.25):
    """Poll until ``predicate`` returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


REPO = Path(__file__).resolve().parents[2]


def build_native_parts() -> None:
    """The SPANK plugin and the fake NVML must exist before the cluster is
    configured (`make test` builds them first; this covers a bare pytest run).
    RECOVERY_SPANK_PLUGIN names a plugin built elsewhere, for another Slurm
    release (tests/slurm_matrix.sh): spank/ is then left alone."""
    folders = ("tests/fake_nvml",) if os.environ.get("RECOVERY_SPANK_PLUGIN") else (
        "spank", "tests/fake_nvml")
    for folder in folders:
        result = subprocess.run(["make", "-s", "-C", str(REPO / folder)], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            pytest.fail(f"make -C {folder} failed:\n{result.stdout}{result.stderr}")


@pytest.fixture(scope="session")
def devcluster():
    build_native_parts()
    state_dir = os.environ.get("RECOVERY_DEVCLUSTER_DIR") or tempfile.mkdtemp(
        prefix="recovery-test-cluster-")
    cluster = DevCluster(state_dir)
    started_here = not cluster.is_healthy()
    cluster.up(local_spec(port=TEST_PORT))
    # unprivileged users (the -m security suite) reach slurm.conf and the munge
    # socket through the state dir; mkdtemp makes it 0700
    os.chmod(cluster.lay.root, 0o755)
    yield cluster
    if started_here:
        cluster.down(quiet=True)


class Submitter:
    """sbatch through the same argv seam as everything else; cancels what it
    submitted when the test ends. ``as_user`` (a tests.hostile.UnixUser)
    submits as that unprivileged user instead of root."""

    def __init__(self, cluster: DevCluster) -> None:
        self.cluster = cluster
        self.runner = cluster.runner(timeout=30)
        self.submitted: list[str] = []

    def __call__(self, *args: str, script: str = "sleep 300", as_user=None,
                 chdir: str | Path | None = None) -> str:
        argv = ["sbatch", "--parsable", f"--chdir={chdir or self.cluster.lay.jobs}",
                "--mem=100", *args, "--wrap", script]
        if as_user is not None:
            argv = as_user.argv(argv)
        job_id = self.runner.run(argv).stdout.strip().split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def cleanup(self) -> None:
        if self.submitted:
            self.runner.run(["scancel", *self.submitted], check=False)

    # how a job that ended on its own may still look like work to recover
    _RECOVERABLE = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED",
                              "DEADLINE"})

    def retire(self, timeout: float = 60.0) -> None:
        """Cancel everything submitted so far, and leave none of it for another
        agent to recover. A job that had already failed stays FAILED in squeue
        for MinJobAge: the next test's agent, with a store of its own, sees an
        opted-in failure and requeues it, and that job then runs on into later
        tests. Such a job is put back (held) and cancelled, so it ends CANCELLED.
        Call it with no agent running."""
        if not self.submitted:
            return
        self.cleanup()
        sched = self.cluster.scheduler()
        try:
            sched.list_jobs()
        except RecoveryError:   # slurmctld down (the test killed it): cancelled is all
            return

        def settled():
            jobs = [j for j in sched.list_jobs() if j.job_id in self.submitted]
            return None if any(not j.is_finished for j in jobs) else ("ended", jobs)

        _, ended = wait_for(settled, timeout, "the test's jobs ended")
        for job in ended:
            if job.state in self._RECOVERABLE:
                self.runner.run(["scontrol", "update", f"jobid={job.job_id}", "requeue=1"],
                                check=False)
                self.runner.run(["scontrol", "requeuehold", job.job_id], check=False)
                self.runner.run(["scancel", job.job_id], check=False)
        wait_for(lambda: not [j for j in sched.list_jobs() if j.job_id in self.submitted
                              and (j.state in self._RECOVERABLE or not j.is_finished)],
                 timeout, "the test's failed jobs cancelled")


@pytest.fixture
def submit(devcluster):
    submitter = Submitter(devcluster)
    yield submitter
    submitter.cleanup()


class AgentProcess:
    """recovery-agent started from the dev cluster's own recovery.toml."""

    def __init__(self, cluster, db: Path | None = None, env: dict | None = None) -> None:
        self.cluster = cluster
        self.config = cluster.lay.agent_config
        self.port = int(next(l.split("=")[1] for l in self.config.read_text().splitlines()
                             if l.startswith("port =")))
        self.db = db or cluster.lay.root / "agent" / "recovery.db"
        self.log = cluster.lay.logs / "agent.log"
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    def environ(self) -> dict:
        return dict(os.environ, RECOVERY_CONFIG=str(self.config),
                    RECOVERY_STORE_PATH=str(self.db), **self.extra_env)

    def start(self) -> None:
        env = self.environ()
        # an agent given crash or pause points runs with them as its actuator's
        # step seam (tests/step_faults.py); any other is the plain daemon
        module = ("tests.step_faults" if any(k in self.extra_env for k in STEP_FAULTS)
                  else "recovery_agent")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module], env=env,
                                         stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        wait_for(self.healthy, 30, "agent answering /v1/health")

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"agent exited: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health",
                                        timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self.proc = None

    def wait_dead(self, timeout: float) -> int:
        """Wait for the agent to die on its own (a crash point); its exit code."""
        assert self.proc is not None
        code = self.proc.wait(timeout=timeout)
        self.proc = None
        return code

    def query(self, sql: str, *args) -> list[tuple]:
        with sqlite3.connect(self.db, timeout=10) as conn:
            return conn.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def agent(devcluster):
    a = AgentProcess(devcluster)
    a.start()
    yield a
    a.stop()


def job_row(agent, job_id: str):
    rows = agent.query("select id, env, mode, spec from jobs where job_id = ?", job_id)
    return rows[0] if rows else None


def release_node(devcluster, node: str) -> None:
    """A node a test faulted: its XIDs cleared and any drain lifted."""
    clear_node(devcluster.lay, node)
    sched = devcluster.scheduler()
    try:
        if sched.get_node(node).drained:
            sched.resume_node(node)
    except SchedulerError:
        pass


@pytest.fixture
def cleanup(devcluster):
    """Nodes a test faulted: their XIDs cleared and any drain lifted afterwards."""
    touched: list[tuple[str, AgentProcess | None]] = []
    yield touched
    sched = devcluster.scheduler()
    for node, agent in touched:
        release_node(devcluster, node)
        if agent is not None and agent.db.exists():
            with sqlite3.connect(agent.db, timeout=10) as conn:
                conn.execute("update nodes set drained_by_us = 0 where name = ?", (node,))
    if touched:
        wait_for(lambda: all(n.available for n in sched.list_nodes()), 30,
                 "every node available again")

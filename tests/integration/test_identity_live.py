"""A job id reused after a slurmctld state reset is another job (issue 14,
finding 1), live: an opted-in job (action mode) is stored; slurmctld loses its
state and starts counting again, handing the same id to a job that never opted
in (or asked for monitor only); that job fails. Nothing of the old job's
directive passes to it: no action-mode recommendation, no requeue.

The reset needs a cluster of its own (it wipes slurmctld's state), started here
on ports apart from the session's."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest

from recovery_agent.errors import SchedulerError
from recovery_devtools.devcluster.cluster import DevCluster
from recovery_devtools.devcluster.config import local_spec
from tests.integration.conftest import TEST_PORT, AgentProcess, wait_for

pytestmark = pytest.mark.live


@pytest.fixture(scope="module")
def reset_cluster(devcluster):
    state = tempfile.mkdtemp(prefix="recovery-reset-cluster-")
    os.chmod(state, 0o755)
    cluster = DevCluster(state)
    cluster.up(local_spec(nodes=2, port=TEST_PORT + 500))
    yield cluster
    cluster.down(quiet=True)
    shutil.rmtree(state, ignore_errors=True)


def sbatch(cluster, *args: str, script: str) -> str:
    argv = ["sbatch", "--parsable", f"--chdir={cluster.lay.jobs}", "--mem=100", *args,
            "--wrap", script]
    return cluster.runner(timeout=30).run(argv).stdout.strip().split(";")[0]


def reset_controller(cluster) -> None:
    """slurmctld dies and comes back with no state at all: job ids start over."""
    cluster.kill_ctld()
    for entry in cluster.lay.ctld_dir.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    cluster.start_ctld()
    sched = cluster.scheduler()
    wait_for(lambda: all(n.available for n in sched.list_nodes()), 60,
             "the nodes back after the reset")


def rows(agent, job_id: str) -> list[dict]:
    found = agent.query("select id, env, mode, spec, state, submit_time from jobs where "
                        "job_id = ? order by id", job_id)
    return [dict(zip(("id", "env", "mode", "spec", "state", "submit"), r)) for r in found]


@pytest.mark.resilience("job id reused after a slurmctld state reset",
                        "the new job inherits no directive: no action, no requeue")
@pytest.mark.parametrize("comment", ["", "--comment=recovery=act:monitor"])
def test_reused_job_id_inherits_nothing(reset_cluster, tmp_path, comment):
    reset_controller(reset_cluster)     # ids count from 1: the old job is job 1
    agent = AgentProcess(reset_cluster, db=tmp_path / "recovery.db")
    agent.start()
    try:
        old = sbatch(reset_cluster, "-N1", "--comment=recovery=act:action", "--requeue",
                     script="sleep 300")
        wait_for(lambda: [r for r in rows(agent, old) if r["mode"] == "action"], 60,
                 f"job {old} registered in action mode")
        reset_cluster.runner().run(["scancel", old])
        wait_for(lambda: [r for r in rows(agent, old) if r["state"] == "CANCELLED"], 60,
                 f"job {old} seen cancelled")
        reset_at = time.time()
        reset_controller(reset_cluster)
        # 22.05's sbatch has no --jobid: the fresh controller hands out 1 again
        args = [a for a in ("-N1", comment) if a]
        new = sbatch(reset_cluster, *args, script='echo "step 1"; sleep 3; exit 1')
        assert new == old == "1"
        sched = reset_cluster.scheduler()
        wait_for(lambda: (j := _job(sched, new)) and j.is_finished, 60, "the new job ended")
        # what the agent did with it, after a verdict's worth of time
        time.sleep(25)
        recs = agent.query("select job, mode, action, status from recommendations")
        assert [r for r in recs if r[1] == "action"] == [], recs
        assert agent.query("select count(*) from rec_steps where step = 'requeue_hold'") \
            == [(0,)]
        assert agent.query("select count(*) from events where kind = 'id_reused'") == [(1,)]
        job = _job(sched, new)
        assert job.restart_count == 0 and job.state == "FAILED"
        stored = rows(agent, old)
        assert stored[0]["state"] == "GONE"
        if comment:   # it asked for monitor: a row of its own, its own directive
            assert [(r["env"], r["mode"]) for r in stored[1:]] == [("act", "monitor")]
        else:         # it never opted in: not tracked at all
            assert len(stored) == 1
        # and the old job's timeline does not fill with the new job's states
        assert agent.query("select count(*) from events where job = ? and kind = "
                           "'slurm_state' and ts > ?", stored[0]["id"], reset_at) == [(0,)]
    finally:
        agent.stop()


def _job(sched, job_id: str):
    try:
        return sched.get_job(job_id)
    except SchedulerError:
        return None

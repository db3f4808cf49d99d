"""One contract every scheduler backend must meet, run live on the dev cluster.

Subclass :class:`SchedulerContract` per backend and provide a ``scheduler``
fixture. The CLI backend runs here in CI. The pyslurm backend runs only where
pyslurm can (Slurm 25.11); on other machines its class is not defined at all,
so nothing is skipped and nothing is counted that did not run.
"""
from __future__ import annotations

import time

import pytest

from recovery_agent.errors import JobNotFound, NodeNotFound, SchedulerError
from recovery_agent.scheduler import CliScheduler, Scheduler
from recovery_agent.scheduler.pyslurm_backend import PyslurmScheduler
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.live


def job_in(sched: Scheduler, job_id: str, *states: str):
    job = sched.get_job(job_id)
    return job if job.state in states else None


class SchedulerContract:
    @pytest.fixture
    def scheduler(self, devcluster) -> Scheduler:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_probe_is_viable(self, scheduler):
        probe = scheduler.probe()
        assert probe.viable, probe.reason
        assert probe.version

    def test_two_node_job_requeue_exclude_and_run_again(self, scheduler, submit, devcluster):
        job_id = submit("-N2", "--ntasks-per-node=1", "--open-mode=append", "-J", "contract",
                        "-o", "%x-%j.out", script="srun sleep 300")
        job = wait_for(lambda: job_in(scheduler, job_id, "RUNNING"), 30, "job RUNNING")
        assert len(job.nodes) == 2 and all(n.startswith("node") for n in job.nodes)
        assert job.batch_host in job.nodes
        assert job.restart_count == 0 and not job.held
        assert job.stdout == str(devcluster.lay.jobs / f"contract-{job_id}.out")
        first_nodes = job.nodes

        scheduler.requeue_hold(job_id)
        held = wait_for(lambda: job_in(scheduler, job_id, "PENDING"), 30, "job requeued")
        assert held.held and held.restart_count == 1

        bad = first_nodes[0]
        scheduler.set_excluded_nodes(job_id, [bad])
        assert scheduler.get_job(job_id).excluded_nodes == (bad,)

        started = time.monotonic()
        scheduler.start_now(job_id)
        scheduler.release(job_id)
        again = wait_for(lambda: job_in(scheduler, job_id, "RUNNING"), 30, "job running again")
        elapsed = time.monotonic() - started
        # Slurm alone would wait ~120 s (BeginTime) before running a requeued job
        assert elapsed < 60, f"requeued job took {elapsed:.0f}s to run again"
        assert bad not in again.nodes and len(again.nodes) == 2
        assert again.restart_count == 1 and again.excluded_nodes == (bad,)

    def test_no_requeue_job_is_refused_until_allowed(self, scheduler, submit):
        job_id = submit("-N1", "--no-requeue")
        wait_for(lambda: job_in(scheduler, job_id, "RUNNING"), 30, "job RUNNING")
        assert not scheduler.get_job(job_id).requeue_allowed
        with pytest.raises(SchedulerError) as info:
            scheduler.requeue_hold(job_id)
        assert info.value.argv  # the refusal says what was run
        scheduler.allow_requeue(job_id)
        assert scheduler.get_job(job_id).requeue_allowed
        scheduler.requeue_hold(job_id)
        held = wait_for(lambda: job_in(scheduler, job_id, "PENDING"), 30, "requeued")
        assert held.held
        # exclusions can change only while the job waits; an empty list clears them
        scheduler.set_excluded_nodes(job_id, ["node1", "node2"])
        assert scheduler.get_job(job_id).excluded_nodes == ("node1", "node2")
        scheduler.set_excluded_nodes(job_id, [])
        assert scheduler.get_job(job_id).excluded_nodes == ()

    def test_cancel(self, scheduler, submit):
        job_id = submit("-N1")
        wait_for(lambda: job_in(scheduler, job_id, "RUNNING"), 30, "job RUNNING")
        scheduler.cancel(job_id)
        wait_for(lambda: job_in(scheduler, job_id, "CANCELLED"), 30, "job CANCELLED")

    def test_drain_and_resume_node(self, scheduler, devcluster):
        name = devcluster.node_names()[-1]
        try:
            scheduler.drain_node(name, "recovery: contract-test gpu_hardware xid=79")
            node = scheduler.get_node(name)
            assert node.drained and not node.available
            assert node.reason == "recovery: contract-test gpu_hardware xid=79"
            assert node.reason_user
        finally:
            scheduler.resume_node(name)
        # slurmctld pings a resumed node: NOT_RESPONDING shows for a moment
        node = wait_for(lambda: (n := scheduler.get_node(name)) and n.available and n,
                        15, "node resumed")
        assert not node.drained and node.reason == ""

    def test_array_tasks(self, scheduler, submit, devcluster):
        array_id = submit("-N1", "--array=0-3%2", "-J", "arr", "-o", "%x-%A_%a-%u.out",
                          script="sleep 300")
        tasks = wait_for(lambda: [j for j in scheduler.list_jobs()
                                  if j.array_job_id == int(array_id) and j.is_active],
                         30, "two array tasks running")
        assert len(tasks) == 2
        ids = sorted(t.job_id for t in tasks)
        assert ids == [f"{array_id}_0", f"{array_id}_1"]
        task = scheduler.get_job(f"{array_id}_1")
        assert task.array_task_id == 1 and task.numeric_id != int(array_id)
        assert task.stdout == str(devcluster.lay.jobs / f"arr-{array_id}_1-{task.user}.out")
        wait_for(lambda: __import__("os").path.exists(task.stdout), 15, "task output file")
        rest = scheduler.get_job(f"{array_id}_[2-3%2]")
        assert rest.is_pending and rest.array_task_spec == "2-3%2"
        # one task at a time: requeue only task 1
        scheduler.requeue_hold(f"{array_id}_1")
        wait_for(lambda: job_in(scheduler, f"{array_id}_1", "PENDING"), 30, "task requeued")
        assert scheduler.get_job(f"{array_id}_0").state == "RUNNING"

    def test_unknown_job_and_node(self, scheduler):
        with pytest.raises(JobNotFound):
            scheduler.get_job("987654")
        with pytest.raises(JobNotFound) as info:
            scheduler.requeue_hold("987654")
        assert info.value.returncode not in (0, None) or info.value.argv
        with pytest.raises(NodeNotFound):
            scheduler.get_node("nosuchnode")
        with pytest.raises(NodeNotFound):
            scheduler.drain_node("nosuchnode", "recovery: test")

    def test_list_nodes_matches_cluster(self, scheduler, devcluster):
        names = sorted(n.name for n in scheduler.list_nodes())
        assert names == sorted(devcluster.node_names())


class TestCliScheduler(SchedulerContract):
    @pytest.fixture
    def scheduler(self, devcluster) -> Scheduler:
        return CliScheduler(devcluster.runner())


if PyslurmScheduler().probe().viable:  # only where pyslurm matches the running Slurm
    class TestPyslurmScheduler(SchedulerContract):
        @pytest.fixture
        def scheduler(self, devcluster) -> Scheduler:
            return PyslurmScheduler()

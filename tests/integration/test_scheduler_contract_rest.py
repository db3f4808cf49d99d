"""The scheduler contract, live, through slurmrestd.

The dev cluster runs slurmrestd only when asked (``RECOVERY_DEVCLUSTER_REST=1``:
it needs the slurmrestd and slurm-wlm-jwt-plugin packages and changes
slurm.conf), so the REST classes are defined only then: nothing is skipped and
nothing counted that did not run. ``make test-rest`` runs them.
"""
from __future__ import annotations

import logging
import os

import pytest

from recovery_agent.errors import SchedulerError
from recovery_agent.scheduler import Scheduler
from recovery_agent.scheduler.rest_backend import RestScheduler
from recovery_agent.scheduler.rest_client import SUPPORTED_VERSIONS, RestSettings
from tests.integration.conftest import wait_for
from tests.integration.test_scheduler_contract import SchedulerContract, job_in

pytestmark = pytest.mark.live

REST_ON = os.environ.get("RECOVERY_DEVCLUSTER_REST", "") not in ("", "0")


def rest_scheduler(devcluster, **overrides) -> RestScheduler:
    rest = devcluster.rest_settings()
    assert rest, "the dev cluster runs without slurmrestd (RECOVERY_DEVCLUSTER_REST=1?)"
    settings = dict(url=rest["url"], token_file=rest["token_file"], user=rest["user"],
                    timeout=20.0)
    settings.update(overrides)
    return RestScheduler(RestSettings(**settings), devcluster.runner())


if REST_ON:
    class TestRestScheduler(SchedulerContract):
        """auth/jwt over TCP, the newest OpenAPI version the server offers."""

        @pytest.fixture
        def scheduler(self, devcluster) -> Scheduler:
            return rest_scheduler(devcluster)

    class TestRestOnly:
        """What the REST backend adds: the version it picked, local auth on a
        unix socket, a refused token, and no silent CLI fallback when it is off."""

        def test_speaks_the_newest_version_offered(self, devcluster):
            sched = rest_scheduler(devcluster)
            offered, _paths = sched.client.offered_versions()
            assert sched.api().version == next(v for v in offered if v in SUPPORTED_VERSIONS)
            # the probe names the Slurm release, as the other backends do
            assert sched.probe().version.count(".") == 2

        def test_array_tasks_looked_up_and_changed(self, devcluster, submit):
            sched = rest_scheduler(devcluster)
            array_id = submit("-N1", "--array=0-3%2", script="sleep 300")
            wait_for(lambda: any(j.job_id == f"{array_id}_1" and j.is_active
                                 for j in sched.list_jobs()), 30, "task 1 running")
            assert sched.lookup_job(f"{array_id}_1").array_task_id == 1
            rest_of = sched.lookup_job(f"{array_id}_[2-3%2]")
            assert rest_of.is_pending and rest_of.array_task_spec == "2-3%2"
            sched.cancel(array_id)
            # 22.05 reports every array-task update as failed, though it took effect
            # (no throttle here: a requeued task would wait for a throttled sibling)
            pair = submit("-N1", "--array=0-1", script="sleep 300")
            task = f"{pair}_1"
            first = wait_for(lambda: next((j for j in sched.list_jobs()
                                           if j.job_id == task and j.is_active), None),
                             30, "task 1 running")
            sched.requeue_hold(task)
            wait_for(lambda: job_in(sched, task, "PENDING"), 30, "task requeued")
            sched.set_excluded_nodes(task, list(first.nodes))
            assert sched.lookup_job(task).excluded_nodes == first.nodes
            sched.start_now(task)
            sched.release(task)
            again = wait_for(lambda: job_in(sched, task, "RUNNING"), 30, "task running again")
            assert not set(first.nodes) & set(again.nodes) and again.restart_count == 1

        def test_local_socket_reads(self, devcluster):
            rest = devcluster.rest_settings()
            sched = RestScheduler(RestSettings(url=rest["socket"], auth="local",
                                               timeout=20.0), devcluster.runner())
            assert sched.probe().viable
            assert sorted(n.name for n in sched.list_nodes()) == sorted(devcluster.node_names())

        def test_no_token_is_a_401_naming_the_endpoint(self, devcluster):
            # no X-SLURM-USER-TOKEN on TCP: slurmrestd itself refuses (401, text/plain)
            sched = rest_scheduler(devcluster, auth="local")
            with pytest.raises(SchedulerError) as info:
                sched.list_jobs()
            assert info.value.returncode == 401
            assert info.value.argv == ["GET", "/openapi/v3"]
            assert "HTTP 401" in str(info.value)

        def test_forged_token_is_refused_not_an_empty_listing(self, devcluster, tmp_path):
            # slurmrestd passes the token on; slurmctld refuses it. 22.05 says so as
            # HTTP 500 with a bare "Unspecified error" entry, 24.11 as 511 (Slurm's
            # error 1007, "Protocol authentication error"), others as 401.
            bad = tmp_path / "token"
            bad.write_text("SLURM_JWT=eyJhbGciOiJIUzI1NiJ9.e30.c2lnbmF0dXJl\n")
            sched = rest_scheduler(devcluster, token_file=str(bad))
            with pytest.raises(SchedulerError) as info:
                sched.list_jobs()
            assert info.value.returncode in (401, 500, 511)
            assert info.value.argv[0] == "GET"
            assert f"HTTP {info.value.returncode}" in str(info.value)

        def test_missing_endpoint_without_fallback_is_an_error(self, devcluster, submit,
                                                               caplog):
            sched = rest_scheduler(devcluster, fallback="none")
            job_id = submit("-N1")
            wait_for(lambda: job_in(sched, job_id, "RUNNING"), 30, "job RUNNING")
            if sched.api().offers("job/{job_id}/requeue", "get"):
                sched.requeue_hold(job_id)   # 26.05: REST has it; nothing to fall back on
                wait_for(lambda: job_in(sched, job_id, "PENDING"), 30, "requeued")
                return
            with pytest.raises(SchedulerError) as info:
                sched.requeue_hold(job_id)
            assert "no endpoint for requeue" in str(info.value)
            assert info.value.argv[1].endswith("/requeue")
            assert sched.get_job(job_id).state == "RUNNING"   # nothing happened
            with caplog.at_level(logging.INFO, "recovery_agent.scheduler.rest_backend"):
                rest_scheduler(devcluster).requeue_hold(job_id)
            assert "running it through the CLI" in caplog.text
            wait_for(lambda: job_in(sched, job_id, "PENDING"), 30, "requeued via the CLI")

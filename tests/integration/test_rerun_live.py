"""Issue 22 live: slurmctld runs an attempt again at the same restart count, and
each of its failures gets exactly one decision.

A controller restarted from older state puts a job back in the queue itself
(the fault campaign, test_faults_live.py, meets it by chance). Here it is made
on purpose: the job is submitted held, slurmctld is stopped cleanly (its state
saved) and that state kept; the job is released, runs and fails; slurmctld is
killed and started again on the kept state, so the job is held at restart
count 0 once more, with its old submit time; released, it runs and fails again.
Nothing else is submitted meanwhile, so no job id is handed out twice.
"""
from __future__ import annotations

import shutil
import signal

import pytest

from tests.integration.conftest import job_row, wait_for

pytestmark = pytest.mark.live

FAILS = ('echo "run at $(date +%s)"; sleep 5; echo "Traceback (most recent call last):"; '
         'echo "ValueError: bad config"; exit 3')


@pytest.fixture
def ctld(devcluster):
    yield devcluster
    if not devcluster._ctld_answers():
        devcluster.start_ctld()


def job_recs(agent, pk: int) -> list[tuple]:
    return agent.query("select attempt, run_start, action, status from recommendations "
                       "where job = ? and scope = 'job' order by id", pk)


def state(devcluster, job: str) -> str:
    out = devcluster.runner(timeout=30).run(["scontrol", "show", "job", job], check=False)
    return out.stdout


@pytest.mark.resilience("slurmctld restarted from older state runs an attempt again at "
                        "the same restart count",
                        "each run's failure gets its own verdict and exactly one decision")
def test_each_run_at_one_restart_count_gets_exactly_one_decision(ctld, agent, submit,
                                                                  tmp_path):
    devcluster = ctld
    runner = devcluster.runner(timeout=30)
    job = submit("-N1", "--hold", "--requeue", "--recovery=act:monitor", "-o",
                 str(devcluster.lay.jobs / "rerun-%j.out"), "--open-mode=append", script=FAILS)
    devcluster.kill_ctld(signal.SIGTERM)          # a clean stop: the held job is saved
    kept = tmp_path / "ctld-state"
    shutil.copytree(devcluster.lay.ctld_dir, kept)
    devcluster.start_ctld()
    runner.run(["scontrol", "release", job])
    row = wait_for(lambda: job_row(agent, job), 60, "the job registered by its prolog")
    wait_for(lambda: len(job_recs(agent, row[0])) == 1, 90, "the first run decided")
    devcluster.kill_ctld()
    shutil.rmtree(devcluster.lay.ctld_dir)
    shutil.copytree(kept, devcluster.lay.ctld_dir)
    devcluster.start_ctld()
    shown = state(devcluster, job)
    assert "JobState=PENDING" in shown and "Restarts=0" in shown, shown
    runner.run(["scontrol", "release", job])
    recs = wait_for(lambda: (r := job_recs(agent, row[0])) and len(r) == 2 and r, 120,
                    "the second run decided")
    (first, again) = recs
    assert first[0] == again[0] == 0                      # one restart count
    assert first[1] and again[1] and first[1] < again[1]  # two runs
    assert first[2:] == again[2:] == ("stop", "would_have")
    verdicts = agent.query("select json_extract(data, '$.run_start') from events where "
                           "job = ? and kind = 'verdict' order by id", row[0])
    assert [v[0] for v in verdicts] == [first[1], again[1]]
    assert agent.query("select count(*) from events where job = ? and kind = 'ran_again'",
                       row[0]) == [(1,)]
    # one row for the job, its reports with it
    assert agent.query("select count(*) from jobs where job_id = ?", job) == [(1,)]
    assert agent.query("select count(distinct run_start) from node_reports where job = ? "
                       "and hook = 'prolog'", row[0]) == [(2,)]

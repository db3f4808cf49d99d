"""Issue 7's fault campaign, live: slurmctld killed and restarted at each step of
a recovery, and the agent SIGKILLed again and again under load.

Every scenario ends with the same checks: the job runs again with exactly one
requeue per failure (no duplicate action), nothing is left held (no stranded
job), and the failure shows in the audit trail. Slurm here is the real dev
cluster; slurmctld is killed with SIGKILL, so it gets no chance to save state.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from recovery_agent.act.drains import ours
from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import job_row, wait_for
from tests.integration.test_recovery_live import (final_rec, job_now, own_agent, recs,
                                                  running_again, second_node, steps,
                                                  train_job, output_has, xid_under_job)

pytestmark = pytest.mark.live

# steps stay retried long enough to outlast a controller restart
PATIENT = {"RECOVERY_POLICY_ACTION_RETRIES": "8", "RECOVERY_POLICY_RETRY_BACKOFF": "1s",
           "RECOVERY_POLICY_DECISION_TIMEOUT": "300s"}
CTLD_DOWN_S = 15.0  # longer than a client waits for the controller (MessageTimeout=10)


@pytest.fixture
def ctld(devcluster):
    """The controller, restarted after the test whatever happened."""
    yield devcluster
    if not devcluster._ctld_answers():
        devcluster.start_ctld()
    # a controller that lost state may hand out a job id again while a node
    # still runs the old job, and drain that node ("Duplicate jobid"): undo
    sched = devcluster.scheduler()
    for node in sched.list_nodes():
        if not node.available and not ours(node.reason):
            devcluster.runner().run(["scontrol", "update", f"nodename={node.name}",
                                     "state=resume"], check=False)
    wait_for(lambda: all(n.available for n in sched.list_nodes()), 60,
             "every node available again")


def events(agent, job_pk: int, kind: str) -> list[str]:
    return [r[0] for r in agent.query("select message from events where job = ? and kind = ? "
                                      "order by id", job_pk, kind)]


@pytest.mark.resilience("slurmctld killed and restarted during a recovery step",
                        "the step fails and is retried; one requeue; the job runs again "
                        "without the bad node; nothing left held; the failed try audited")
@pytest.mark.parametrize("step", ["requeue_hold", "exclude", "release"])
def test_slurmctld_killed_during_a_step(ctld, submit, tmp_path, cleanup, step):
    devcluster = ctld
    sched = devcluster.scheduler()
    pause = tmp_path / "paused"
    agent = own_agent(devcluster, tmp_path, STEP_FAULTS_PAUSE_BEFORE=step,
                      STEP_FAULTS_PAUSE_FILE=str(pause), **PATIENT)
    agent.start()
    try:
        job_id, _out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, agent)
        # the case before restarted slurmctld: the next job may take longer to get there
        wait_for(pause.exists, 120, f"the agent paused before {step}")
        devcluster.kill_ctld()
        pause.unlink()                  # the step now meets a dead controller
        time.sleep(CTLD_DOWN_S)
        devcluster.start_ctld()
        row = job_row(agent, job_id)
        rec = final_rec(agent, row[0], timeout=120)
        # SIGKILL loses the controller's last state changes. On restart it may
        # put the attempt back in the queue itself (the agent then only adds its
        # exclusions), forget our requeue (the agent requeues again, and says
        # so), or show the attempt RUNNING as it was before it failed (the agent
        # stands aside: expired, with the reason in the audit trail).
        # Or it may forget the job outright, young as it is (Slurm's loss, not
        # ours to test): the agent then does nothing more to it.
        assert rec["status"] in ("done", "expired"), rec
        if rec["status"] == "expired" and job_now(sched, job_id) is None:
            assert "gone from slurmctld" in rec["error"], rec
            assert agent.healthy()
            return
        if rec["status"] == "expired":
            assert "without our requeue" in rec["error"], rec
        else:
            assert rec["exclude"] == [bad]
            adopted = "itself" in (rec["error"] or "")
            if not adopted:
                assert step in steps(agent, rec["id"], "failed"), "the failed try is audited"
            job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING"
                           and j, 90, "the job running again")
            assert job.restart_count == (0 if adopted else 1), "exactly one requeue"
            assert bad not in job.nodes and job.excluded_nodes == (bad,)
        # whatever the controller remembered: never two requeues, nothing held
        job = wait_for(lambda: (j := job_now(sched, job_id)) and not (j.is_pending and j.held)
                       and j, 30, "the job not held")
        assert job.restart_count <= 1
        holds = agent.query("select detail from rec_steps where rec = ? and step = "
                            "'requeue_hold' and state = 'ok' order by id", rec["id"])
        # a second requeue only when the restarted controller had forgotten the
        # first one (Slurm's restart count above proves it took effect once)
        assert len(holds) <= 1 or "again" in holds[1][0], holds
    finally:
        agent.stop()
        submit.retire()   # none of its failed jobs left for the next agent


@pytest.mark.resilience("slurmctld killed and restarted during job registration",
                        "the prolog's report is kept and the job registered once; a job "
                        "the restarted controller remembers is then recovered as usual, "
                        "one it lost is left alone (no recommendation)")
def test_slurmctld_killed_during_registration(ctld, submit, tmp_path, cleanup):
    devcluster = ctld
    sched = devcluster.scheduler()
    agent = own_agent(devcluster, tmp_path, **PATIENT)
    agent.start()
    try:
        job_id, out = train_job(submit, devcluster, tmp_path, "act")
        # as Slurm starts it, the controller dies: the prolog reports with
        # nobody to answer the agent's squeue. Slurm writes its job state a
        # moment after each change; killed before that, it forgets the job
        # and hands its id out again, which is Slurm's loss, not ours to test
        wait_for(lambda: (j := job_now(sched, job_id)) and not j.is_pending, 60,
                 "the job starting")
        started = time.time()
        state = devcluster.lay.ctld_dir / "job_state"
        wait_for(lambda: state.exists() and state.stat().st_mtime >= started, 30,
                 "slurmctld saving the started job")
        devcluster.kill_ctld()
        row = wait_for(lambda: job_row(agent, job_id), 30, "the job registered by its prolog")
        time.sleep(CTLD_DOWN_S)
        devcluster.start_ctld()
        prologs = agent.query("select message from events where job = ? and attempt = 0 and "
                              "kind = 'hook_prolog'", row[0])
        assert len(prologs) == 2, prologs     # one report per node, none lost or doubled
        assert len(agent.query("select id from jobs where job_id = ?", job_id)) == 1
        time.sleep(3)
        if job_now(sched, job_id) is None:
            # Slurm saves its state a little after each change, so a job killed
            # this young may be lost with the controller: nothing to recover,
            # and nothing may be done to it
            assert not recs(agent, row[0])
            assert agent.healthy()
            return
        job, bad = second_node(sched, job_id)
        cleanup.append((bad, agent))
        wait_for(lambda: output_has(out, "checkpoint saved:"), 60, "a checkpoint")
        inject_xid(devcluster.lay, bad, 0, 79)
        rec = final_rec(agent, row[0], timeout=120)
        assert (rec["status"], rec["exclude"]) == ("done", [bad])
        wait_for(lambda: running_again(sched, job_id), 90, "the job running again")
    finally:
        agent.stop()
        submit.retire()   # none of its failed jobs left for the next agent


# -- the agent killed again and again ------------------------------------------------

def _kill_loop(devcluster, submit, tmp_path, cleanup, kills: int, seed: int) -> dict:
    """Keep three training jobs running, fail one every round, and SIGKILL the
    agent at a random moment of each round; returns what was done."""
    rng = random.Random(seed)
    sched = devcluster.scheduler()
    agent = own_agent(devcluster, tmp_path, RECOVERY_POLICY_MAX_DRAINS_PER_HOUR="0",
                      **PATIENT)
    jobs: list[str] = []
    faults = 0
    agent.start()
    try:
        for round_ in range(kills):
            live = [j for j in jobs if (x := job_now(sched, j)) and not x.is_finished]
            while len(live) < 3:
                job_id, _ = train_job(submit, devcluster, tmp_path, "act", steps_=4000)
                jobs.append(job_id)
                live.append(job_id)
            running = [j for j in live if (x := job_now(sched, j)) and x.state == "RUNNING"]
            if running:
                victim = sched.get_job(rng.choice(running))
                node = rng.choice(victim.nodes)
                cleanup.append((node, agent))
                inject_xid(devcluster.lay, node, rng.randrange(2), 79)
                faults += 1
            time.sleep(rng.uniform(0.0, 4.0))
            agent.proc.kill()                   # SIGKILL, wherever it was
            agent.wait_dead(15)
            agent.start()
        # let the last agent reconcile everything: first it must have seen every job
        # (one submitted while it was down reaches it on its first cycles, from squeue
        # or the spooled prolog report), then finished every recommendation
        wait_for(lambda: all(job_row(agent, j) for j in jobs), 60,
                 "every job registered by the last agent")
        wait_for(lambda: not agent.query("select id from recommendations where status in "
                                         "('proposed', 'executing')"), 180,
                 "every recommendation reconciled")
        return {"agent": agent, "jobs": jobs, "faults": faults}
    except BaseException:
        agent.stop()
        submit.retire()
        raise


def _assert_reconciled(devcluster, result: dict) -> None:
    agent = result["agent"]
    sched = devcluster.scheduler()
    try:
        for job_id in result["jobs"]:
            row = job_row(agent, job_id)
            assert row is not None, f"job {job_id} never registered"
            job = job_now(sched, job_id)
            done = [r for r in recs(agent, row[0], "job")
                    if r["status"] == "done" and r["action"] in ("requeue_exclude", "requeue")]
            # one requeue per decision, never two: Slurm's count matches ours
            attempts = [r["attempt"] for r in recs(agent, row[0], "job")]
            assert len(attempts) == len(set(attempts)), f"job {job_id}: two recs per attempt"
            if job is not None:
                # every requeue Slurm counted came from one of our decisions, once:
                # a kill between the call and its "ok" leaves only "started", and
                # the restarted agent carries on without calling it again
                tried = [r for r in recs(agent, row[0], "job")
                         if "requeue_hold" in steps(agent, r["id"], "started")]
                assert len(done) <= job.restart_count <= len(tried), \
                    (job_id, job.restart_count, done, tried)
                for rec in tried:
                    assert steps(agent, rec["id"]).count("requeue_hold") <= 1
                # nothing stranded: a job of ours is never left held
                assert not (job.is_pending and job.held), f"job {job_id} left held"
    finally:
        agent.stop()


@pytest.mark.resilience("agent SIGKILLed at a random point, 3 times in a row, under load",
                        "every recommendation reconciles; one requeue per decision; no job "
                        "left held", runs=3)
def test_agent_killed_three_times_under_load(devcluster, submit, tmp_path, cleanup,
                                             record_property, resilience_run):
    # each repetition kills at other points (the seed moves with the repetition)
    result = _kill_loop(devcluster, submit, tmp_path, cleanup, kills=3,
                        seed=3 + 1000 * (resilience_run - 1))
    record_property("runs", 3)
    try:
        _assert_reconciled(devcluster, result)
    finally:   # with the agent stopped: nothing of this run left for the next one's agent
        submit.retire()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.resilience("agent SIGKILLed at a random point, 20 times in a row, under load",
                        "every recommendation reconciles; one requeue per decision; no job "
                        "left held", runs=20)
def test_agent_killed_twenty_times_under_load(devcluster, submit, tmp_path, cleanup,
                                              record_property, resilience_run):
    result = _kill_loop(devcluster, submit, tmp_path, cleanup, kills=20,
                        seed=20 + 1000 * (resilience_run - 1))
    record_property("runs", 20)
    try:
        _assert_reconciled(devcluster, result)
    finally:
        submit.retire()

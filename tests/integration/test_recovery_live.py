"""Issue 5 live: decide and act on the dev cluster, end to end.

Each test submits real jobs, injects a real-format fault, and checks what the
agent decided (its store) and what happened in Slurm (squeue/sinfo). Every
agent here writes its own store file, so budgets, strikes and lemon scores
never leak from one scenario to the next.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recovery_agent.errors import SchedulerError
from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import AgentProcess, job_row, wait_for

pytestmark = pytest.mark.live
REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
FINAL = ("done", "failed", "expired", "would_have", "blocked_by_budget",
         "released_by_watchdog")


# -- helpers -------------------------------------------------------------------------

def recs(agent, job_pk: int, scope: str | None = None) -> list[dict]:
    rows = agent.query("select id, action, status, exclude, rule, error, target_nodes, scope, "
                       "mode, attempt from recommendations where job = ? order by id", job_pk)
    out = [dict(zip(("id", "action", "status", "exclude", "rule", "error", "targets",
                     "scope", "mode", "attempt"), r)) for r in rows]
    for r in out:
        r["exclude"] = json.loads(r["exclude"] or "[]")
        r["targets"] = json.loads(r["targets"] or "[]")
    return [r for r in out if scope is None or r["scope"] == scope]


def final_rec(agent, job_pk: int, timeout: float = 60, attempt: int | None = None) -> dict:
    def ready():
        found = [r for r in recs(agent, job_pk, "job")
                 if r["status"] in FINAL and (attempt is None or r["attempt"] == attempt)]
        return found[0] if found else None
    return wait_for(ready, timeout, f"a final job recommendation for job row {job_pk}")


def steps(agent, rec_id: int, state: str = "ok") -> list[str]:
    return [r[0] for r in agent.query("select step from rec_steps where rec = ? and state = ? "
                                      "order by id", rec_id, state)]


def job_now(sched, job_id: str):
    try:
        return sched.get_job(job_id)
    except SchedulerError:
        return None


def running_again(sched, job_id: str, restarts: int = 1):
    job = job_now(sched, job_id)
    return job if job and job.state == "RUNNING" and job.restart_count == restarts else None


def train_job(submit, devcluster, tmp_path, env: str, steps_: int = 400) -> tuple[str, Path]:
    ckpt = devcluster.lay.jobs / f"ckpt-{tmp_path.parent.name}-{tmp_path.name}"  # unique per run
    ckpt.mkdir(exist_ok=True)
    xid_log = str(devcluster.lay.kernel_log("NODE")).replace("NODE", "{node}")
    script = (f"srun --kill-on-bad-exit=1 {sys.executable} {TRAIN} --ckpt-dir {ckpt} "
              f"--steps {steps_} --step-time 0.1 --ckpt-every 20 --xid-log {xid_log}")
    # the output's name is this test's own: after slurmctld loses its state (the
    # fault tests) a job id comes again, and an appended train-%j.out would hold
    # the earlier job's lines
    name = f"train-{tmp_path.parent.name}-{tmp_path.name}"
    job_id = submit("-N2", "--ntasks-per-node=1", "--open-mode=append", "--requeue",
                    f"--recovery={env}", "-o", f"{name}-%j.out", script=script)
    return job_id, devcluster.lay.jobs / f"{name}-{job_id}.out"


def output_has(path: Path, text: str, count: int = 1) -> bool:
    try:
        return path.read_text(errors="replace").count(text) >= count
    except OSError:
        return False


def second_node(sched, job_id: str) -> tuple[object, str]:
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j,
                   60, f"job {job_id} RUNNING")
    return job, job.nodes[1]


def xid_under_job(submit, devcluster, tmp_path, cleanup, agent, env: str = "act",
                  checkpoints: int = 1) -> tuple[str, Path, str]:
    """A 2-node training job that gets XID 79 on its second node once it has
    checkpointed; returns (job id, output file, the faulted node)."""
    job_id, out = train_job(submit, devcluster, tmp_path, env)
    _, bad = second_node(devcluster.scheduler(), job_id)
    cleanup.append((bad, agent))
    wait_for(lambda: output_has(out, "checkpoint saved:", checkpoints), 60,
             f"{checkpoints} checkpoint(s)")
    inject_xid(devcluster.lay, bad, 0, 79)
    return job_id, out, bad


@pytest.fixture(scope="module")
def act_agent(devcluster, tmp_path_factory):
    a = AgentProcess(devcluster, db=tmp_path_factory.mktemp("act") / "recovery.db")
    a.start()
    yield a
    a.stop()


def own_agent(devcluster, tmp_path, **env) -> AgentProcess:
    return AgentProcess(devcluster, db=tmp_path / "recovery.db", env=env)


# -- 1 and 2: a GPU falls off the bus ---------------------------------------------------

def test_xid_requeues_without_the_node_drains_it_and_resumes(act_agent, submit, devcluster,
                                                              tmp_path, cleanup):
    sched = devcluster.scheduler()
    job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, act_agent,
                                     checkpoints=2)

    row = job_row(act_agent, job_id)
    rec = final_rec(act_agent, row[0])
    assert (rec["action"], rec["status"], rec["rule"]) == ("requeue_exclude", "done",
                                                           "hardware")
    assert rec["exclude"] == [bad]
    assert steps(act_agent, rec["id"]) == ["requeue_hold", "exclude", "start_now", "release"]
    again = wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
    assert bad not in again.nodes and again.excluded_nodes == (bad,)
    node = sched.get_node(bad)
    (drain,) = recs(act_agent, row[0], "node")
    assert drain["status"] == "done" and node.drained
    # the reason fits sinfo -R's REASON column whole; the store keeps the full one
    assert node.reason == f"rcv:xid79 #{drain['id']}"
    listed = devcluster.runner().run(["sinfo", "-R", "-h", "-n", bad, "-o", "%20E"]).stdout
    assert listed.strip() == node.reason
    ((full,),) = act_agent.query("select drain_reason from nodes where name = ?", bad)
    assert full.startswith(f"recovery #{drain['id']} ") and "xid 79" in full.lower()
    assert full.endswith(f", job {job_id}")
    wait_for(lambda: output_has(out, "resuming from checkpoint", 2), 60,
             "both ranks resuming from the checkpoint")


def test_monitor_mode_records_would_have_and_leaves_slurm_alone(act_agent, submit,
                                                                devcluster, tmp_path, cleanup):
    sched = devcluster.scheduler()
    job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, act_agent,
                                     env="act:monitor")
    row = job_row(act_agent, job_id)
    rec = final_rec(act_agent, row[0])
    assert (rec["action"], rec["status"], rec["mode"]) == ("requeue_exclude", "would_have",
                                                           "monitor")
    assert rec["exclude"] == [bad]
    assert [r["status"] for r in recs(act_agent, row[0], "node")] == ["would_have"]
    assert steps(act_agent, rec["id"], "started") == []
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.is_finished and j, 30,
                   "the job to stay ended")
    assert job.state == "FAILED" and job.restart_count == 0
    assert not sched.get_node(bad).drained


# -- 3 and 4: hang and application error ----------------------------------------------

def test_nccl_timeout_hang_is_killed_and_requeued(act_agent, submit, devcluster):
    sched = devcluster.scheduler()
    # the second attempt keeps making progress (silence would be a hang again)
    script = ('if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then for i in $(seq 60); do '
              'echo "step $i resumed"; sleep 1; done; exit 0; fi; '
              'echo "step 1 loss 2.0"; echo "step 2 loss 1.9"; '
              'echo "[Rank 1] Watchdog caught collective operation timeout: '
              'WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, '
              'Timeout(ms)=600000) ran for 600010 milliseconds before timing out."; sleep 300')
    job_id = submit("-N1", "--requeue", "--open-mode=append", "--recovery=act,hang=6s",
                    "-o", "nccl-hang-%j.out", script=script)
    row = wait_for(lambda: job_row(act_agent, job_id), 30, "job registered")
    rec = final_rec(act_agent, row[0], timeout=60)
    assert (rec["action"], rec["status"], rec["rule"]) == ("kill_requeue", "done", "hang")
    assert "requeue_hold" in steps(act_agent, rec["id"])
    wait_for(lambda: running_again(sched, job_id), 60, "the job running again")


def test_python_key_error_stops_without_requeue(act_agent, submit, devcluster):
    sched = devcluster.scheduler()
    script = f"{sys.executable} -c \"print('step 1 loss 2.0'); d = {{}}; d['missing']\""
    job_id = submit("-N1", "--requeue", "--recovery=act", "-o", "keyerror-%j.out",
                    script=script)
    row = wait_for(lambda: job_row(act_agent, job_id), 30, "job registered")
    rec = final_rec(act_agent, row[0])
    assert (rec["action"], rec["status"], rec["rule"]) == ("stop", "done", "application")
    assert steps(act_agent, rec["id"], "started") == []
    job = sched.get_job(job_id)
    assert job.state == "FAILED" and job.restart_count == 0


# -- 5: no progress -------------------------------------------------------------------

@pytest.fixture
def patient_agent(act_agent, devcluster, tmp_path):
    """An agent whose 'patient' environment allows as many unexplained requeues
    as restarts, so that the checkpoint-progress guard is what stops a job (it
    takes the module agent's port for the test)."""
    config = tmp_path / "recovery.toml"
    config.write_text(devcluster.lay.agent_config.read_text()
                      + '[environments.patient]\nmode = "action"\nmax_restarts = 6\n'
                        'unknown_max_restarts = 6\n')
    act_agent.stop()
    agent = AgentProcess(devcluster, db=tmp_path / "recovery.db")
    agent.config = config
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        act_agent.start()


def test_three_attempts_without_a_new_checkpoint_stop(patient_agent, submit, devcluster,
                                                      tmp_path):
    act_agent = patient_agent
    sched = devcluster.scheduler()
    ckpt = devcluster.lay.jobs / f"never-{tmp_path.parent.name}-{tmp_path.name}"  # unique per run
    ckpt.mkdir()
    # each attempt times out at another collective: a hang at the same one twice
    # is stopped as recurring before this guard (test_families_live.py)
    script = ('echo "attempt ${SLURM_RESTART_COUNT:-0}"; echo "step 1 loss 2.0"; '
              'echo "[Rank 0] Watchdog caught collective operation timeout: '
              'WorkNCCL(SeqNum=$((3 + ${SLURM_RESTART_COUNT:-0})), OpType=ALLREDUCE, NumelIn=1, '
              'NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before timing '
              'out."; exit 1')
    job_id = submit("-N1", "--requeue", "--open-mode=append",
                    f"--recovery=patient,max-restarts=6,ckpt={ckpt}", "-o", "noprog-%j.out",
                    script=script)
    row = wait_for(lambda: job_row(act_agent, job_id), 30, "job registered")
    stop = final_rec(act_agent, row[0], timeout=120, attempt=2)
    assert (stop["action"], stop["rule"]) == ("stop", "no_progress")
    earlier = [r for r in recs(act_agent, row[0], "job") if r["attempt"] < 2]
    assert [(r["action"], r["status"]) for r in earlier][:1] == [("requeue", "done")]
    # the second failure on the same single node may exclude it (a failure naming
    # no node, repeated where the attempts share one node: issue 15's cross-attempt
    # reading); either way it was requeued, and the guard stops the third
    assert [(r["action"], r["status"]) for r in earlier][1:] in (
        [("requeue", "done")], [("requeue_exclude", "done")])
    job = sched.get_job(job_id)
    assert job.is_finished and job.restart_count == 2


# -- 6: arrays ------------------------------------------------------------------------

def test_only_the_failed_array_task_is_requeued(act_agent, submit, devcluster):
    sched = devcluster.scheduler()
    script = ('if [ "$SLURM_ARRAY_TASK_ID" = 3 ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then '
              'echo "step 1"; echo "[Rank 0] Watchdog caught collective operation timeout: '
              'WorkNCCL(SeqNum=3, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, '
              'Timeout(ms)=600000) ran for 600010 milliseconds before timing out."; exit 1; '
              'fi; sleep 20')
    array_id = submit("-N1", "--array=0-5", "--requeue", "--open-mode=append",
                      "--recovery=act", "-o", "arr-%A_%a.out", script=script)
    task3 = f"{array_id}_3"
    row = wait_for(lambda: job_row(act_agent, task3), 60, "task 3 registered")
    rec = final_rec(act_agent, row[0])
    assert (rec["action"], rec["status"]) == ("requeue", "done")
    assert agent_job_ids(act_agent, rec["id"]) == [task3]
    wait_for(lambda: (j := job_now(sched, task3)) and j.restart_count == 1, 30,
             "task 3 requeued")
    others = [j for j in sched.list_jobs() if j.array_job_id == int(array_id)
              and j.array_task_id is not None and j.array_task_id != 3]
    assert others and all(j.restart_count == 0 for j in others)
    assert all(r["job_id"] == task3 for r in all_recs_of_array(act_agent, array_id))
    shown = subprocess.run([str(Path(sys.executable).parent / "recovery-ctl"), "show", "job",
                            array_id, "--db", str(act_agent.db), "--json"],
                           env=act_agent.environ(), capture_output=True, text=True, timeout=60)
    grouped = json.loads(shown.stdout)
    by_task = {t["job_id"]: t for t in grouped["tasks"]}
    assert task3 in by_task and by_task[task3]["recommendations"][0].endswith("requeue done")
    assert all(not t["recommendations"] for k, t in by_task.items() if k != task3)


def agent_job_ids(agent, rec_id: int) -> list[str]:
    return [r[0] for r in agent.query("select job_id from recommendations where id = ?",
                                      rec_id)]


def all_recs_of_array(agent, array_id: str) -> list[dict]:
    rows = agent.query("select r.job_id from recommendations r join jobs j on r.job = j.id "
                       "where j.array_job_id = ?", int(array_id))
    return [{"job_id": r[0]} for r in rows]


# -- 7 and 8: the agent dies mid-recovery ---------------------------------------------

@pytest.mark.resilience("agent SIGKILLed mid-recovery, after each step",
                        "a new agent finishes it: one requeue, the exclusion applied, the job running again")
@pytest.mark.parametrize("crash_after", ["requeue_hold", "exclude", "start_now"])
def test_agent_killed_mid_actuation_requeues_exactly_once(act_agent, submit, devcluster,
                                                          tmp_path, cleanup, crash_after):
    act_agent.stop()   # this test runs its own agents on the same port
    try:
        sched = devcluster.scheduler()
        dying = own_agent(devcluster, tmp_path, STEP_FAULTS_CRASH_AFTER=crash_after)
        dying.start()
        job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, dying)
        assert dying.wait_dead(60) == -9            # SIGKILL, right after the step
        again = own_agent(devcluster, tmp_path)     # same store: a restart
        again.start()
        try:
            row = job_row(again, job_id)
            rec = final_rec(again, row[0])
            assert (rec["status"], rec["exclude"]) == ("done", [bad])
            assert steps(again, rec["id"]).count("requeue_hold") == 1
            job = wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
            assert job.restart_count == 1 and job.excluded_nodes == (bad,)
            assert bad not in job.nodes
        finally:
            again.stop()
    finally:
        act_agent.start()


@pytest.mark.resilience("agent dead while a job is held",
                        "recovery-ctl watchdog releases it after the decision timeout; audited")
def test_watchdog_releases_a_held_job_while_the_agent_is_down(act_agent, submit, devcluster,
                                                              tmp_path, cleanup):
    act_agent.stop()
    try:
        sched = devcluster.scheduler()
        dying = own_agent(devcluster, tmp_path, STEP_FAULTS_CRASH_AFTER="requeue_hold",
                          RECOVERY_POLICY_DECISION_TIMEOUT="3s")
        dying.start()
        job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, dying)
        assert dying.wait_dead(60) == -9
        held = wait_for(lambda: (j := job_now(sched, job_id)) and j.is_pending and j.held and j,
                        30, "the job held by our requeue")
        assert held.restart_count == 1
        ctl = [str(Path(sys.executable).parent / "recovery-ctl"), "watchdog"]
        result = wait_for(lambda: (r := subprocess.run(ctl, env=dying.environ(),
                                                       capture_output=True, text=True,
                                                       timeout=60)) and
                          "released job" in r.stdout and r, 30, "the watchdog's release")
        assert f"released job {job_id}" in result.stdout
        wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
        statuses = dying.query("select status from recommendations where scope = 'job'")
        assert statuses == [("released_by_watchdog",)]
    finally:
        act_agent.start()


# -- 9: the blast-radius budget -------------------------------------------------------

def test_drain_budget_blocks_the_second_drain(act_agent, submit, devcluster, tmp_path,
                                              cleanup):
    act_agent.stop()
    budget = own_agent(devcluster, tmp_path, RECOVERY_POLICY_MAX_DRAINS_PER_HOUR="1")
    budget.start()
    try:
        sched = devcluster.scheduler()
        first = None
        for n in range(2):
            job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, budget)
            row = job_row(budget, job_id)
            rec = final_rec(budget, row[0])
            assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
            (drain,) = recs(budget, row[0], "node")
            if n == 0:
                first = bad
                assert drain["status"] == "done" and sched.get_node(bad).drained
            else:
                assert drain["status"] == "blocked_by_budget"
                assert "max_drains_per_hour" in drain["error"]
                if bad != first:
                    assert not sched.get_node(bad).drained
            submit.runner.run(["scancel", job_id], check=False)
    finally:
        budget.stop()
        act_agent.start()


# -- slurmctld stops answering mid-recovery -------------------------------------------

@pytest.mark.resilience("slurmctld frozen (SIGSTOP) 30 s mid-recovery",
                        "nothing done while blind; finished once it answers; one requeue")
def test_slurmctld_stopped_30s_mid_recovery_waits_then_finishes(act_agent, submit, devcluster,
                                                                tmp_path, cleanup):
    """The agent dies right after its requeue-hold; slurmctld then freezes for 30 s
    (SIGSTOP) while a new agent starts on the same store. The new agent must wait,
    do nothing on what it cannot see, and finish the recovery once slurmctld is back."""
    import os
    import signal
    import time

    act_agent.stop()
    ctld = next(d for d in devcluster.daemons() if d.name == "slurmctld")
    frozen = False
    try:
        sched = devcluster.scheduler()
        slow = {"RECOVERY_POLICY_DECISION_TIMEOUT": "150s"}
        dying = own_agent(devcluster, tmp_path, STEP_FAULTS_CRASH_AFTER="requeue_hold",
                          **slow)
        dying.start()
        job_id, out, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, dying)
        assert dying.wait_dead(60) == -9
        wait_for(lambda: (j := job_now(sched, job_id)) and j.is_pending and j.held, 30,
                 "the job held by our requeue")
        os.kill(ctld.pid, signal.SIGSTOP)
        frozen, stopped_at = True, time.monotonic()
        again = own_agent(devcluster, tmp_path, **slow)
        again.start()
        try:
            time.sleep(max(0.0, 30 - (time.monotonic() - stopped_at)))
            row = job_row(again, job_id)
            (rec,) = recs(again, row[0], "job")
            assert rec["status"] == "executing"           # nothing done while blind
            assert steps(again, rec["id"], "failed") == []
            os.kill(ctld.pid, signal.SIGCONT)
            frozen = False
            rec = final_rec(again, row[0], timeout=90)
            assert (rec["status"], rec["exclude"]) == ("done", [bad])
            assert steps(again, rec["id"]).count("requeue_hold") == 1
            assert steps(again, rec["id"], "failed") == []
            job = wait_for(lambda: running_again(sched, job_id), 60, "the job running again")
            assert bad not in job.nodes
        finally:
            again.stop()
    finally:
        if frozen:
            os.kill(ctld.pid, signal.SIGCONT)
        act_agent.start()

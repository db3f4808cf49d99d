"""The goodput ledger (issue 19) on timelines recorded the way the agent
records them: jobs and attempts through the store's writers, recommendations
with their failure/detected times, steps and running-again time, checkpoints
as the watch loop notes them, GPU counts from the prolog reports. Times are
offsets from T (now, so that the attempts read as seen at their start)."""
from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from click.testing import CliRunner

from recovery_agent.config import from_mapping
from recovery_agent.detect import ledger
from recovery_agent.detect.ledger import (Assumptions, AttemptRecord, DecisionRecord,
                                          JobRecord, SavedCheckpoint)
from recovery_agent.interfaces import ledger as gather
from recovery_agent.interfaces.ctl import main
from recovery_agent.interfaces.service import Service
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store

T = float(int(time.time()))
CFG = from_mapping({"agent": {"cluster": "c1"}})


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "r.db")
    yield s
    s.close()


def _attempt(store, job_id, restarts, start, end, state, nodes=("node1", "node2"),
             user="ana", env="prod", submit=1000, gpus=4, **extra) -> int:
    job = Job(job_id=job_id, numeric_id=int(job_id.split("_")[0]), submit_time=submit,
              user=user, name="train", state=state, restart_count=restarts, nodes=nodes,
              start_time=None if start is None else int(start),
              end_time=None if end is None else int(end), **extra)
    with store.lock:
        pk = store.record_job(job, "c1", env=env, spec=env)
        store.record_attempt(pk, job)
    for node in nodes if gpus else ():
        if store.report_by_id(f"{job_id}-{submit}-{restarts}-{node}"):
            continue     # the same attempt listed again
        store.add_report({"report_id": f"{job_id}-{submit}-{restarts}-{node}", "hook": "prolog",
                          "node": node, "job": pk, "attempt": restarts,
                          "received": (start or T) + 1, "gpu_count": gpus})
    return pk


def _ckpt(store, pk, attempt, step, when) -> None:
    store.set_attempt_checkpoint(pk, attempt, f"/ck/step_{step}.pt", step, when)
    store.add_event(pk, "checkpoint", f"checkpoint /ck/step_{step}.pt step {step}",
                    attempt=attempt, source="ckpt", ts=when + 3,
                    data={"path": f"/ck/step_{step}.pt", "step": step, "time": when})


def _rec(store, pk, attempt, action, category, failure, detected, mode="action",
         status="done", nodes=(), acted=None, running_again=None, rule="node") -> int:
    row = store.job(pk)
    rec = store.add_recommendation({
        "job": pk, "attempt": attempt, "job_id": row["job_id"], "cluster": "c1",
        "env": row["env"], "mode": mode, "action": action, "rule": rule,
        "reason_category": category, "target_nodes": list(nodes), "exclude": list(nodes),
        "status": status, "failure_at": failure, "detected_at": detected,
        "restart_at": attempt, "user": row["user"], "scope": "job", "created": detected})
    if acted is not None:
        store.add_step(rec, "requeue_hold", "started", ts=acted)
        store.add_step(rec, "requeue_hold", "ok", ts=acted + 1)
    if running_again is not None:
        store.mark_running_again(pk, attempt, running_again)
    return rec


def _xid_recovery(store, mode="action") -> int:
    """Job 4410 on node1+node2 (4 GPUs each): checkpoints at +100 and +200, an
    XID on node2 at +250, requeued without node2, running again at +290,
    completed at +600 with a checkpoint at +400."""
    pk = _attempt(store, "4410", 0, T, T + 252, "FAILED")
    _ckpt(store, pk, 0, 100, T + 100)
    _ckpt(store, pk, 0, 200, T + 200)
    status = "would_have" if mode == "monitor" else "done"
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255, mode=mode,
         status=status, nodes=("node2",), acted=T + 256 if mode == "action" else None,
         running_again=T + 290, rule="hardware")
    _attempt(store, "4410", 1, T + 290, T + 600, "COMPLETED", nodes=("node1", "node3"),
             submit=1001)
    _ckpt(store, pk, 1, 300, T + 400)
    return pk


def _summary(store, pk, cfg=CFG):
    return gather.job_summary(store, cfg, store.job(pk))


# -- recorded timelines ----------------------------------------------------------
def test_xid_recovery(store):
    pk = _xid_recovery(store)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["outcome"] == "recovered" and inc["category"] == "gpu_hardware"
    assert (inc["failure"], inc["detected"], inc["acted"], inc["running_again"]) == \
        (T + 250, T + 255, T + 256, T + 290)
    assert inc["gpus"] == 8 and inc["work_lost_s"] == 50 and inc["downtime_s"] == 40
    assert inc["gpu_s_lost"] == 8 * 90
    # plain Slurm: noticed at the end (+2 s), requeue delay, and the node kept: one more
    # attempt as long as this one ran (250 s) and one more delay
    assert inc["plain_downtime_s"] == 2 + 120 + 250 + 120
    assert inc["saved_s"] == 492 - 40 and inc["gpu_s_saved"] == 8 * 452
    assert not inc["would_have"] and inc["nodes"] == ["node2"]


def test_without_the_repeat_assumption_only_the_delay_counts(store):
    pk = _xid_recovery(store)
    cfg = from_mapping({"agent": {"cluster": "c1"}, "ledger": {"repeat_on_node": False,
                                                               "requeue_delay": "60s"}})
    (inc,) = _summary(store, pk, cfg)["detail"]
    assert inc["plain_downtime_s"] == 2 + 60 and inc["saved_s"] == 62 - 40


def test_monitor_mode_counts_what_acting_would_have_saved(store):
    pk = _attempt(store, "4411", 0, T, T + 252, "NODE_FAIL")
    _ckpt(store, pk, 0, 200, T + 200)
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255, mode="monitor",
         status="would_have", nodes=("node2",))
    # Slurm requeued it itself; it ran again 10 minutes later
    _attempt(store, "4411", 1, T + 850, T + 900, "COMPLETED", submit=1001)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["would_have"] and inc["downtime_s"] == 600
    assert inc["saved_s"] == 600 - (5 + 30)      # detected 5 s after, running 30 s later
    out = gather.report(store, CFG, T - 10, T + 1000)["groups"]["all"]
    assert out["gpu_hours_saved"] == 0
    assert out["would_have_gpu_hours_saved"] == pytest.approx(8 * 565 / 3600)


def test_hang_kill_and_requeue(store):
    pk = _attempt(store, "4412", 0, T, T + 700, "CANCELLED")
    _ckpt(store, pk, 0, 50, T + 100)
    _rec(store, pk, 0, "kill_requeue", "hang", T + 400, T + 690, acted=T + 695,
         running_again=T + 760, rule="hang")
    _attempt(store, "4412", 1, T + 760, T + 2000, "RUNNING", submit=1001)
    _ckpt(store, pk, 1, 80, T + 1500)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["outcome"] == "recovered"           # a checkpoint beyond step 50
    assert inc["work_lost_s"] == 300 and inc["downtime_s"] == 360
    assert inc["saved_s"] is None and "hang_noticed_after_s" in inc["unknown"]["saved"]
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "ledger": {"hang_noticed_after": "2h"}})
    (inc,) = _summary(store, pk, cfg)["detail"]
    assert inc["plain_downtime_s"] == 7200 + 120 and inc["saved_s"] == 7320 - 360


def test_no_progress_stop(store):
    """Three attempts end at the same step; the third is stopped: the two
    requeues before it are given up on, the stop is a stop (no saving)."""
    pk = None
    for n in range(3):
        start = T + n * 400
        pk = _attempt(store, "4413", n, start, start + 300, "FAILED", submit=1000 + n)
        _ckpt(store, pk, n, 100, start + 100)
        action = "stop" if n == 2 else "requeue"
        _rec(store, pk, n, action, "unknown", start + 300, start + 302, acted=start + 303,
             running_again=start + 400 if n < 2 else None,
             rule="no_progress" if n == 2 else "unknown")
    found = _summary(store, pk)["detail"]
    assert [i["outcome"] for i in found] == ["given_up", "given_up", "stopped"]
    assert found[2]["saved_s"] == 0 and found[2]["unknown"]["downtime"] == \
        "the job did not run again"
    groups = gather.report(store, CFG, T - 10, T + 2000)["groups"]
    assert (groups["all"]["given_up"], groups["all"]["stopped"]) == (2, 1)


def test_array_task_is_its_own_job(store):
    pk = _attempt(store, "500_3", 0, T, T + 252, "FAILED", array_job_id=500,
                  array_task_id=3)
    _ckpt(store, pk, 0, 10, T + 200)
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 251,
         nodes=("node2",), running_again=T + 280)
    _attempt(store, "500_3", 1, T + 280, T + 400, "COMPLETED", submit=1001,
             array_job_id=500, array_task_id=3)
    other = _attempt(store, "500_4", 0, T, T + 400, "COMPLETED", array_job_id=500,
                     array_task_id=4, user="bob")
    service = Service(CFG, store)
    assert service.job_goodput("500_3")["incidents"] == 1
    assert service.job_goodput("500_4")["incidents"] == 0
    assert other != pk
    by_user = service.goodput(T - 10, T + 1000, "user")["groups"]
    assert by_user["ana"]["incidents"] == 1 and by_user["bob"]["incidents"] == 0
    assert by_user["bob"]["ettr"] == 1.0


def test_job_id_reuse_keeps_histories_apart(store):
    old = _xid_recovery(store)
    new = _attempt(store, "4410", 0, T + 5000, T + 6000, "COMPLETED", submit=9000)
    assert new != old
    assert Service(CFG, store).job_goodput("4410")["incidents"] == 0
    assert _summary(store, old)["incidents"] == 1
    assert gather.report(store, CFG, T - 10, T + 7000)["groups"]["all"]["incidents"] == 1


def test_by_category_and_node(store):
    _xid_recovery(store)
    by_cat = gather.report(store, CFG, T - 10, T + 1000, "category")["groups"]
    assert list(by_cat) == ["gpu_hardware"] and by_cat["gpu_hardware"]["recovered"] == 1
    assert by_cat["gpu_hardware"]["mttr_median_s"] == 40
    by_node = gather.report(store, CFG, T - 10, T + 1000, "node")["groups"]
    assert list(by_node) == ["node2"]


def test_window_leaves_out_older_incidents(store):
    _xid_recovery(store)
    assert gather.report(store, CFG, T + 260, T + 1000)["groups"]["all"]["incidents"] == 0


def test_ettr_of_the_xid_job(store):
    _xid_recovery(store)
    g = gather.report(store, CFG, T - 10, T + 1000)["groups"]["all"]
    allocated = 8 * (252 + 310) + 8 * 40        # run time, plus the downtime it waited
    assert g["ettr"] == pytest.approx((allocated - 720) / allocated)
    assert g["ettr_jobs"] == 1 and g["gpu_hours_lost"] == pytest.approx(720 / 3600)


# -- each unknown, honestly -----------------------------------------------------
def test_missing_checkpoint_is_unknown_not_zero(store):
    # the attempt starts now: the agent saw it at its start (T was taken at import)
    T = float(int(time.time()))
    pk = _attempt(store, "4420", 0, T, T + 252, "FAILED")
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 290)
    _attempt(store, "4420", 1, T + 290, T + 600, "COMPLETED", submit=1001)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["work_lost_s"] is None and inc["gpu_s_lost"] is None
    assert inc["unknown"]["work_lost"] == "no checkpoint seen before the failure"
    assert inc["downtime_s"] == 40 and inc["outcome"] == "recovered"
    g = gather.report(store, CFG, T - 10, T + 1000)["groups"]["all"]
    assert g["unknown_lost"] == 1 and g["gpu_hours_lost"] == 0
    assert g["ettr"] is None and g["ettr_unknown_jobs"] == 1


def test_clock_jump_gives_nothing_made_up(store):
    pk = _attempt(store, "4421", 0, T, T + 252, "FAILED")
    _ckpt(store, pk, 0, 200, T + 200)
    # running again recorded before the failure: a clock went backwards
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 100)
    (inc,) = _summary(store, pk)["detail"]
    assert "times" in inc["unknown"]
    assert inc["work_lost_s"] is None and inc["downtime_s"] is None
    assert inc["saved_s"] is None and inc["gpu_s_lost"] is None


def test_attempt_without_an_end(store):
    pk = _attempt(store, "4422", 0, T, None, "NODE_FAIL")
    (inc,) = _summary(store, pk)["detail"]
    assert inc["failure"] is None and "failure" in inc["unknown"]
    assert inc["work_lost_s"] is None and inc["downtime_s"] is None


def test_job_that_ran_before_the_agent(store):
    """Registered at its third attempt, which had started an hour before the
    agent saw it: the two attempts before are unknown incidents, and the
    third's work lost is unknown (its checkpoints before then were not seen)."""
    pk = _attempt(store, "4423", 2, T - 3600, T + 10, "FAILED")
    _rec(store, pk, 2, "requeue", "unknown", T + 5, T + 12, running_again=T + 60)
    _attempt(store, "4423", 3, T + 60, T + 100, "COMPLETED", submit=1001)
    found = _summary(store, pk)["detail"]
    assert [i["attempt"] for i in found] == [0, 1, 2]
    assert all(i["outcome"] == "unknown" and i["unknown"] for i in found[:2])
    assert "before the agent watched it" in found[2]["unknown"]["work_lost"]
    g = gather.report(store, CFG, T - 7200, T + 1000)["groups"]["all"]
    assert g["incidents"] == 3 and g["unknown"] == 2 and g["unknown_lost"] == 3


def test_no_gpu_report_leaves_gpu_figures_unknown(store):
    pk = _attempt(store, "4424", 0, T, T + 252, "FAILED", gpus=0)
    _ckpt(store, pk, 0, 200, T + 200)
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 290)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["work_lost_s"] == 50 and inc["gpus"] is None and inc["gpu_s_lost"] is None
    assert inc["saved_s"] is not None and inc["gpu_s_saved"] is None


# -- the pure core on its own ---------------------------------------------------
def test_percentiles_nearest_rank():
    values = [float(v) for v in range(1, 21)]
    assert ledger.percentile(values, 0.95) == 19 and ledger.median(values) == 10.5
    assert ledger.percentile([], 0.95) is None and ledger.median([7.0]) == 7.0


def test_checkpoint_of_an_earlier_attempt_counts_from_this_start():
    job = JobRecord("9", "prod", "ana", "COMPLETED",
                    attempts=(AttemptRecord(0, 0.0, 100.0, "FAILED", gpus=2),
                              AttemptRecord(1, 160.0, 300.0, "FAILED", gpus=2),
                              AttemptRecord(2, 400.0, 500.0, "COMPLETED", gpus=2)),
                    decisions=(DecisionRecord(1, "requeue", "unknown", "action", "done",
                                              failure=290.0, running_again=400.0),),
                    checkpoints=(SavedCheckpoint(50.0, 5, 0),))
    found = ledger.incidents(job, Assumptions())
    assert [i.attempt for i in found] == [0, 1]
    assert found[0].work_lost_s == 50 and found[1].work_lost_s == 290 - 160


# -- the command line -------------------------------------------------------------
def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def ctl(store, tmp_path):
    """recovery-ctl's arguments for this store (cluster c1), and the window's end
    as an ISO time (T's timeline lies in the next minutes)."""
    conf = tmp_path / "r.toml"
    conf.write_text('[agent]\ncluster = "c1"\n')
    until = datetime.fromtimestamp(T + 1000).isoformat(timespec="seconds")
    return ["--config", str(conf), "--db", str(store.path)], until


def test_report_goodput_json_and_table(store, ctl):
    _xid_recovery(store)
    where, until = ctl
    data = json.loads(_run("report", "goodput", "--since", "1d", "--until", until, *where,
                           "--json").output)
    assert data["assumptions"]["requeue_delay_s"] == 120
    (inc,) = data["incidents"]
    assert inc["outcome"] == "recovered" and inc["work_lost_s"] == 50
    text = _run("--utc", "report", "goodput", "--since", "1d", "--until", until, "--by",
                "category", *where).output
    assert text.startswith("window ") and "assumptions: plain Slurm requeue delay 2 min" \
        in text and "gpu_hardware" in text
    parsable = _run("report", "goodput", "--since", "1d", "--until", until, *where, "-P",
                    "-o", "group,incidents,recovered").output.splitlines()
    assert parsable == ["GROUP|INCIDENTS|RECOVERED", "all|1|1"]


def test_show_job_prints_the_goodput_line(store, ctl):
    _xid_recovery(store)
    out = _run("show", "job", "4410", *ctl[0]).output
    assert "Goodput: 1 incident, 12 GPU-min lost, 8 min saved vs plain Slurm" in out


def test_summary_line_wording():
    from recovery_agent.interfaces.ctl.goodput import duration, summary_line
    assert duration(7500) == "2 h 05 min" and duration(45) == "45 s" and duration(None) == "-"
    line = summary_line({"incidents": 3, "gpu_s_lost": 41 * 60, "unknown_lost": 0,
                         "saved_s": 7500, "unknown_saved": 0, "would_have": False})
    assert line == "3 incidents, 41 GPU-min lost, 2 h 05 min saved vs plain Slurm"


def test_checkpoint_just_after_the_failure_is_saved_at_it(store):
    """Slurm's end time is whole seconds, a save line's time when the agent read
    it: a checkpoint 1 s after the failure lost nothing; 10 s after, unknown."""
    pk = _attempt(store, "4425", 0, T, T + 250, "FAILED")
    _ckpt(store, pk, 0, 40, T + 251)
    _rec(store, pk, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 290)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["work_lost_s"] == 0 and inc["gpu_s_lost"] == 8 * 40
    late = _attempt(store, "4426", 0, T, T + 250, "FAILED")
    _ckpt(store, late, 0, 40, T + 260)
    _rec(store, late, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 290)
    (inc,) = _summary(store, late)["detail"]
    assert inc["work_lost_s"] is None
    assert inc["unknown"]["work_lost"] == "a checkpoint of this attempt is dated after its failure"


def test_a_running_attempts_listed_end_is_not_an_end(store):
    """Slurm lists a running job's end as when its time limit falls: the
    ledger reads no end, so ETTR leaves the job out rather than count a year."""
    pk = _xid_recovery(store)
    _attempt(store, "4410", 1, T + 290, T + 365 * 86400, "RUNNING", nodes=("node1", "node3"),
             submit=1001)
    record = gather.job_record(store, store.job(pk))
    assert record.attempts[1].end is None
    g = gather.report(store, CFG, T - 10, T + 1000)["groups"]["all"]
    assert g["ettr"] is None and g["ettr_unknown_jobs"] == 1 and g["recovered"] == 1

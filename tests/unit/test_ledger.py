"""The goodput ledger (issue 19) on timelines recorded the way the agent
records them: jobs and attempts through the store's writers, recommendations
with their failure/detected times, steps and running-again time, checkpoints
as the watch loop notes them, GPU counts from the prolog reports. Times are
offsets from T (now, so that the attempts read as seen at their start)."""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone

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
    g = gather.report(store, CFG, T - 10, T + 1000, now=T + 1000)["groups"]["all"]
    assert g["ettr_unknown_jobs"] == 0 and g["recovered"] == 1
    allocated = 8 * (252 + 710 + 40)      # the running attempt up to the window's end
    assert g["ettr"] == pytest.approx((allocated - 720) / allocated)


# -- when a checkpoint was saved: the save line's own stamp ------------------------------
# each line as its trainer prints it (the sources are cited in detect/stamps.py and
# detect/steps.py)
DEMO_SAVE = "[2026-12-02T10:00:00.123Z] rank 0/2 node1 checkpoint saved: /ck/step-000040.json step=40"
NEMO_SAVE = ("[NeMo I 2025-06-18 22:03:05 nemo_logging:393] Async checkpoint save for step 5 "
             "(/home/johnsh29/Evo2_Mortierellaceae/pretraining_mortierellaceae/evo2/checkpoints/"
             "evo2--val_loss=0.0000-epoch=0-consumed_samples=5.0-last.ckpt) finalized "
             "successfully.")
TITAN_SAVE = ("[rank0]:2025-04-01 00:25:59,616 - root - INFO - Finished saving the checkpoint "
              "(or staging if async is enabled)in 5.53 seconds.")
DEEPSPEED_STEP = ("[2024-08-15 21:12:21,408] [INFO] [logging.py:96:log_dist] [Rank 0] step=600, "
                  "skipped=0, lr=[9.26050416794548e-05], mom=[(0.9, 0.999)]")


def _utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


def test_line_stamps_of_real_trainers():
    from recovery_agent.detect.stamps import line_time
    demo = _utc("2026-12-02T10:00:00.123")
    assert line_time(DEMO_SAVE, demo + 0.9) == pytest.approx(demo)
    # stamps without a zone are read in the given one (the host's by default)
    cases = [(NEMO_SAVE, "2025-06-18T22:03:05"), (TITAN_SAVE, "2025-04-01T00:25:59.616"),
             (DEEPSPEED_STEP, "2024-08-15T21:12:21.408")]
    for line, when in cases:
        assert line_time(line, _utc(when) + 1, zone=timezone.utc) == pytest.approx(_utc(when))
    local = datetime(2025, 6, 18, 22, 3, 5).timestamp()
    assert line_time(NEMO_SAVE, local + 1) == local


def test_a_stamp_that_cannot_be_the_lines_is_not_used():
    from recovery_agent.detect.stamps import line_time
    demo = _utc("2026-12-02T10:00:00.123")
    assert line_time(DEMO_SAVE, demo - 3600) is None            # after it was read
    assert line_time(DEMO_SAVE, demo + 1, earliest=demo + 60) is None   # before the start
    assert line_time("rank 0 checkpoint saved: /ck/a step=4", demo) is None   # no stamp
    # a date inside a long message (a path) is no logging prefix
    assert line_time("x" * 130 + " 2026-12-02 10:00:00 saved", demo) is None
    assert line_time("[2026-13-40 10:00:00] checkpoint saved", demo) is None


def test_a_save_line_is_dated_by_its_stamp_else_by_its_reading():
    from recovery_agent.detect.checkpoint import CheckpointWatcher
    demo = _utc("2026-12-02T10:00:00.123")
    watcher = CheckpointWatcher()
    record = watcher.feed(demo + 0.9, DEMO_SAVE, started=demo - 100)
    assert record.time == pytest.approx(demo) and record.clock == "line" and record.step == 40
    plain = watcher.feed(demo + 5, "rank 0/2 node1 checkpoint saved: /ck/step-000060.json "
                                   "step=60")
    assert plain.time == demo + 5 and plain.clock == "read"


# -- steps: the last step the log reported ----------------------------------------------
def test_step_lines_of_real_trainers():
    from recovery_agent.detect.steps import parse_step
    assert parse_step("Training epoch 0, iteration 4/9 | lr: 8e-05 | global_batch_size: 1 | "
                      "global_step: 4 | reduced_train_loss: 1.257 | train_step_timing in s: "
                      "0.3505 | consumed_samples: 5") == 4
    assert parse_step(" [2024-07-15 15:26:21] iteration       10/    1000 | consumed samples: "
                      "          80 | elapsed time per iteration (ms): 8195.9 |") == 10
    assert parse_step(DEEPSPEED_STEP) == 600
    assert parse_step("[rank0]:[titan] 2025-06-04 08:51:48,074 - root - INFO - step:  1  loss: "
                      "12.2254  memory: 27.34GiB(28.78%)  tps: 375  tflops: 21.73  mfu: 2.20%") == 1
    assert parse_step("\x1b[31mstep: 12  \x1b[32mloss:  7.1234  \x1b[33mgrad_norm:  1.0") == 12
    assert parse_step("[2026-12-02T10:00:00.123Z] rank 0/2 node1 step 40/200 loss 0.1234 "
                      "(restart 0)") == 40
    # not a step done: an evaluation, a validation pass, the step under way at a crash
    assert parse_step("\x1b[33mvalidate step: 3  \x1b[32mloss:  2.0000") is None
    assert parse_step("Validation: iteration 1/20") is None
    assert parse_step("rank 0/2 node1 step 57: CUDA error on this node's GPU") is None
    assert parse_step("Epoch 0, global step 9: 'val_loss' reached 1.26396 (best 1.26396)") is None


def test_step_counter_keeps_the_last_step_not_the_highest():
    from recovery_agent.detect.steps import StepCounter
    counter = StepCounter()
    counter.feed(100.0, "rank 0/2 node1 step 40/200 loss 0.1 (restart 0)")
    counter.feed(101.0, "rank 0/2 node1 step 20/200 loss 0.2 (restart 0)")   # restarted
    counter.feed(102.0, "rank 0/2 node1 step 57: CUDA error on this node's GPU")
    assert (counter.last, counter.time) == (20, 101.0)


def test_steps_lost_per_incident(store):
    pk = _xid_recovery(store)
    store.set_attempt_step(pk, 0, 230, T + 249.5)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["steps_lost"] == 30 and "steps_lost" not in inc["unknown"]
    assert _summary(store, pk)["steps_lost"] == 30
    # a last step dated after the failure (beyond the slack) is not the step at it
    store.set_attempt_step(pk, 0, 260, T + 290)
    (inc,) = _summary(store, pk)["detail"]
    assert inc["steps_lost"] is None
    assert inc["unknown"]["steps_lost"] == "the last step reported is dated after the failure"


def test_steps_lost_unknown_without_a_step_line(store):
    (inc,) = _summary(store, _xid_recovery(store))["detail"]
    assert inc["steps_lost"] is None
    assert inc["unknown"]["steps_lost"] == "the log reported no step (no known step line)"
    assert _summary(store, 1)["unknown_steps"] == 1


def test_the_watch_records_stamped_checkpoints_and_the_last_step(tmp_path):
    from tests.unit.test_watch import events, job, make
    out = tmp_path / "job-77.out"
    out.write_text("[1970-01-01T00:25:00.500Z] rank 0/2 node1 step 20/100 loss 0.5000 (restart 0)\n"
                   "[1970-01-01T00:25:01.250Z] rank 0/2 node1 checkpoint saved: "
                   "/ck/step-000020.json step=20\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    with open(out, "a") as fh:
        fh.write("[1970-01-01T00:25:03.000Z] rank 0/2 node1 step 30/100 loss 0.4000 "
                 "(restart 0)\nrank 0/2 node1 step 31: CUDA error on this node's GPU\n")
    clock[0] += 2
    watcher.cycle()
    sched.jobs = [job("FAILED", str(out), exit_code=1)]
    watcher.cycle()
    clock[0] += 20
    watcher.cycle()
    (saved,) = events(store, "checkpoint")
    assert saved["data"]["time"] == 1501.25 and saved["data"]["clock"] == "line"
    (attempt,) = store.attempts(1)
    assert (attempt["last_step"], attempt["last_step_time"]) == (30, 1503.0)


# -- ETTR inside the window ------------------------------------------------------------
def test_ettr_counts_only_the_part_of_a_job_inside_the_window(store):
    _xid_recovery(store)
    g = gather.report(store, CFG, T + 100, T + 400, now=T + 2000)["groups"]["all"]
    # attempt 0 from +100 to +252, attempt 1 from +290 to +400, the 40 s downtime;
    # lost: the 50 s since the checkpoint at +200 and the downtime
    allocated = 8 * (152 + 110 + 40)
    assert g["ettr"] == pytest.approx((allocated - 8 * 90) / allocated)
    later = gather.report(store, CFG, T + 260, T + 1000, now=T + 2000)["groups"]["all"]
    assert later["incidents"] == 0         # the failure is before this window ...
    allocated = 8 * (310 + 30)             # ... but 30 s of its downtime inside it
    assert later["ettr"] == pytest.approx((allocated - 8 * 30) / allocated)


def test_a_running_attempt_counts_up_to_now(store):
    pk = _xid_recovery(store)
    _attempt(store, "4410", 1, T + 290, T + 365 * 86400, "RUNNING", nodes=("node1", "node3"),
             submit=1001)
    g = gather.report(store, CFG, T - 10, T + 86400, now=T + 400)["groups"]["all"]
    allocated = 8 * (252 + 110 + 40)
    assert g["ettr"] == pytest.approx((allocated - 720) / allocated)
    assert gather.job_record(store, store.job(pk)).attempts[1].end is None


def test_a_stopped_job_has_an_ettr(store):
    test_no_progress_stop(store)
    g = gather.report(store, CFG, T - 10, T + 2000, now=T + 3000)["groups"]["all"]
    # three attempts of 300 s, two waits of 100 s; lost: 200 s of each attempt since
    # its checkpoint, the two waits; the stopped one waited for nothing
    allocated, lost = 8 * (900 + 200), 8 * (600 + 200)
    assert g["ettr"] == pytest.approx((allocated - lost) / allocated)


# -- what later history says of our decisions ------------------------------------------
def _report_node(store, node, at, ok, job=None, attempt=None, hook="health", xids=0):
    rid = f"{node}-{at}-{hook}"
    pk = store.add_report({"report_id": rid, "hook": hook, "node": node, "job": job,
                           "attempt": attempt, "received": at, "gpu_ok": int(ok),
                           "gpu_count": 4})
    for n in range(xids):
        store.add_xid({"report": pk, "node": node, "xid": 79, "fingerprint": f"{rid}-{n}",
                       "time": at})


def test_precision_of_node_blame(store):
    """node2 (blamed by the XID recovery) fails a health check a minute later:
    confirmed. node5 (blamed by a monitor-mode decision) passes one: cleared,
    its own failed attempt's late epilog not counting against it. node7 has
    no later record: no evidence."""
    _xid_recovery(store)
    _report_node(store, "node2", T + 320, ok=False, xids=1)
    other = _attempt(store, "4430", 0, T, T + 500, "FAILED", nodes=("node5", "node7"))
    _rec(store, other, 0, "requeue_exclude", "gpu_hardware", T + 500, T + 505, mode="monitor",
         status="would_have", nodes=("node5", "node7"))
    _report_node(store, "node5", T + 507, ok=False, job=other, attempt=0, hook="epilog")
    _report_node(store, "node5", T + 900, ok=True)
    blame = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["blame"]
    verdicts = {d["node"]: d["verdict"] for d in blame["detail"]}
    assert verdicts == {"node2": "confirmed", "node5": "cleared", "node7": "no_evidence"}
    assert (blame["blames"], blame["confirmed"], blame["cleared"], blame["no_evidence"],
            blame["would_have"]) == (3, 1, 1, 1, 2)
    assert blame["precision"] == 0.5


def test_a_later_jobs_blame_confirms_and_a_completed_job_clears(store):
    _xid_recovery(store)     # node2 blamed at +255
    later = _attempt(store, "4431", 0, T + 600, T + 700, "FAILED", nodes=("node2",))
    store.add_strike("node2", "gpu_hardware", 1.0, later, "bob", ts=T + 705)
    assert gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["blame"]["confirmed"] == 1
    # outside ledger.blame_horizon it is no evidence
    cfg = from_mapping({"agent": {"cluster": "c1"}, "ledger": {"blame_horizon": "5m"}})
    assert gather.report(store, cfg, T - 10, T + 1000, now=T + 2000)["blame"]["no_evidence"] == 1


def test_a_completed_job_on_the_node_clears_it(store):
    _xid_recovery(store)
    _attempt(store, "4432", 0, T + 600, T + 900, "COMPLETED", nodes=("node2",), gpus=0)
    blame = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["blame"]
    assert blame["cleared"] == 1 and blame["precision"] == 0.0
    assert blame["detail"][0]["evidence"][0]["kind"] == "job"


def _stopped(store, job_id, command="/home/ana/train.sh", at=T + 300) -> int:
    pk = _attempt(store, job_id, 0, T, T + 290, "FAILED", command=command)
    _rec(store, pk, 0, "stop", "application", T + 290, at, rule="application")
    return pk


def test_false_stop_evidence(store):
    """4440 was stopped, resubmitted unchanged as 4441, which completed: a
    false stop. 4450's resubmission 4451 failed again (each resubmission answers
    for one stop). 4460's 'resubmission' runs another script: not the same job."""
    _stopped(store, "4440")
    _attempt(store, "4441", 0, T + 700, T + 900, "COMPLETED", submit=int(T + 650),
             command="/home/ana/train.sh")
    _stopped(store, "4450")
    _attempt(store, "4451", 0, T + 700, T + 800, "FAILED", submit=int(T + 660),
             command="/home/ana/train.sh")
    _stopped(store, "4460", command="/home/ana/other.sh")
    stops = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["false_stops"]
    by_job = {d["job_id"]: (d["verdict"], d["resubmitted_as"]) for d in stops["detail"]}
    assert by_job["4440"] == ("ran_fine", "4441")
    assert by_job["4450"] == ("failed_again", "4451")
    assert by_job["4460"] == ("not_resubmitted", None)
    assert (stops["stops"], stops["ran_fine"], stops["failed_again"],
            stops["not_resubmitted"]) == (3, 1, 1, 1)


def test_a_resubmission_too_late_or_by_another_user_is_not_one(store):
    _stopped(store, "4470")
    _attempt(store, "4471", 0, T + 99000, T + 99100, "COMPLETED", submit=int(T + 99000),
             command="/home/ana/train.sh")
    _attempt(store, "4472", 0, T + 700, T + 800, "COMPLETED", submit=int(T + 700),
             command="/home/ana/train.sh", user="bob")
    stops = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["false_stops"]
    assert [d["verdict"] for d in stops["detail"]] == ["not_resubmitted"]


def test_hindsight_rules_on_their_own():
    from recovery_agent.detect.hindsight import (Blame, NodeFact, Stop, SubmittedJob,
                                                 check_blame, check_stop)
    blame = Blame(rec=1, node="n1", time=100.0, action="drain_node", category="gpu_hardware",
                  mode="action")
    facts = [NodeFact(150.0, "report", False), NodeFact(200.0, "report", True),
             NodeFact(50.0, "report", True)]            # before the blame: not evidence
    assert check_blame(blame, facts, 3600).verdict == "confirmed"
    assert check_blame(blame, facts[:1], 3600).verdict == "cleared"
    assert check_blame(blame, facts[2:], 3600).verdict == "no_evidence"
    stopped = SubmittedJob(1, "10", "ana", "train", "", "prod", 0.0, "FAILED")
    again = SubmittedJob(2, "11", "ana", "train", "/s.sh", "prod", 500.0, "COMPLETED")
    # Slurm listed no script for the stopped job: name, user and directive decide
    found = check_stop(Stop(5, 400.0, "action", stopped), [again], 3600)
    assert found["verdict"] == "ran_fine" and not found["script_compared"]
    other_spec = SubmittedJob(3, "12", "ana", "train", "", "dev", 500.0, "COMPLETED")
    assert check_stop(Stop(5, 400.0, "action", stopped), [other_spec], 3600)["verdict"] \
        == "not_resubmitted"


# -- the command line and the API ---------------------------------------------------------
def test_report_goodput_per_incident_with_steps_lost(store, ctl):
    pk = _xid_recovery(store)
    store.set_attempt_step(pk, 0, 230, T + 249)
    where, until = ctl
    rows = _run("report", "goodput", "--since", "1d", "--until", until, *where, "--incidents",
                "-P", "-o", "job,attempt,outcome,steps_lost,work_lost").output.splitlines()
    assert rows == ["JOB|ATTEMPT|OUTCOME|STEPS_LOST|WORK_LOST", "4410|0|recovered|30|50 s"]
    text = _run("report", "goodput", "--since", "1d", "--until", until, *where).output
    assert "node blame: 1 blamed (1 node): 0 confirmed, 0 cleared, 1 without evidence; " \
           "precision unknown" in text
    assert "stops: none in the window" in text


def _serve(store, tmp_path):
    """The agent's API on a free port over ``store`` (this process's uid an
    admin, so that its unsigned local reads see every job)."""
    import os
    import threading

    import uvicorn

    from recovery_agent.inputs.ingest import Ingest
    from recovery_agent.interfaces.api import create_app
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "api": {"auth": "none", "admin_uids": str(os.getuid())}})
    server = uvicorn.Server(uvicorn.Config(create_app(cfg, Ingest(store, "c1")),
                                           host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def test_show_job_and_report_over_the_api(store, ctl, tmp_path):
    """Without --db, show job's goodput line and report goodput come from GET
    /v1/goodput."""
    _xid_recovery(store)
    conf = ctl[0][1]
    server, thread, url = _serve(store, tmp_path)
    try:
        out = _run("show", "job", "4410", "--config", conf, "--url", url).output
        assert "Goodput: 1 incident, 12 GPU-min lost, 8 min saved vs plain Slurm" in out
        since = datetime.fromtimestamp(T - 100).isoformat(timespec="seconds")
        data = json.loads(_run("report", "goodput", "--since", since, "--until", ctl[1],
                               "--config", conf, "--url", url, "--json").output)
        (inc,) = data["incidents"]
        assert inc["job_id"] == "4410" and inc["work_lost_s"] == 50
        assert data["blame"]["blames"] == 1
    finally:
        server.should_exit = True
        thread.join(10)


def test_goodput_endpoint_shows_a_user_their_own_jobs(store, monkeypatch):
    import pwd

    from fastapi.testclient import TestClient

    from recovery_agent.inputs.ingest import Ingest
    from recovery_agent.interfaces.api import create_app
    from slurm_hooks import munge
    owner = pwd.getpwuid(65534).pw_name
    mine = _attempt(store, "4480", 0, T, T + 252, "FAILED", user=owner)
    _rec(store, mine, 0, "requeue_exclude", "gpu_hardware", T + 250, T + 255,
         nodes=("node2",), running_again=T + 290)
    _xid_recovery(store)                           # ana's job 4410
    cfg = from_mapping({"agent": {"cluster": "c1"}, "api": {"auth": "munge",
                                                           "admin_uids": "0"}})
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    uid = {"cred-owner": 65534, "cred-root": 0}
    monkeypatch.setattr(munge, "verify_body", lambda cred, body, socket="": uid[cred])
    owner_h, root_h = {"Authorization": "Munge cred-owner"}, {"Authorization": "Munge cred-root"}
    window = {"since": f"{T - 100:.0f}", "until": f"{T + 1000:.0f}"}
    seen = client.get("/v1/goodput", params=window, headers=owner_h).json()
    assert [i["job_id"] for i in seen["incidents"]] == ["4480"]
    assert [d["job_id"] for d in seen["blame"]["detail"]] == ["4480"]
    everything = client.get("/v1/goodput", params=window, headers=root_h).json()
    assert sorted(i["job_id"] for i in everything["incidents"]) == ["4410", "4480"]
    assert client.get("/v1/goodput", params={"job": "4410"}, headers=owner_h).status_code == 403
    one = client.get("/v1/goodput", params={"job": "4410"}, headers=root_h).json()
    assert one["job"] == "4410" and one["summary"]["incidents"] == 1
    by_user = client.get("/v1/goodput", params={**window, "by": "user"}, headers=root_h).json()
    assert set(by_user["groups"]) == {"ana", owner}
    assert client.get("/v1/goodput", params={"by": "colour"}, headers=root_h).status_code == 422
    assert client.get("/v1/goodput", params={"since": "last week"},
                      headers=root_h).status_code == 422
    assert client.get("/v1/goodput", params={"since": "2d"}, headers=root_h).status_code == 200


def test_a_users_blame_evidence_does_not_name_other_users_jobs(store):
    """ana's job blamed node2; bob's job then completed there. ana's ledger
    counts it as clearing evidence but shows nothing of bob's job (the node
    pages show others' strikes the same way); an admin's shows its id."""
    _xid_recovery(store)                       # ana's 4410 blames node2
    _attempt(store, "4432", 0, T + 600, T + 900, "COMPLETED", nodes=("node2",), gpus=0,
             user="bob")
    mine = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000, user="ana")["blame"]
    assert mine["cleared"] == 1
    (evidence,) = mine["detail"][0]["evidence"]
    assert evidence["kind"] == "job" and "4432" not in json.dumps(mine)
    admin = gather.report(store, CFG, T - 10, T + 1000, now=T + 2000)["blame"]
    assert admin["detail"][0]["evidence"][0]["detail"] == "4432"

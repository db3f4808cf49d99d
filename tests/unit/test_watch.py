"""The watch loop's bookkeeping, with a scheduler that replays a script of
listings (the live behaviour is in tests/integration/test_watch_live.py)."""
from __future__ import annotations

from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.logs.tail import MemoryCursorStore, Tailer
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher


class Script:
    def __init__(self) -> None:
        self.jobs: list[Job] = []

    def list_jobs(self, job_ids=None):
        return list(self.jobs)


def job(state: str, out: str, restarts: int = 0, **kw) -> Job:
    base = dict(job_id="77", numeric_id=77, state=state, submit_time=1000, start_time=1001,
                nodes=("node1", "node2"), comment="recovery=prod", stdout=out, stderr=out,
                restart_count=restarts)
    base.update(kw)
    return Job(**base)


def make(tmp_path, clock):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0])
    return watcher, store, sched


def events(store, kind):
    return [e for e in store.timeline(1) if e["kind"] == kind]


def test_comment_job_is_registered_followed_and_judged(tmp_path):
    out = tmp_path / "train-77.out"
    out.write_text("step 1 loss 2.0\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    assert store.find_job("c1", "77")["env"] == "prod"
    with open(out, "a") as fh:
        fh.write("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    clock[0] += 2
    assert watcher.cycle() >= 1
    (det,) = [d for d in store.detections(1) if d["category"] == "oom"]
    assert det["evidence"]["lines"][0]["line"] == 2
    sched.jobs = [job("FAILED", str(out), exit_code=1)]
    watcher.cycle()
    assert events(store, "verdict") == []  # waiting for the nodes' epilog reports
    clock[0] += 20  # past the grace: no node reports will come here
    watcher.cycle()
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["category"] == "oom" and verdict["data"]["action"] == "stop"


def test_requeued_attempt_gets_its_own_watch_and_verdict(tmp_path):
    out = tmp_path / "o.out"
    out.write_text("")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    sched.jobs = [job("RUNNING", str(out), restarts=1, start_time=2005)]
    watcher.cycle()
    clock[0] += 30
    watcher.cycle()
    assert watcher.watches[1].attempt == 1
    assert [e["attempt"] for e in events(store, "verdict")] == [0]


def test_job_that_ran_between_polls_is_still_judged(tmp_path):
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("PENDING", "")]
    watcher.cycle()
    sched.jobs = [job("NODE_FAIL", "", exit_code=None)]
    watcher.cycle()
    watcher.cycle()
    clock[0] += 20
    watcher.cycle()
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["blame"] == "node"
    assert verdict["data"]["nodes"] == ["node1", "node2"]


def test_output_of_a_job_that_ran_between_polls_is_read(tmp_path):
    out = tmp_path / "quick-77.out"
    out.write_text("Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
                   "KeyError: 'missing'\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("PENDING", str(out))]
    watcher.cycle()
    sched.jobs = [job("FAILED", str(out), exit_code=1)]
    watcher.cycle()          # seen ended: its output is read
    clock[0] += 2
    watcher.cycle()          # the attempt closes
    clock[0] += 20
    watcher.cycle()          # no epilog reports here: the grace ends
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["blame"] == "application"


def test_log_lines_inside_node_reports_are_scanned(tmp_path):
    from recovery_agent.ingest import Ingest
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    out = tmp_path / "o.out"
    out.write_text("")
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    ingest = Ingest(store, "c1")
    ingest.log_listeners.append(watcher.report_lines)
    ingest.store_report("epilog", {
        "version": 1, "hook": "epilog", "report_id": "a" * 32, "created": 2001.0,
        "cluster": "c1", "node": "node2", "job": {"job_id": "77", "attempt": 0,
                                                  "spec": "prod"},
        "gpus": {"ok": True, "gpus": []}, "xids": [], "exit": {"code": 1},
        "log_lines": [{"text": "slurmstepd: error: Detected 1 oom_kill event in "
                               "StepId=77.0. Some of the step tasks have been OOM Killed.",
                       "source": "slurmd"}]})
    clock[0] += 2
    watcher.cycle()
    (det,) = [d for d in store.detections(1) if d["category"] == "oom"]
    assert det["source"] == "hook:node2/epilog:slurmd"

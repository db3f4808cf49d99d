"""Issue 21, first slice: a node report that brings evidence starts the watch
loop's next cycle at once, instead of at the next poll; at most one early
cycle per agent.report_wakeup_gap, and none when it is 0. A hang window that
fills before the next poll gets a cycle of its own."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.errors import ConfigError
from recovery_agent.detect.progress import HangDetector
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script, scripted_watcher
from tests.unit.test_ingest import XID79, report


class Counted(Watcher):
    """The real loop around cycles that only count themselves."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.ran = threading.Semaphore(0)
        self.count = 0

    def run_once(self) -> bool:
        self.count += 1
        self.ran.release()
        return True


def watcher(tmp_path, **agent) -> Counted:
    cfg = from_mapping({"agent": {"cluster": "c1", "poll_interval": 30, **agent}})
    return scripted_watcher(cfg, Store(tmp_path / "r.db"), Script(), watcher_class=Counted)


def running(w: Counted) -> threading.Event:
    stop = threading.Event()
    threading.Thread(target=w.run_forever, args=(stop,), daemon=True).start()
    assert w.ran.acquire(timeout=10)          # the first cycle, at the start
    return stop


def test_a_nudge_brings_the_next_cycle_forward(tmp_path):
    w = watcher(tmp_path, report_wakeup_gap=0.05)
    stop = running(w)
    try:
        w.nudge()
        # the poll is 30 s away: only the nudge can start this cycle in time
        assert w.ran.acquire(timeout=10)
        assert (w.count, w.early_cycles) == (2, 1)
        assert w.store.health["early_cycles"] == 1      # /metrics: watch_early_cycles
    finally:
        stop.set()
        w.nudge()


def test_a_burst_of_nudges_costs_one_early_cycle(tmp_path):
    w = watcher(tmp_path, report_wakeup_gap=0.5)
    stop = running(w)
    try:
        for _ in range(50):
            w.nudge()
        assert w.ran.acquire(timeout=10)
        assert not w.ran.acquire(timeout=0.2)   # the burst came before the cycle began
        assert w.early_cycles == 1
    finally:
        stop.set()


def test_with_a_gap_of_zero_the_poll_alone_starts_cycles(tmp_path):
    w = watcher(tmp_path, report_wakeup_gap=0)
    stop = running(w)
    try:
        w.nudge()
        assert not w.ran.acquire(timeout=0.5)
        assert (w.count, w.early_cycles) == (1, 0)
    finally:
        stop.set()


@pytest.mark.parametrize("gap", [-1, 61])
def test_the_gap_is_checked(gap):
    with pytest.raises(ConfigError, match="report_wakeup_gap"):
        from_mapping({"agent": {"report_wakeup_gap": gap}})


def test_reports_that_bring_evidence_nudge_the_loop(tmp_path):
    with Store(tmp_path / "r.db") as store:
        ingest = Ingest(store, "c1")
        nudged = []
        ingest.evidence_listeners.append(lambda pk: nudged.append(1))
        ingest.store_report("prolog", report())
        assert nudged == []                             # a run begins: nothing to judge
        ingest.store_report("prolog", report(report_id="0" * 31 + "2", xids=[XID79]))
        assert nudged == [1]                            # an XID at the start
        epilog = report("epilog", report_id="0" * 31 + "3")
        ingest.store_report("epilog", epilog)
        assert nudged == [1, 1]
        ingest.store_report("epilog", epilog)           # delivered twice: stored once
        assert nudged == [1, 1]
        ingest.store_report("epilog", report("epilog", report_id="0" * 31 + "4", job=None))
        assert nudged == [1, 1]                         # a node's own report: no job


class Silent:
    """A watch whose attempt's silence fills its hang window at ``at``."""

    def __init__(self, at: float | None) -> None:
        self.hang = type("Hang", (), {"due": lambda _self: at})()


def test_a_hang_window_that_fills_before_the_poll_gets_its_own_cycle(tmp_path):
    w = watcher(tmp_path)
    w.watches[1] = Silent(time.time() + 0.3)     # the poll is 30 s away
    w.watches[2] = Silent(None)                  # hang detection off, or fired
    stop = running(w)
    try:
        assert w.ran.acquire(timeout=10)
        assert (w.count, w.early_cycles) == (2, 1)
        # that window is past now: nothing more comes before the poll
        assert not w.ran.acquire(timeout=0.5)
    finally:
        stop.set()


def test_a_hang_detectors_due_time_follows_its_silence():
    hang = HangDetector(hang=60, started=1_000.0)
    assert hang.due() == 1_060.0
    hang.feed(1_030.0, "step 10")
    assert hang.due() == 1_090.0
    assert hang.check(1_089.0, running=True) is None
    assert hang.check(1_090.0, running=True) is not None
    assert hang.due() is None                    # this silence had its detection
    assert HangDetector(hang=0, started=1_000.0).due() is None


def test_while_a_nudged_job_completes_the_loop_looks_again_a_gap_later(tmp_path):
    """An epilog reports while its job is COMPLETING: the nudged cycle sees the
    job not yet ended, and its end must not wait a whole poll."""
    w = watcher(tmp_path, report_wakeup_gap=0.1)
    stop = running(w)
    try:
        w.settling = True           # as a cycle sets it: a nudged job is completing
        w.nudge()
        for _ in range(3):          # the nudged cycle, then the follow-ups
            assert w.ran.acquire(timeout=10)
        w.settling = False          # the job ended: the poll (30 s away) is next
        while w.ran.acquire(timeout=0.5):
            pass
        assert not w.ran.acquire(timeout=0.3)
        assert w.early_cycles == w.count - 1 >= 3
    finally:
        stop.set()


def test_a_gap_longer_than_the_poll_never_delays_the_poll(tmp_path):
    w = watcher(tmp_path, poll_interval=0.3, report_wakeup_gap=20)
    stop = running(w)
    try:
        w.nudge()
        assert w.ran.acquire(timeout=5)   # the poll, 0.3 s on: not the nudge's 20 s
    finally:
        stop.set()


def test_settling_follows_the_nudged_job_only(loop_parts):
    """A job stuck completing for long, with reports coming for other jobs,
    must not keep the loop listing every gap: only the job a report named
    settles, and only for SETTLE_AFTER_NUDGE."""
    watcher_, store, sched = loop_parts
    ingest = Ingest(store, "c1")
    ingest.evidence_listeners.append(watcher_.nudge)
    stuck = Job(job_id="7", numeric_id=7, state="RUNNING", submit_time=1, start_time=2,
                nodes=("node1",), comment="recovery=act:monitor", user="alice")
    other = replace(stuck, job_id="8", numeric_id=8)
    sched.jobs = [stuck, other]
    watcher_.cycle()
    pks = {w.job_id: pk for pk, w in watcher_.watches.items()}
    sched.jobs = [replace(stuck, state="COMPLETING"), other]
    watcher_.cycle()
    assert watcher_.settling is False          # completing, but no report named it
    watcher_.nudge(pks["8"])
    watcher_.cycle()
    assert watcher_.settling is False          # a report on another job
    watcher_.nudge(pks["7"])
    watcher_.cycle()
    assert watcher_.settling is True
    with watcher_._nudge_lock:                 # SETTLE_AFTER_NUDGE later
        watcher_._nudged[pks["7"]] = time.monotonic() - 1
    watcher_.cycle()
    assert watcher_.settling is False


@pytest.fixture
def loop_parts(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"act": {"mode": "monitor"}}})
    store = Store(tmp_path / "w.db")
    sched = Script()
    w = scripted_watcher(cfg, store, sched)
    return w, store, sched

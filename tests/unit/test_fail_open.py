"""The store fills up (or turns read-only) in the middle of a recovery (issue
14, finding 10): the job our requeue-hold holds must still be released within
the decision timeout, by the agent's watchdog and by ``recovery-ctl watchdog
--force``; what the release did waits in the side journal and reaches the
store once it takes writes again."""
from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from recovery_agent.store import OPEN_STATUSES, Store
from recovery_agent.store.journal import SideJournal
from tests.conftest import small_tmpfs
from tests.unit.test_actuator import FakeSlurm, add_job_rec, clock, make_actuator  # noqa: F401 (clock: a fixture)
from tests.unit.test_store_full import fill

pytestmark = pytest.mark.resilience(
    "store disk full mid-recovery", "the held job is released within the decision timeout "
    "anyway; the release is recorded in the side journal, then in the store")


@pytest.fixture
def disk(tmp_path):
    with small_tmpfs(tmp_path / "small", "8m") as mounted:
        if not mounted:
            pytest.fail("this test mounts a tmpfs and needs root")
        yield tmp_path / "small"


def held_then_full(disk, clock):
    """A recommendation whose requeue-hold went through; then the disk fills."""
    store = Store(disk / "r.db")
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock, decision_timeout=60.0)
    act.run_once()
    assert slurm.job["held"] and slurm.calls["requeue_hold"] == 1
    fill(disk / "filler")
    return store, slurm, rec_id, act


def test_watchdog_releases_with_the_store_full(disk, clock):
    store, slurm, rec_id, act = held_then_full(disk, clock)
    try:
        clock[0] += 30
        act.run_once()               # the next step cannot be recorded: nothing is done
        assert slurm.job["held"] and not slurm.calls["release"]
        clock[0] += 31               # past policy.decision_timeout
        act.run_once()
        assert not slurm.job["held"], "the job stayed held with the store full"
        assert slurm.calls["release"] == 1
        assert store.rec(rec_id).status in OPEN_STATUSES    # not written yet
        assert len(act.journal) >= 3
        clock[0] += 5
        act.run_once()               # no second release while the record waits
        assert slurm.calls["release"] == 1
        os.unlink(disk / "filler")   # space again: the journal reaches the store
        clock[0] += 1
        act.run_once()
        rec = store.rec(rec_id)
        assert rec.status == "released_by_watchdog" and rec.held_at is None
        late = [s for s in store.steps(rec_id) if "recorded late" in (s["detail"] or "")]
        assert {(s["step"], s["state"]) for s in late} >= {("watchdog_release", "started"),
                                                           ("watchdog_release", "ok")}
        assert len(act.journal) == 0 and not (disk / "r.db.journal").exists()
    finally:
        store.close()


def test_journal_survives_a_restart(tmp_path):
    journal = SideJournal(tmp_path / "r.db.journal")
    journal.add("step", 7, step="watchdog_release", state="ok", detail="")
    again = SideJournal(tmp_path / "r.db.journal")
    assert [e["step"] for e in again.entries] == ["watchdog_release"]
    (tmp_path / "r.db.journal").write_text('{"kind": "step", "rec": 1, "st')   # cut short
    assert SideJournal(tmp_path / "r.db.journal").entries == []


def test_ctl_watchdog_force_releases_with_the_store_full(disk, clock, monkeypatch, tmp_path):
    store, slurm, rec_id, act = held_then_full(disk, clock)
    store.close()
    import time
    from recovery_agent.interfaces.ctl import main
    monkeypatch.setattr("recovery_agent.interfaces.ctl.host.scheduler_for", lambda cfg: slurm)
    monkeypatch.setattr(time, "time", lambda: clock[0] + 120)
    cfg_file = tmp_path / "recovery.toml"
    cfg_file.write_text('[agent]\ncluster = "c1"\n[policy]\ndecision_timeout = "60s"\n')
    result = CliRunner().invoke(main, ["watchdog", "--force", "-c", str(cfg_file),
                                       "--db", str(disk / "r.db")])
    import traceback
    assert result.exit_code == 0, result.output + "".join(
        traceback.format_exception(result.exception))
    assert "released job 4242" in result.output and "side journal" in result.output
    assert not slurm.job["held"]

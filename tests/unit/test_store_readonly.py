"""The store turns read-only under a running agent. The agent keeps running,
says so (/healthz red, metrics), keeps judged-but-unstored verdicts in memory
up to a bound, acts on nothing it could not record, and stores everything once
writes work again.

Root ignores file modes, and a file system with the store open cannot be
remounted read-only, so the store file, its WAL and its directory are made
immutable (``chattr +i``): every write then fails as on a read-only disk. The
WAL index (``-shm``) is left alone: it is memory-mapped, and SQLite's write to
a mapped page of an immutable file is a SIGBUS, not an error."""
from __future__ import annotations

import subprocess

import pytest
from fastapi.testclient import TestClient

from recovery_agent.watch import verdicts as watch_verdicts
from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import Decider
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script as Listing

pytestmark = pytest.mark.resilience(
    "store file system read-only", "the watch loop keeps running; /healthz 503 and metrics "
    "say so; verdicts wait in memory up to a bound; no recommendation unstored; all "
    "stored once writable")


def job(n: int, out, state: str = "RUNNING") -> Job:
    return Job(job_id=str(n), numeric_id=n, state=state, submit_time=1000 + n,
               start_time=1000 + n, end_time=2000 + n if state != "RUNNING" else None,
               exit_code=1 if state == "FAILED" else None, comment="recovery=prod",
               stdout=str(out), nodes=("node1",), user="alice", name="train")


def remount(disk, mode: str) -> None:
    paths = [str(disk / "r.db"), str(disk / "r.db-wal"), str(disk)]
    subprocess.run(["chattr", "+i" if mode == "ro" else "-i", *paths], check=True)


@pytest.fixture
def rig(tmp_path, monkeypatch):
    monkeypatch.setattr(watch_verdicts, "EPILOG_GRACE", 0.0)   # no epilog reports come here
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = from_mapping({"agent": {"cluster": "c1"},
                        "environments": {"prod": {"mode": "monitor"}}})
    store = Store(disk / "r.db")
    listing = Listing()
    watcher = Watcher(cfg, store, listing, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), decider=Decider(cfg, store, None))
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    try:
        yield disk, store, listing, watcher, client
    finally:
        remount(disk, "rw")
        store.close()


def failing_jobs(tmp_path, listing, watcher, ids) -> None:
    """Jobs seen running (stored), then failed with a CUDA error in their output."""
    outs = {}
    for n in ids:
        outs[n] = tmp_path / f"job{n}.out"
        outs[n].write_text("step 1\n")
    listing.jobs = [job(n, outs[n]) for n in ids]
    assert watcher.run_once()
    for n in ids:
        with open(outs[n], "a") as fh:
            fh.write("RuntimeError: CUDA error: an illegal memory access was encountered\n")
    listing.jobs = [job(n, outs[n], "FAILED") for n in ids]


def test_read_only_store_waits_in_memory_then_catches_up(tmp_path, rig):
    disk, store, listing, watcher, client = rig
    failing_jobs(tmp_path, listing, watcher, [1, 2])
    remount(disk, "ro")
    for _ in range(3):
        assert watcher.run_once() is False                # no crash, loudly failing
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["store"] == "failing"
    assert "I/O error" in health.json()["last_error"]
    metrics = client.get("/metrics").text
    assert "slurm_recovery_store_failing 1.0" in metrics
    assert store.db["recommendations"].count == 0          # nothing decided unrecorded
    assert store.health["pending_verdicts"] == 2            # held in memory meanwhile
    assert "slurm_recovery_pending_verdicts 2.0" in metrics

    remount(disk, "rw")
    assert watcher.run_once() is True
    assert client.get("/healthz").status_code == 200
    assert store.health["pending_verdicts"] == 0
    verdicts = store.db["events"].count_where("kind = 'verdict'")
    assert verdicts == 2
    assert store.db["recommendations"].count == 2           # one per failed attempt
    assert {r["status"] for r in store.db["recommendations"].rows} == {"would_have"}


def test_pending_verdicts_are_bounded_and_drops_are_counted(tmp_path, rig, monkeypatch,
                                                            caplog):
    disk, store, listing, watcher, client = rig
    monkeypatch.setattr(watch_verdicts, "MAX_PENDING_VERDICTS", 2)
    failing_jobs(tmp_path, listing, watcher, [1, 2, 3, 4])
    remount(disk, "ro")
    assert watcher.run_once() is False
    assert store.health["pending_verdicts"] == 2
    assert store.health["dropped_verdicts"] == 2
    assert "dropped 2 pending verdict(s)" in caplog.text
    assert "slurm_recovery_verdicts_dropped_total 2.0" in client.get("/metrics").text
    remount(disk, "rw")
    assert watcher.run_once() is True
    # the two kept are judged and stored; the dropped two were never acted on
    assert store.db["events"].count_where("kind = 'verdict'") == 2
    assert store.db["recommendations"].count == 2

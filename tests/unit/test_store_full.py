"""A full disk under the store: the agent keeps running, says so loudly
(/healthz red, metrics), does nothing it cannot record, and recovers."""
from __future__ import annotations

import errno
import time

import pytest
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.conftest import small_tmpfs
from tests.unit.scripted import Script as Listing


def fill(path) -> None:
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (256 << 10))
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def job(n: int, out) -> Job:
    return Job(job_id=str(n), numeric_id=n, state="RUNNING", submit_time=1000 + n,
               start_time=1000 + n, comment="recovery=prod", stdout=str(out),
               nodes=("node1",))


@pytest.mark.resilience("store disk full",
                        "the watch loop keeps running; /healthz 503 with the error; metrics count failed cycles; nothing acted on unrecorded; catches up when space returns")
def test_full_disk_degrades_loudly_then_recovers(tmp_path):
    with small_tmpfs(tmp_path / "small", "16m") as mounted:
        if not mounted:
            pytest.fail("this test mounts a tmpfs and needs root")
        cfg = from_mapping({"agent": {"cluster": "c1"}})
        store = Store(tmp_path / "small" / "r.db")
        try:
            check_full_disk(tmp_path, store, cfg)
        finally:
            store.close()   # else the tmpfs stays busy and cannot be unmounted


def check_full_disk(tmp_path, store, cfg) -> None:
    out = tmp_path / "job.out"
    out.write_text("step 1\n")
    listing = Listing()
    watcher = Watcher(cfg, store, listing, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()))
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    listing.jobs = [job(1, out)]
    assert watcher.run_once() and client.get("/healthz").status_code == 200

    fill(tmp_path / "small" / "filler")
    listing.jobs = [job(n, out) for n in range(1, 400)]   # many new jobs to record
    assert watcher.run_once() is False                      # no crash, no exception
    health = client.get("/healthz")
    assert health.status_code == 503
    assert health.json()["store"] == "failing" and "full" in health.json()["last_error"]
    metrics = client.get("/metrics").text
    assert "slurm_recovery_store_failing 1.0" in metrics
    assert "slurm_recovery_watch_errors_total 1.0" in metrics
    assert store.db["recommendations"].count == 0           # nothing done unrecorded

    (tmp_path / "small" / "filler").unlink()                # space returns
    time.sleep(0.01)
    assert watcher.run_once() is True
    assert client.get("/healthz").status_code == 200
    assert store.db["jobs"].count == 399                    # caught up

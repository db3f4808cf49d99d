"""The store's file (issue 14, findings 6 and 13): private from the start,
tightened when loosened, and an empty or damaged one refused with what to do,
never replaced, and never healthy on /healthz while /metrics fails."""
from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from recovery_agent.interfaces.api import create_app
from recovery_agent.config import from_mapping
from recovery_agent.errors import StoreError
from recovery_agent.inputs.ingest import Ingest
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def filled(path, jobs: int = 400) -> None:
    """A real store holding enough jobs that the jobs table spans many pages."""
    with Store(path) as store:
        for n in range(jobs):
            job = Job(job_id=str(n), numeric_id=n, submit_time=1000 + n, user="alice",
                      name="train-" + "x" * 200, state="FAILED")
            with store.lock:
                store.record_job(job, "c1")
        store.set_state("heartbeat", {"time": time.time()})


def garble_page(path, table: str = "jobs") -> None:
    """Write junk over the root pages of ``table`` and its indexes (b-tree pages
    every read of the table goes through)."""
    with sqlite3.connect(path) as conn:
        page_size = conn.execute("pragma page_size").fetchone()[0]
        roots = [r[0] for r in conn.execute(
            "select rootpage from sqlite_master where tbl_name = ? and rootpage > 0",
            [table])]
    with open(path, "r+b") as fh:
        for root in roots:
            fh.seek((root - 1) * page_size)
            fh.write(bytes(range(256)) * (page_size // 256))


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def agent_config(tmp_path, store) -> str:
    config = tmp_path / "recovery.toml"
    config.write_text(f'[agent]\ncluster = "c1"\nstate_dir = "{tmp_path}"\n'
                      f'[store]\npath = "{store}"\n[api]\nport = 1\n')
    return str(config)


def start_agent(config: str):
    from recovery_agent.agent import main
    return CliRunner().invoke(main, ["-c", config, "--no-watch"])


# -- private ----------------------------------------------------------------------------

def test_a_new_store_is_private_with_its_wal_and_directory(tmp_path):
    with Store(tmp_path / "fresh" / "recovery.db") as store:
        store.set_state("x", 1)                  # -wal and -shm exist now
        for suffix in ("", "-wal", "-shm"):
            assert mode(f"{store.path}{suffix}") == 0o600, suffix
    assert mode(tmp_path / "fresh") == 0o700
    os.chmod(tmp_path, 0o755)
    with Store(tmp_path / "beside.db"):
        pass
    assert mode(tmp_path) == 0o755              # a directory it did not make stays


def test_a_loosened_store_and_its_backups_are_tightened(tmp_path):
    path = tmp_path / "recovery.db"
    with Store(path) as store:
        store.set_state("x", 1)
        backup = tmp_path / "recovery.db.backup-20261201T000000Z"
        backup.write_bytes(b"old")
        for item in (path, f"{path}-wal", backup):
            os.chmod(item, 0o644)
        changed = store.tighten()
        assert f"{path}: 0644 -> 0600" in changed and len(changed) == 3
        assert {mode(p) for p in (path, f"{path}-wal", f"{path}-shm", backup)} == {0o600}
        assert store.tighten() == []


@pytest.mark.security
def test_a_private_store_cannot_be_read_by_another_user(unix_users):
    mallory = unix_users("mallory")
    top = Path(tempfile.mkdtemp(prefix="rsec-store-"))   # a directory anyone may enter
    try:
        os.chmod(top, 0o755)
        with Store(top / "recovery.db") as store:
            store.set_state("secret", "alice's evidence")
            result = mallory.run(["cat", str(store.path), f"{store.path}-wal"], check=False,
                                 errors="replace")
        assert result.returncode != 0 and "evidence" not in result.stdout
        assert result.stderr.count("Permission denied") == 2
    finally:
        shutil.rmtree(top)


# -- empty -------------------------------------------------------------------------------

def test_an_empty_store_file_is_refused_not_replaced(tmp_path):
    path = tmp_path / "recovery.db"
    path.touch()
    with pytest.raises(StoreError) as refused:
        Store(path)
    text = str(refused.value)
    assert "empty file (0 bytes)" in text and f"rm {path}" in text
    assert path.stat().st_size == 0 and not os.path.exists(f"{path}-wal")
    with pytest.raises(StoreError, match="empty file"):
        Store(path, readonly=True)
    started = start_agent(agent_config(tmp_path, path))
    assert started.exit_code == 1 and "empty file" in started.output
    assert path.stat().st_size == 0


# -- damaged -----------------------------------------------------------------------------

def test_a_garbage_page_stops_the_agent_at_start_with_the_way_out(tmp_path):
    path = tmp_path / "recovery.db"
    filled(path)
    garble_page(path)
    before = digest(path)
    with pytest.raises(StoreError) as refused:
        Store(path, check=True)
    text = str(refused.value)
    assert "is damaged" in text and f"sqlite3 {path} .recover" in text
    assert "backup-" in text
    started = start_agent(agent_config(tmp_path, path))
    assert started.exit_code == 1 and ".recover" in started.output
    assert "Traceback" not in started.output
    assert digest(path) == before                 # nothing written to it


def test_a_garbage_first_page_is_not_a_database(tmp_path):
    path = tmp_path / "recovery.db"
    filled(path, jobs=5)
    with open(path, "r+b") as fh:
        fh.write(b"\xff" * 100)
    with pytest.raises(StoreError, match="not an SQLite database"):
        Store(path)


def test_a_read_that_finds_damage_turns_healthz_red_as_metrics_are(tmp_path):
    """Damage found after start (the start-up check passed, or it was cut short)."""
    path = tmp_path / "recovery.db"
    filled(path)
    store = Store(path)
    garble_page(path)
    cfg = from_mapping({"agent": {"cluster": "c1"}, "api": {"auth": "none"}})
    client = TestClient(create_app(cfg, Ingest(store, "c1")))
    store.set_state("heartbeat", {"time": time.time()})
    assert client.get("/healthz").status_code == 200
    scraped = client.get("/metrics")
    assert scraped.status_code == 503 and "malformed" in scraped.json()["detail"]
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["store"] == "damaged"
    assert client.get("/healthz").status_code == 503      # it stays red
    store.close()


def test_the_integrity_check_is_bounded(tmp_path, caplog):
    from recovery_agent.store import files
    path = tmp_path / "recovery.db"
    filled(path)
    conn = sqlite3.connect(path, factory=files.Connection)
    files.quick_check(conn, path, seconds=0.0)         # out of time: logged, not refused
    assert "integrity check stopped" in caplog.text
    files.quick_check(conn, path)                      # the whole check: passes
    conn.close()

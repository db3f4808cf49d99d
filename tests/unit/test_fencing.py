"""One agent acts on one store (issue 14, finding 9): the lock sits beside the
resolved file, so a symlinked path meets it (a bind mount shares its inode); an
agent the lock cannot see (one on another host of a shared file system, or one
started after the lock file was removed) is refused by the store's claim; and an
agent whose claim was taken over stops before its next Slurm call."""
from __future__ import annotations

import os
import subprocess
import time

import click
import pytest

from recovery_agent.agent import fence_for
from recovery_agent.config import from_mapping
from recovery_agent.errors import StoreError
from recovery_agent.store import Store, StoreLock
from recovery_agent.store.state import CLAIM
from tests.unit.test_actuator import FakeSlurm, add_job_rec, clock, make_actuator  # noqa: F401

pytestmark = pytest.mark.resilience("two agents on one store",
                                    "a second agent is refused or fenced: it never acts")


def test_lock_through_a_symlinked_path_is_the_same_lock(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    Store(real / "r.db").close()
    (tmp_path / "link.db").symlink_to(real / "r.db")      # the store file itself
    (tmp_path / "dir").symlink_to(real)                     # or a directory above it
    first = StoreLock(real / "r.db")
    first.acquire()
    try:
        for other in (tmp_path / "link.db", tmp_path / "dir" / "r.db"):
            with pytest.raises(StoreError, match="already uses the store"):
                StoreLock(other).acquire()
    finally:
        first.release()


def test_lock_through_a_bind_mount_is_the_same_lock(tmp_path):
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir()
    other.mkdir()
    if subprocess.run(["mount", "--bind", str(real), str(other)]).returncode != 0:
        pytest.fail("this test bind-mounts a directory and needs root")
    try:
        first = StoreLock(real / "r.db")
        first.acquire()
        with pytest.raises(StoreError, match="already uses the store"):
            StoreLock(other / "r.db").acquire()
        first.release()
    finally:
        subprocess.run(["umount", str(other)], check=False)


@pytest.fixture
def live_agent_pid():
    """A process whose command line says recovery-agent (the claim checks it)."""
    proc = subprocess.Popen(["recovery-agent-stand-in", "60"], executable="/bin/sleep")
    yield proc.pid
    proc.kill()
    proc.wait()


def test_second_agent_the_lock_cannot_see_is_refused(tmp_path, live_agent_pid):
    store = Store(tmp_path / "r.db")
    store.set_state(CLAIM, {"pid": live_agent_pid, "host": os.uname().nodename,
                            "token": "x"})
    store.set_state("heartbeat", {"time": time.time(), "cycles": 9})
    other = Store(tmp_path / "r.db")       # a second process, its own lock elsewhere
    with pytest.raises(StoreError, match=f"pid {live_agent_pid}"):
        other.claim(fresh_within=30)
    # a heartbeat gone stale, or a dead pid, is an agent that stopped: taken over
    store.set_state("heartbeat", {"time": time.time() - 60, "cycles": 9})
    assert other.claim(fresh_within=30)


def test_dead_agents_claim_is_taken_over_at_once(tmp_path):
    store = Store(tmp_path / "r.db")
    dead = subprocess.Popen(["true"])
    dead.wait()
    store.set_state(CLAIM, {"pid": dead.pid, "host": os.uname().nodename, "token": "x"})
    store.set_state("heartbeat", {"time": time.time(), "cycles": 1})
    assert store.claim(fresh_within=30)


def test_an_agent_taken_over_never_acts_again(tmp_path, clock):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    lock = StoreLock(tmp_path / "r.db")
    lock.acquire()
    slurm = FakeSlurm(state="FAILED")
    rec_id = add_job_rec(store, slurm)
    act = make_actuator(store, slurm, clock)
    act.fence = fence_for(cfg, store, lock)
    assert act.fence() == ""
    Store(tmp_path / "r.db").claim(fresh_within=0)    # another agent took the store
    assert "claimed the store" in act.fence()
    for _ in range(3):
        act.run_once()
        clock[0] += 1
    assert not slurm.calls and store.steps(rec_id) == []
    lock.release()


def test_a_replaced_lock_file_fences(tmp_path, clock):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    lock = StoreLock(tmp_path / "r.db")
    lock.acquire()
    fence = fence_for(cfg, store, lock)
    os.unlink(lock.path)                   # someone removed it; a new agent locks anew
    StoreLock(tmp_path / "r.db").acquire()
    assert "lock" in fence()
    lock.release()


def test_fence_for_refuses_a_live_claim(tmp_path, live_agent_pid):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    store.set_state(CLAIM, {"pid": live_agent_pid, "host": os.uname().nodename,
                            "token": "x"})
    store.set_state("heartbeat", {"time": time.time(), "cycles": 9})
    with pytest.raises(click.ClickException, match="another recovery-agent"):
        fence_for(cfg, store, StoreLock(tmp_path / "r.db"))

"""recovery-devcluster, driven as a user would: through its command line.

These tests run their own small cluster on another port and state dir, so the
session cluster used by the other integration tests is never disturbed.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from recovery_devtools.devcluster import cluster as cluster_mod
from recovery_devtools.devcluster.cluster import DevCluster
from tests.conftest import small_tmpfs
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.live
PORT = int(os.environ.get("RECOVERY_TEST_PORT", "26817")) + 1000


def devcluster(*args: str, env: dict | None = None, timeout: float = 120):
    # these clusters are counted daemon by daemon: never with slurmrestd (make test REST=1)
    env = dict(env or os.environ, RECOVERY_DEVCLUSTER_REST="0")
    return subprocess.run([sys.executable, "-m", "recovery_devtools.devcluster", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def live_pids(state: Path) -> list[int]:
    record = json.loads((state / "cluster.json").read_text())
    return [d["pid"] for d in record["daemons"]
            if psutil.pid_exists(d["pid"])
            and psutil.Process(d["pid"]).status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def state(tmp_path):
    path = tmp_path / "dc"
    yield path
    DevCluster(path).down(quiet=True)


def test_lifecycle(state):
    up = devcluster("up", "--nodes", "2", "--gpus-per-node", "4", "--port", str(PORT),
                    "--state-dir", str(state))
    assert up.returncode == 0, up.stderr
    assert "2 nodes x 4 GPUs" in up.stdout
    pids = live_pids(state)
    assert len(pids) == 4  # munged, slurmctld, 2 slurmd

    status = devcluster("status", "--json", "--state-dir", str(state))
    assert status.returncode == 0
    info = json.loads(status.stdout)
    assert info["healthy"] and [n["state"] for n in info["nodes"]] == ["IDLE", "IDLE"]
    for node in ("node1", "node2"):  # fault-injection files, one set per node
        assert (state / "nodes" / node / "kern.log").exists()
        gpus = json.loads((state / "nodes" / node / "gpus.json").read_text())["gpus"]
        assert len(gpus) == 4 and len({g["uuid"] for g in gpus}) == 4

    env_line = devcluster("env", "--state-dir", str(state)).stdout.strip()
    assert env_line == f"export SLURM_CONF={state / 'etc' / 'slurm.conf'}"
    conf_env = dict(os.environ, SLURM_CONF=str(state / "etc" / "slurm.conf"))
    gres = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True, text=True,
                          env=conf_env, timeout=30).stdout.split("\n")
    assert "node1 gpu:4" in gres

    again = devcluster("up", "--nodes", "2", "--gpus-per-node", "4", "--port", str(PORT),
                       "--state-dir", str(state))
    assert again.returncode == 0 and "reusing healthy" in again.stdout
    assert live_pids(state) == pids

    # a running job's processes must not outlive `down`
    job = subprocess.run(["sbatch", "--parsable", "-N2", f"--chdir={state / 'jobs'}",
                          "--wrap", "srun sleep 600"], capture_output=True, text=True,
                         env=conf_env, timeout=30)
    assert job.returncode == 0, job.stderr
    wait_for(lambda: subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], env=conf_env,
                                    capture_output=True, text=True).stdout.strip(),
             30, "job running")
    wait_for(lambda: DevCluster(state)._stepds(), 15, "slurmstepd running")

    down = devcluster("down", "--state-dir", str(state))
    assert down.returncode == 0 and "stopped 4 daemon(s)" in down.stdout
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert DevCluster(state)._stepds() == []
    assert devcluster("status", "--state-dir", str(state)).returncode == 1
    assert devcluster("down", "--state-dir", str(state)).stdout.strip() == "nothing was running"


def test_stale_state_from_a_crash_is_cleaned(state):
    assert devcluster("up", "--nodes", "1", "--port", str(PORT),
                      "--state-dir", str(state)).returncode == 0
    record = json.loads((state / "cluster.json").read_text())
    by_name = {d["name"]: d["pid"] for d in record["daemons"]}
    for name in ("slurmctld", "slurmd-node1"):  # a crash: munged is left behind
        os.kill(by_name[name], signal.SIGKILL)
    wait_for(lambda: not DevCluster(state).is_healthy(), 10, "cluster to look dead")

    up = devcluster("up", "--nodes", "1", "--port", str(PORT), "--state-dir", str(state))
    assert up.returncode == 0, up.stderr
    assert "cleaning a stale dev cluster" in up.stderr
    assert not psutil.pid_exists(by_name["munged"]) or \
        psutil.Process(by_name["munged"]).status() == psutil.STATUS_ZOMBIE
    assert DevCluster(state).is_healthy()


def test_port_in_use(state):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", PORT))
        sock.listen()
        result = devcluster("up", "--nodes", "1", "--port", str(PORT),
                            "--state-dir", str(state))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"Error: port {PORT} (for slurmctld) is already in use; "
        "choose another base port with --port"]
    assert not (state / "cluster.json").exists()


def test_missing_slurm(state, tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    env = dict(os.environ, PATH=str(bare))
    result = devcluster("up", "--state-dir", str(state), env=env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: Slurm is not installed")


def test_not_a_state_dir(tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    result = devcluster("up", "--port", str(PORT), "--state-dir", str(precious))
    assert result.returncode != 0 and "is not a dev cluster state dir" in result.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_full_disk(tmp_path, monkeypatch):
    """A state dir on a full filesystem: a real 1 MiB tmpfs where we may mount
    one, otherwise the same check fed a full disk's numbers."""
    mnt = tmp_path / "small"
    with small_tmpfs(mnt, "1m") as mounted:
        if mounted:
            result = devcluster("up", "--port", str(PORT), "--state-dir", str(mnt / "dc"))
            assert result.returncode != 0
            message = result.stderr.strip()
        else:
            monkeypatch.setattr(cluster_mod.shutil, "disk_usage",
                                lambda p: type("U", (), {"free": 4096})())
            with pytest.raises(cluster_mod.DevClusterError) as info:
                DevCluster(mnt / "dc")._prepare_dir(cluster_mod.ClusterSpec(port=PORT))
            message = str(info.value)
        assert "not enough free space" in message or "full disk" in message
        assert len(message.splitlines()) == 1

def test_up_fails_fast_with_the_log_tail(state, monkeypatch):
    """A daemon that cannot start: the error carries its log, well inside 60 s."""
    from recovery_devtools.devcluster import config as config_mod
    real = config_mod.slurm_conf
    monkeypatch.setattr(config_mod, "slurm_conf",
                        lambda spec, lay: real(spec, lay) + "SelectType=select/nonexistent\n")
    monkeypatch.setattr(cluster_mod, "write_files", config_mod.write_files)
    started = time.monotonic()
    with pytest.raises(cluster_mod.DevClusterError) as info:
        DevCluster(state).up(cluster_mod.ClusterSpec(nodes=1, port=PORT))
    assert time.monotonic() - started < 60
    text = str(info.value)
    assert "slurmctld" in text and "last lines of" in text
    assert DevCluster(state).daemons() == []  # what did start was stopped again

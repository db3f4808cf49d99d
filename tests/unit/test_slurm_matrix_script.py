"""tests/slurm_matrix.sh's refusals: each is one line, and nothing is built or mounted."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "slurm_matrix.sh"


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ["PATH"], "SLURM_CHROOT_CACHE": str(tmp_path / "cache"),
            "SLURM_CHROOT_SCRATCH": str(tmp_path / "scratch")}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env={**base, **env})


def test_a_chroot_build_without_the_mirror_fails_with_one_line(tmp_path):
    # port 9 (discard) on loopback: nothing answers, at once
    proc = run(tmp_path, "24.11", "contract", RECOVERY_DEBIAN_MIRROR="http://127.0.0.1:9/debian")
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("slurm-matrix: "), proc.stderr
    if os.geteuid() == 0 and shutil.which("debootstrap") and shutil.which("curl"):
        assert "cannot reach the Debian mirror http://127.0.0.1:9/debian" in lines[0]
        assert "trixie" in lines[0]
    assert not (tmp_path / "cache" / "trixie-slurm.tar").exists()
    assert not (tmp_path / "scratch" / "root").exists()


def test_an_unknown_release_is_refused_in_one_line(tmp_path):
    proc = run(tmp_path, "25.05")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "slurm-matrix: no chroot for Slurm '25.05' (22.05 = the host, 24.11 = trixie, "
        "26.05 = sid)"]


def test_an_unknown_suite_is_refused(tmp_path):
    proc = run(tmp_path, "22.05", "contrakt")
    assert proc.returncode == 1 and "unknown suite 'contrakt'" in proc.stderr

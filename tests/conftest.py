"""Shared test helpers: where the recorded Slurm output lives."""
from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SLURM_VERSIONS = ("22.05", "24.11", "26.05")


def slurm_fixture(version: str, name: str) -> dict:
    return json.loads((FIXTURES / "slurm" / version / name).read_text())


@pytest.fixture(params=SLURM_VERSIONS)
def slurm_version(request) -> str:
    return request.param


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """Mount a tmpfs of ``size`` on ``path`` (created) for a full-disk test;
    yields whether the mount worked (it needs root), unmounts afterwards."""
    path.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=False)

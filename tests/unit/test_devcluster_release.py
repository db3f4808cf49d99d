"""The dev cluster's per-release files: what a newer Slurm needs beside slurm.conf."""
from __future__ import annotations

import pytest

from recovery_devtools.devcluster.config import (ClusterSpec, Layout, release_files,
                                                 slurm_release, write_files)


@pytest.mark.parametrize("line, expected", [
    ("slurm 22.05.8\n", (22, 5)),          # Debian 12
    ("slurm-wlm 24.11.5\n", (24, 11)),     # Debian 13
    ("slurm 26.05.5-1\n", (26, 5)),
    ("", (0, 0)),
    ("slurm unknown\n", (0, 0)),
])
def test_release_is_read_from_slurmctld_version(line, expected):
    assert slurm_release(line) == expected


def test_22_05_gets_no_cgroup_conf(tmp_path):
    write_files(ClusterSpec(nodes=1, gpus_per_node=0), Layout(tmp_path), (22, 5))
    assert not (tmp_path / "etc" / "cgroup.conf").exists()
    assert release_files((0, 0)) == {}


@pytest.mark.parametrize("release", [(23, 2), (24, 11), (26, 5)])
def test_newer_releases_get_cgroups_disabled(tmp_path, release):
    write_files(ClusterSpec(nodes=1, gpus_per_node=0), Layout(tmp_path), release)
    text = (tmp_path / "etc" / "cgroup.conf").read_text()
    assert "CgroupPlugin=disabled" in text.splitlines()

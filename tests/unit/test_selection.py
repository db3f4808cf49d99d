"""Backend selection: explicit choice, else first viable, else a clear error."""
from __future__ import annotations

import pytest

from recovery_agent.errors import SchedulerUnavailable
from recovery_agent.scheduler import CliScheduler, SlurmRunner, probe_all, select_scheduler
from tests.unit.test_runner import fake_command


@pytest.fixture
def working_cli(tmp_path):
    for name in ("squeue", "scontrol", "scancel"):
        fake_command(tmp_path, name, "exit 0")
    fake_command(tmp_path, "sinfo", 'echo "slurm 22.05.8"')
    return SlurmRunner(bin_dir=str(tmp_path))


def test_auto_falls_through_pyslurm_to_cli(working_cli):
    chosen = select_scheduler("auto", working_cli)
    assert isinstance(chosen, CliScheduler) and chosen.runner is working_cli


def test_nothing_viable_explains_each_backend(tmp_path):
    with pytest.raises(SchedulerUnavailable) as info:
        select_scheduler("auto", SlurmRunner(bin_dir=str(tmp_path)))
    text = str(info.value)
    assert "pyslurm:" in text and "pyslurm is not installed" in text
    assert "cli:" in text and "squeue" in text


def test_explicit_backend_that_cannot_run(working_cli):
    with pytest.raises(SchedulerUnavailable) as info:
        select_scheduler("pyslurm", working_cli)
    assert "'pyslurm' cannot run" in str(info.value)


def test_unknown_backend(working_cli):
    with pytest.raises(SchedulerUnavailable) as info:
        select_scheduler("slurmrestd", working_cli)
    assert "unknown scheduler backend" in str(info.value)


def test_probe_all_in_order(working_cli):
    probes = probe_all(working_cli)
    assert [p.backend for p in probes] == ["pyslurm", "cli"]
    assert [p.viable for p in probes] == [False, True]

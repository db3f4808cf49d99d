"""Backend selection: explicit choice, else first viable, else a clear error."""
from __future__ import annotations

import pytest

from recovery_agent.errors import SchedulerUnavailable
from recovery_agent.scheduler import (CliScheduler, RestSettings, SlurmRunner, probe_all,
                                      select_scheduler)
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
    assert [p.backend for p in probes] == ["rest", "pyslurm", "cli"]
    assert [p.viable for p in probes] == [False, False, True]
    assert "rest_url is not set" in probes[0].reason


def test_auto_takes_a_configured_slurmrestd_first(working_cli, tmp_path):
    from recovery_agent.scheduler.rest_backend import RestScheduler
    from tests.unit.rest_server import FakeRest, serve
    from tests.unit.test_rest_backend import token_file, v38
    fake = FakeRest()
    v38(fake)
    url, stop = serve(fake)
    stopped = False
    try:
        chosen = select_scheduler("auto", working_cli,
                                  RestSettings(url=url, token_file=token_file(tmp_path)))
        assert isinstance(chosen, RestScheduler) and chosen.runner is working_cli
        # that slurmrestd gone: auto goes on to the next viable backend; naming rest fails
        stop()
        stopped = True
        chosen = select_scheduler("auto", working_cli,
                                  RestSettings(url=url, token_file=token_file(tmp_path),
                                               retries=0))
        assert isinstance(chosen, CliScheduler)
        with pytest.raises(SchedulerUnavailable, match="'rest' cannot run: slurmrestd"):
            select_scheduler("rest", working_cli, RestSettings(url=url, retries=0,
                                                               token_file=token_file(tmp_path)))
    finally:
        if not stopped:
            stop()

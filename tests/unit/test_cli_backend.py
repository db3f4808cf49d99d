"""CliScheduler's command lines and filtering, with recorded JSON played back by
stand-in commands. (Against the real cluster: tests/integration.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from recovery_agent.errors import JobNotFound, NodeNotFound, SchedulerError
from recovery_agent.scheduler import CliScheduler, SlurmRunner
from tests.conftest import FIXTURES
from tests.unit.test_runner import fake_command


@pytest.fixture
def fake_slurm(tmp_path):
    """squeue/sinfo print a recording; scontrol/scancel log their argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "argv.log"
    rec = FIXTURES / "slurm" / "22.05"
    fake_command(bin_dir, "squeue", f'echo squeue "$@" >> {log}; cat {rec / "squeue_all.json"}')
    fake_command(bin_dir, "sinfo", f'[ "$1" = --version ] && echo "slurm 22.05.8" && exit 0\n'
                                   f'cat {rec / "sinfo.json"}')
    fake_command(bin_dir, "scontrol", f'''printf '%s\\n' "$*" >> {log}
case "$*" in *999*) echo "scontrol: error: Invalid job id specified" >&2; exit 1;; esac
case "$*" in *nodename=ghost*) echo "scontrol: error: Invalid node name specified" >&2; exit 1;; esac''')
    fake_command(bin_dir, "scancel", f'printf "scancel %s\\n" "$*" >> {log}')
    sched = CliScheduler(SlurmRunner(bin_dir=str(bin_dir)))
    sched.log = log
    return sched


def lines(sched) -> list[str]:
    return Path(sched.log).read_text().splitlines()


def test_list_jobs_is_one_call_whatever_the_ids(fake_slurm):
    jobs = fake_slurm.list_jobs(["15", "17_1", "16", "404"])
    assert sorted(j.job_id for j in jobs) == ["15", "16", "17_1"]
    assert fake_slurm.runner.calls == {"squeue": 1}
    assert lines(fake_slurm) == ["squeue --json --all --states=all"]


def test_get_job_by_array_task_or_own_id(fake_slurm):
    assert fake_slurm.get_job("17_1").array_task_id == 1
    assert fake_slurm.get_job("20").job_id == "17_1"  # the task's own job id
    with pytest.raises(JobNotFound):
        fake_slurm.get_job("404")


def test_nodes(fake_slurm):
    assert fake_slurm.get_node("node3").drained
    assert [n.name for n in fake_slurm.list_nodes(["node1", "node4"])] == ["node1", "node4"]
    with pytest.raises(NodeNotFound):
        fake_slurm.get_node("node9")


def test_write_commands(fake_slurm):
    fake_slurm.requeue_hold("17_1")
    fake_slurm.set_excluded_nodes("15", ["node3", "node1", "node2"])
    fake_slurm.set_excluded_nodes("15", [])
    fake_slurm.allow_requeue("15")
    fake_slurm.start_now("15")
    fake_slurm.release("15")
    fake_slurm.cancel("15")
    fake_slurm.cancel("16", signal="USR1")
    fake_slurm.signal_job("16", "USR2")
    fake_slurm.signal_job("16", "TERM", batch=True)
    fake_slurm.drain_node("node3", "recovery: rec-1 gpu_hardware xid=79")
    fake_slurm.resume_node("node3")
    assert lines(fake_slurm) == [
        "requeuehold 17_1",
        "update jobid=15 ExcNodeList=node[1-3]",
        "update jobid=15 ExcNodeList=",
        "update jobid=15 Requeue=1",
        "update jobid=15 StartTime=now",
        "release 15",
        "scancel 15",
        "scancel --signal=USR1 16",
        "scancel --signal=USR2 16",
        "scancel --signal=TERM --batch 16",
        "update nodename=node3 state=DRAIN reason=recovery: rec-1 gpu_hardware xid=79",
        "update nodename=node3 state=RESUME",
    ]


def test_refusals_become_typed_errors(fake_slurm):
    with pytest.raises(JobNotFound) as info:
        fake_slurm.requeue_hold("999")
    assert info.value.argv == ["scontrol", "requeuehold", "999"] and info.value.returncode == 1
    with pytest.raises(NodeNotFound):
        fake_slurm.drain_node("ghost", "recovery: x")
    with pytest.raises(ValueError):
        fake_slurm.drain_node("node1", "  ")


def test_garbage_output_is_a_scheduler_error(tmp_path):
    fake_command(tmp_path, "squeue", "echo 'squeue: error: not json'")
    with pytest.raises(SchedulerError) as info:
        CliScheduler(SlurmRunner(bin_dir=str(tmp_path))).list_jobs()
    assert "not JSON" in str(info.value)


def test_probe(fake_slurm, tmp_path):
    probe = fake_slurm.probe()
    assert probe.viable and probe.version == "22.05.8"
    empty = tmp_path / "empty"
    empty.mkdir()
    probe = CliScheduler(SlurmRunner(bin_dir=str(empty))).probe()
    assert not probe.viable and "squeue" in probe.reason


def test_probe_reports_unreachable_controller(tmp_path):
    for name in ("squeue", "scancel"):
        fake_command(tmp_path, name, "exit 0")
    fake_command(tmp_path, "sinfo", 'echo "slurm 22.05.8"')
    fake_command(tmp_path, "scontrol",
                 "echo 'Slurmctld(primary) at localhost is DOWN' >&2; exit 1")
    probe = CliScheduler(SlurmRunner(bin_dir=str(tmp_path))).probe()
    assert not probe.viable and "slurmctld not reachable" in probe.reason

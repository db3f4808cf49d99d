"""The pyslurm backend without pyslurm: its viability check on this machine, the pure
translators on stand-in objects, and the call seam against a fake pyslurm module.

The stand-ins carry the attribute names of pyslurm 25.11's read-only properties:
``pyslurm/core/job/job.pyx`` (class Job) and ``pyslurm/core/node.pyx`` (class Node),
with the value shapes those properties return (None for unset, hostlist strings,
a dict for configured_gres, one "BASE+FLAG" string for a node's state).
"""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from recovery_agent.errors import JobNotFound, NodeNotFound, SchedulerError
from recovery_agent.scheduler.base import Scheduler
from recovery_agent.scheduler.pyslurm_backend import (
    PyslurmScheduler,
    job_from_pyslurm,
    node_from_pyslurm,
)


def pyslurm_job(**overrides):
    """A pyslurm.Job look-alike; defaults are what pyslurm returns for a plain job."""
    attrs = dict(
        id=100, name="train", state="RUNNING", state_reason="None", priority=4294,
        is_requeueable=True, requeue_count=0, submit_time=1764400000,
        start_time=1764400060, end_time=1764486460, partition="gpu", batch_host="",
        allocated_nodes=None, excluded_nodes=None, exit_code=0, exit_code_signal=0,
        cluster="dev", working_directory="/home/ana/run", comment="recovery=auto",
        standard_output="/home/ana/run/slurm-100.out",
        standard_error="/home/ana/run/slurm-100.out",
        array_id=None, array_task_id=None, array_tasks_waiting=None, user_name="ana",
    )
    attrs.update(overrides)
    return types.SimpleNamespace(**attrs)


def pyslurm_node(**overrides):
    attrs = dict(name="node1", state="IDLE", reason=None, reason_user=None, reason_time=None,
                 partitions=["gpu"], configured_gres={})
    attrs.update(overrides)
    return types.SimpleNamespace(**attrs)


# --------------------------------------------------------------------------- probe

@pytest.mark.skipif(importlib.util.find_spec("pyslurm") is not None,
                    reason="pyslurm is installed here")
def test_probe_without_pyslurm_says_how_to_install():
    probe = PyslurmScheduler().probe()
    assert probe.backend == "pyslurm"
    assert probe.viable is False
    assert "pyslurm is not installed" in probe.reason
    assert "pip install 'slurm-recovery[pyslurm]'" in probe.reason
    assert "25.11" in probe.reason and "libslurm" in probe.reason
    assert probe.version == ""


def test_importing_the_backend_does_not_import_pyslurm():
    assert "pyslurm" not in sys.modules


def test_backend_satisfies_the_protocol():
    backend = PyslurmScheduler()
    assert isinstance(backend, Scheduler)
    assert backend.name == "pyslurm"


# --------------------------------------------------------------------------- jobs

def test_running_two_node_job():
    job = job_from_pyslurm(pyslurm_job(allocated_nodes="gpu[01-02]", batch_host="gpu01"))
    assert job.job_id == "100" and job.numeric_id == 100
    assert job.state == "RUNNING" and job.is_active and job.state_flags == frozenset()
    assert job.nodes == ("gpu01", "gpu02")
    assert job.batch_host == "gpu01"
    assert job.reason == ""  # pyslurm's "None" reason
    assert job.held is False and job.requeue_allowed is True
    assert (job.submit_time, job.start_time) == (1764400000, 1764400060)
    assert job.user == "ana" and job.comment == "recovery=auto"
    assert job.stdout == "/home/ana/run/slurm-100.out" and job.workdir == "/home/ana/run"
    assert job.array_job_id is None and not job.is_array_task


def test_array_task_gets_a_t_id_and_keeps_its_own_number():
    job = job_from_pyslurm(pyslurm_job(id=207, array_id=200, array_task_id=3,
                                       allocated_nodes="node2"))
    assert job.job_id == "200_3"
    assert job.numeric_id == 207
    assert (job.array_job_id, job.array_task_id) == (200, 3)
    assert job.is_array_task and job.nodes == ("node2",)


def test_array_task_zero_which_pyslurm_reports_as_none():
    job = job_from_pyslurm(pyslurm_job(id=200, array_id=200, array_task_id=None))
    assert job.job_id == "200_0" and job.array_task_id == 0


def test_pending_rest_of_an_array():
    job = job_from_pyslurm(pyslurm_job(id=200, array_id=200, array_task_id=None,
                                       array_tasks_waiting="2-3", state="PENDING",
                                       standard_output="/x/slurm-200_4294967294.out"))
    assert job.job_id == "200_[2-3]"
    assert job.array_task_id is None and job.array_task_spec == "2-3"
    assert job.stdout == "" and job.stderr == ""  # no file of its own yet


def test_requeued_held_job_with_excluded_node():
    job = job_from_pyslurm(pyslurm_job(
        id=14, name="requeued", state="PENDING", priority=0,
        state_reason="job_requeued_in_held_state", requeue_count=1,
        excluded_nodes="node3", allocated_nodes=None, start_time=1764400924,
        end_time=None))
    assert job.is_pending and job.held
    assert job.reason == "job_requeued_in_held_state"
    assert job.restart_count == 1
    assert job.excluded_nodes == ("node3",)
    assert job.nodes == ()
    assert job.end_time is None


def test_requeue_hold_flag_word_becomes_pending_with_flag():
    job = job_from_pyslurm(pyslurm_job(state="REQUEUE_HOLD", priority=0))
    assert job.state == "PENDING" and job.state_flags == {"REQUEUE_HOLD"} and job.held


def test_failed_job_keeps_exit_code_and_no_requeue():
    job = job_from_pyslurm(pyslurm_job(state="FAILED", exit_code=3, is_requeueable=False))
    assert job.is_finished and job.exit_code == 3 and job.exit_signal == 0
    assert job.requeue_allowed is False


def test_unlimited_values_are_not_numbers():
    # pyslurm returns the string "UNLIMITED" for infinite 32-bit values.
    job = job_from_pyslurm(pyslurm_job(requeue_count="UNLIMITED", submit_time=0))
    assert job.restart_count == 0 and job.submit_time is None


# --------------------------------------------------------------------------- nodes

def test_drained_node_with_reason():
    node = node_from_pyslurm(pyslurm_node(
        name="node3", state="MIXED+DRAIN",
        reason="recovery: rec-42 gpu_hardware xid=79", reason_user="root",
        reason_time=1764400806, configured_gres={"gpu:a100": 4}))
    assert node.state == "MIXED" and node.flags == {"DRAIN"}
    assert node.drained and not node.available
    assert node.reason.startswith("recovery: rec-42")
    assert node.reason_user == "root" and node.reason_time == 1764400806
    assert node.partitions == ("gpu",)
    assert node.gres == "gpu:a100:4"
    assert node.state_text == "MIXED+DRAIN"


def test_idle_node_is_available():
    node = node_from_pyslurm(pyslurm_node(state="IDLE"))
    assert node.available and not node.drained and node.reason == ""


# --------------------------------------------------------------------------- call seam

class FakeRPCError(Exception):
    def __init__(self, errno, msg):
        super().__init__(msg)
        self.errno, self.msg = errno, msg


@pytest.fixture
def fake_pyslurm(monkeypatch):
    """A module standing in for pyslurm: counts Jobs.load and records job changes."""
    mod = types.ModuleType("pyslurm")
    mod.__version__ = "25.11.2"
    mod.PyslurmError = Exception
    mod.RPCError = FakeRPCError
    mod.ESLURM_INVALID_JOB_ID = 2017
    mod.calls = []
    records = [pyslurm_job(id=100), pyslurm_job(id=207, array_id=200, array_task_id=3),
               pyslurm_job(id=300)]

    class Jobs:
        @staticmethod
        def load():
            mod.calls.append("Jobs.load")
            return {r.id: r for r in records}

    class Job:
        def __init__(self, job_id):
            self.job_id = job_id

        @staticmethod
        def load(job_id):
            raise FakeRPCError(2017, "Invalid job id specified")

        def requeue(self, hold=False):
            mod.calls.append(("requeue", self.job_id, hold))

    mod.Jobs, mod.Job = Jobs, Job
    config = types.SimpleNamespace(version="25.11.1")
    mod.slurmctld = types.SimpleNamespace(Config=types.SimpleNamespace(load=lambda: config))
    monkeypatch.setitem(sys.modules, "pyslurm", mod)
    return mod


def test_list_jobs_is_one_batched_load(fake_pyslurm):
    jobs = PyslurmScheduler().list_jobs(["100", "200_3", "999"])
    assert sorted(j.job_id for j in jobs) == ["100", "200_3"]
    assert fake_pyslurm.calls == ["Jobs.load"]


def test_unknown_job_becomes_job_not_found(fake_pyslurm):
    with pytest.raises(JobNotFound) as info:
        PyslurmScheduler().get_job("999")
    assert info.value.argv == ["pyslurm", "Job.load", "999"]
    assert info.value.returncode is None
    assert "Invalid job id" in info.value.stderr


def test_requeue_hold_of_array_task_uses_its_own_number(fake_pyslurm):
    PyslurmScheduler().requeue_hold("200_3")
    assert fake_pyslurm.calls[-1] == ("requeue", 207, True)


def test_clearing_excluded_nodes_is_refused_before_any_call(fake_pyslurm):
    with pytest.raises(SchedulerError, match="cannot clear"):
        PyslurmScheduler().set_excluded_nodes("100", [])
    assert fake_pyslurm.calls == []


def test_probe_with_fake_pyslurm_matching_slurm_is_viable(fake_pyslurm):
    probe = PyslurmScheduler().probe()
    assert probe.viable and probe.reason == "" and probe.version == "25.11.1"


def test_probe_reports_version_mismatch(fake_pyslurm):
    fake_pyslurm.__version__ = "24.11.0"
    probe = PyslurmScheduler().probe()
    assert not probe.viable
    assert "24.11" in probe.reason and "25.11.1" in probe.reason


def test_probe_reports_unreachable_controller(fake_pyslurm):
    def refuse():
        raise FakeRPCError(1001, "Unable to contact slurm controller (connect failure)")

    fake_pyslurm.slurmctld.Config.load = refuse
    probe = PyslurmScheduler().probe()
    assert not probe.viable
    assert "cannot reach slurmctld" in probe.reason and "connect failure" in probe.reason


def test_node_that_does_not_exist(fake_pyslurm):
    def load(name):
        raise FakeRPCError(-1, f"Node '{name}' does not exist")

    fake_pyslurm.Node = types.SimpleNamespace(load=load)
    with pytest.raises(NodeNotFound):
        PyslurmScheduler().get_node("ghost")

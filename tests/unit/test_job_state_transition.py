"""A requeued job whose old allocation still winds down, as 24.11 and 26.05 list it.

From 23.02 ``job_state`` is a list: right after ``scontrol requeuehold`` a job reads
``["PENDING", "COMPLETING"]``. 22.05 printed one word, ``COMPLETING``, for the same
moment. Recorded live in the chroots of tests/slurm_matrix.sh (tests/fixtures/slurm/README.md).
"""
from __future__ import annotations

import pytest

from recovery_agent.scheduler.base import ACTIVE_STATES
from recovery_agent.scheduler.cli_parse import job_state, parse_squeue
from tests.conftest import FIXTURES, slurm_fixture

NEWER = [v for v in ("24.11", "26.05")
         if (FIXTURES / "slurm" / v / "squeue_requeue_completing.json").exists()]


def test_both_newer_releases_were_recorded():
    assert NEWER == ["24.11", "26.05"]


@pytest.mark.parametrize("version", NEWER)
def test_requeued_job_still_completing_is_not_pending(version):
    raw = slurm_fixture(version, "squeue_requeue_completing.json")
    assert raw["jobs"][0]["job_state"] == ["PENDING", "COMPLETING"]
    (job,) = parse_squeue(raw)
    assert job.state == "COMPLETING" and job.state in ACTIVE_STATES
    assert job.state_flags == frozenset({"PENDING"})
    assert job.held and job.restart_count == 1


@pytest.mark.parametrize("version", NEWER)
def test_the_same_job_once_completed_is_pending_and_held(version):
    (job,) = parse_squeue(slurm_fixture(version, "squeue_requeue_done.json"))
    assert job.state == "PENDING" and not job.state_flags
    assert job.held and job.restart_count == 1


@pytest.mark.parametrize("value, expected", [
    ("COMPLETING", ("COMPLETING", frozenset())),           # 22.05: one word, as it was
    ("PENDING", ("PENDING", frozenset())),
    (["PENDING", "COMPLETING"], ("COMPLETING", frozenset({"PENDING"}))),
    (["RUNNING", "CONFIGURING"], ("CONFIGURING", frozenset({"RUNNING"}))),
    (["FAILED", "COMPLETING"], ("COMPLETING", frozenset({"FAILED"}))),
    (["PENDING", "REQUEUED"], ("PENDING", frozenset({"REQUEUED"}))),
    (["RUNNING"], ("RUNNING", frozenset())),
])
def test_job_state(value, expected):
    assert job_state(value) == expected

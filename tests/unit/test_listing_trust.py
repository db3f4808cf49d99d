"""A listing that carries errors, or that suddenly shows nothing, is not
evidence that jobs are gone (issue 14, finding 5). Recorded 22.05 output of a
frozen slurmctld (tests/fixtures/slurm/README.md) drives the CLI backend and the
actuator."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from recovery_agent.errors import JobNotFound, SchedulerError
from recovery_agent.scheduler.base import Job, ListingCheck
from recovery_agent.scheduler.cli_backend import CliScheduler
from recovery_agent.scheduler.cli_parse import (ListingError, parse_nodes_text,
                                                parse_scontrol_job, parse_squeue_text)
from recovery_agent.scheduler.runner import SlurmRunner

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "slurm" / "22.05"


def test_frozen_controller_listings_are_errors():
    with pytest.raises(ListingError, match="slurm_load_jobs"):
        parse_squeue_text((FIX / "squeue_ctld_frozen.json").read_bytes())
    with pytest.raises(ListingError, match="Unspecified error"):
        parse_nodes_text((FIX / "sinfo_ctld_frozen.json").read_bytes())
    # the same documents parsed whole (any other layout) are refused too
    doc = json.loads((FIX / "squeue_ctld_frozen.json").read_text())
    with pytest.raises(ListingError):
        parse_squeue_text(json.dumps(doc))
    # a healthy listing has "errors": [] and parses
    assert parse_squeue_text((FIX / "squeue_all.json").read_bytes())


def test_scontrol_one_line_is_parsed():
    job = parse_scontrol_job((FIX / "scontrol_show_job_oneline.txt").read_text())
    assert (job.job_id, job.state, job.restart_count) == ("3", "CANCELLED", 1)
    assert job.submit_time and job.user == "nobody"
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified\n") is None


class Replay(SlurmRunner):
    """The argv seam, answering with recorded output (as a frozen 22.05 does)."""

    def __init__(self, answers: dict) -> None:
        super().__init__()
        self.answers = answers
        self.ran: list[list[str]] = []

    def run(self, argv, timeout=None, check=True, binary=False):
        self.ran.append(list(argv))
        rc, out, err = self.answers[argv[0]]() if callable(self.answers[argv[0]]) \
            else self.answers[argv[0]]
        if check and rc:
            raise SchedulerError(f"{argv[0]}: exit {rc}", argv=argv, returncode=rc, stderr=err)
        return subprocess.CompletedProcess(argv, rc, out if binary else out.decode(), err)


def test_cli_backend_raises_on_a_frozen_controller():
    frozen = (FIX / "squeue_ctld_frozen.json").read_bytes()
    sched = CliScheduler(Replay({"squeue": (0, frozen, "")}))
    with pytest.raises(SchedulerError, match="errors from slurmctld"):
        sched.list_jobs()
    with pytest.raises(SchedulerError):
        sched.get_job("3")      # not JobNotFound: nothing is known


def test_empty_listing_after_live_jobs_is_confirmed_first():
    healthy = (FIX / "squeue_all.json").read_bytes()
    empty = json.dumps({"meta": {}, "errors": [], "jobs": []}).encode()
    listing = {"now": healthy}
    oneline = (FIX / "scontrol_show_job_oneline.txt").read_bytes()
    lookup = {"answer": (0, oneline, "")}
    runner = Replay({"squeue": lambda: (0, listing["now"], ""),
                     "scontrol": lambda: lookup["answer"]})
    sched = CliScheduler(runner)
    assert sched.list_jobs()
    listing["now"] = empty
    with pytest.raises(SchedulerError, match="not believing the listing"):
        sched.list_jobs()       # slurmctld still knows a job the listing lacks
    assert any(a[:3] == ["scontrol", "show", "job"] for a in runner.ran)
    lookup["answer"] = (1, b"", "slurm_load_jobs error: Invalid job id specified")
    assert sched.list_jobs() == []     # confirmed: they are all gone
    lookup["answer"] = (1, b"", "slurm_load_jobs error: Socket timed out on send/recv")
    listing["now"] = healthy
    sched.list_jobs()
    listing["now"] = empty
    with pytest.raises(SchedulerError, match="timed out"):
        sched.list_jobs()       # cannot confirm: not believed either


def test_listing_check_only_doubts_a_sudden_empty():
    check = ListingCheck()
    live = [Job(job_id="7", numeric_id=7, state="RUNNING")]
    asked = []

    def lookup(job_id):
        asked.append(job_id)
        raise JobNotFound(job_id)
    check.check(live, lookup)
    check.check(live, lookup)
    assert asked == []
    check.check([], lookup)
    assert asked == ["7"]
    check.check([], lookup)        # nothing live was seen before this one
    assert asked == ["7"]

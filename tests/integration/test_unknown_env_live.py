"""Issue 17 live: a --recovery environment the agent's config lacks (``dmeo``
for ``demo``) is flagged on the job's timeline and in ``recovery-ctl show job``.
The dev cluster's plugstack sets no allowed_envs, so sbatch takes the typo (the
refusal with allowed_envs is in test_spank.py)."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import job_row, wait_for
from tests.integration.test_ctl_live import ctl

pytestmark = pytest.mark.live


def flags(agent, job_pk: int) -> list[str]:
    return [r[0] for r in agent.query("select message from events where job = ? and "
                                      "kind = 'env_unknown'", job_pk)]


def test_a_mistyped_environment_is_flagged_on_the_timeline_and_in_show_job(agent, submit):
    typo = submit("-N1", "--recovery=dmeo", "-o", "/dev/null", script="sleep 30")
    known = submit("-N1", "--recovery=demo", "-o", "/dev/null", script="sleep 30")
    row = wait_for(lambda: job_row(agent, typo), 30, "the job registered")
    (flag,) = wait_for(lambda: flags(agent, row[0]), 30, "the unknown environment flagged")
    assert flag.startswith("environment 'dmeo' is not configured (known: ")
    assert "demo" in flag and "decisions use [environments.default], mode monitor" in flag
    shown = ctl(agent, "show", "job", typo)
    assert shown.returncode == 0, shown.stderr
    assert "Env=dmeo EnvKnown=no" in shown.stdout.splitlines()[0]
    assert json.loads(ctl(agent, "show", "job", typo, "--json").stdout)["job"]["env_known"] \
        is False
    other = wait_for(lambda: job_row(agent, known), 30, "the other job registered")
    assert flags(agent, other[0]) == []
    assert json.loads(ctl(agent, "show", "job", known, "--json").stdout)["job"]["env_known"]

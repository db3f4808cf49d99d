"""recovery-ctl against the dev cluster and a running agent: `check`, and changes
that go through the API signed with the real munged."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.live
CTL = str(Path(sys.executable).parent / "recovery-ctl")


def ctl(agent, *args, **env):
    return subprocess.run([CTL, *args], env={**agent.environ(), **env}, capture_output=True,
                          text=True, timeout=120)


def test_check_passes_on_the_dev_cluster(agent):
    result = ctl(agent, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines()
             if line[:4] in ("PASS", "FAIL", "WARN")}
    for name in ("config", "store", "slurm", "munge", "agent", "patterns", "state_dir"):
        assert lines[name] == "PASS", result.stdout
    assert lines["slurm.conf"] == "PASS"      # Prolog, Epilog, HealthCheckProgram wrappers
    assert "checks passed" in result.stdout.splitlines()[-1]


def test_check_fails_clearly_when_slurm_is_unreachable(agent, tmp_path):
    result = ctl(agent, "check", "--json",
                 RECOVERY_SCHEDULER_SLURM_CONF=str(tmp_path / "missing.conf"))
    assert result.returncode == 1
    rows = {r["check"]: r for r in json.loads(result.stdout)}
    assert rows["slurm"]["result"] == "FAIL" and rows["slurm.conf"]["result"] == "FAIL"


def test_mode_change_through_the_api_is_signed_and_audited(agent):
    result = ctl(agent, "mode", "act", "monitor", "--url", f"http://127.0.0.1:{agent.port}")
    assert result.returncode == 0, result.stderr
    assert "action -> monitor" in result.stdout
    try:
        events = agent.query("select data from events where kind = 'api_mode' "
                             "order by id desc limit 1")
        assert json.loads(events[0][0])["uid"] == 0
        shown = json.loads(ctl(agent, "show", "config", "--json").stdout)
        assert shown["environments"]["act"]["mode"] == "monitor"
    finally:
        ctl(agent, "mode", "act", "action", "--url", f"http://127.0.0.1:{agent.port}")


def test_report_scores_monitor_mode_against_a_human_drain(agent, submit, devcluster,
                                                          tmp_path, cleanup):
    from tests.integration.conftest import job_row, wait_for
    from tests.integration.test_recovery_live import final_rec, xid_under_job
    job_id, _, bad = xid_under_job(submit, devcluster, tmp_path, cleanup, agent,
                                   env="act:monitor")
    rec = final_rec(agent, job_row(agent, job_id)[0])
    assert rec["status"] == "would_have"
    # the on-call human drains the node by hand, with a reason of their own
    submit.runner.run(["scontrol", "update", f"nodename={bad}", "state=DRAIN",
                       "reason=GPU 0 dead, ticket 77"])
    wait_for(lambda: devcluster.scheduler().get_node(bad).drained, 15, "the human drain")
    result = ctl(agent, "report", "--since", "1h", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert bad in report["our_nodes"] and "GPU 0 dead" in report["human_drains"][bad]
    assert report["node_recall"] == 1.0 and report["compared"] >= 1
    text = ctl(agent, "report", "--since", "1h").stdout
    assert "precision" in text and "recall 100%" in text

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


def test_exclude_is_checked_against_the_nodes_slurm_has(agent):
    """A typo'd node is refused (through the agent's API and straight on the
    store), a node of the cluster is taken, and --force says it forced."""
    url = f"http://127.0.0.1:{agent.port}"
    refused = ctl(agent, "exclude", "nodeZZ", "--reason", "typo", "--url", url)
    assert refused.returncode == 1
    assert "Slurm has no node 'nodeZZ'" in refused.stderr and "HTTP 404" in refused.stderr
    local = ctl(agent, "exclude", "nodeZZ", "--reason", "typo", "--db", str(agent.db))
    assert local.returncode == 1 and "Slurm has no node 'nodeZZ'" in local.stderr
    assert agent.query("select name from nodes where name = 'nodeZZ'") == []
    try:
        taken = ctl(agent, "exclude", "node[3-4]", "--reason", "rack work", "--url", url,
                    "--json")
        assert taken.returncode == 0, taken.stderr
        assert [a["node"] for a in json.loads(taken.stdout)] == ["node3", "node4"]
        assert "forced" not in taken.stdout
        rows = agent.query("select name from nodes where excluded_by_operator = 1 "
                           "order by name")
        assert [r[0] for r in rows] == ["node3", "node4"]
        forced = ctl(agent, "exclude", "nodeZZ", "--reason", "retired", "--force",
                     "--url", url)
        assert forced.returncode == 0, forced.stderr
        assert "nodeZZ: excluded from retries (forced: Slurm has no node" in forced.stdout
    finally:
        ctl(agent, "include", "node[3-4],nodeZZ", "--url", url)
    assert agent.query("select count(*) from nodes where excluded_by_operator = 1") == [(0,)]

"""A user's job output cannot steer the agent at nodes (issue 14, finding 2),
live: a real unprivileged user's job prints well-formed kernel XID lines and
fails. The agent reads them (the detection is stored) and proves nothing with
them: no node outside the job is excluded, struck or drained, and a kernel line
naming the job's own node drains nothing either."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import AgentProcess, job_row, wait_for

pytestmark = [pytest.mark.live, pytest.mark.security]

FORGED = ("Dec  1 07:30:00 {node} kernel: [ 5123.443210] NVRM: Xid (PCI:0000:18:00): 79, "
          "pid=4411, name=python3, GPU has fallen off the bus.")


@pytest.fixture
def agent_here(devcluster, tmp_path):
    a = AgentProcess(devcluster, db=tmp_path / "recovery.db")
    a.start()
    yield a
    a.stop()


def forged_failure(submit, mallory, named: str) -> str:
    script = f'echo "step 1 loss 2.0"; echo "{FORGED.format(node=named)}"; sleep 2; exit 1'
    return submit("-N1", "--nodelist=node1", "--recovery=act",
                  "-o", "forged-%j.out", script=script, as_user=mallory)


def decided(agent, job_id: str):
    row = job_row(agent, job_id)
    if row is None:
        return None
    recs = agent.query("select action, status, exclude, target_nodes, scope from "
                       "recommendations where job = ?", row[0])
    verdicts = agent.query("select data from events where job = ? and kind = 'verdict'",
                           row[0])
    return (row, recs, verdicts) if verdicts else None


@pytest.mark.parametrize("named", ["node4", "node1"])
def test_forged_kernel_line_moves_no_node(agent_here, submit, devcluster, unix_users, named):
    mallory = unix_users("mallory")
    sched = devcluster.scheduler()
    job_id = forged_failure(submit, mallory, named)
    row, recs, verdicts = wait_for(lambda: decided(agent_here, job_id), 90,
                                   f"a verdict on job {job_id}")
    # the agent did read the line: the boundary is not that it missed it
    seen = agent_here.query("select pattern_id from detections where job = ?", row[0])
    assert ("kernel.xid",) in seen
    verdict = json.loads(verdicts[0][0])
    assert verdict["category"] != "gpu_hardware" and named not in verdict["nodes"]
    for action, status, exclude, targets, scope in recs:
        assert named not in json.loads(exclude or "[]")
        assert scope != "node", f"a node recommendation from forged output: {action}"
    assert agent_here.query("select node from strikes") == []
    assert not sched.get_node(named).drained
    assert not sched.get_node("node1").drained

"""A user's job output cannot steer the agent at nodes (issue 14, finding 2),
live: a real unprivileged user's job prints well-formed kernel XID lines and
fails. The agent reads them (the detection is stored) and proves nothing with
them: no node outside the job is excluded, struck or drained, and a kernel line
naming the job's own node drains nothing either."""
from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.integration.conftest import AgentProcess, job_row, wait_for
from tests.integration.test_recovery_live import job_now

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
    # the verdict first: the decider writes it with its recommendations in one
    # transaction, so once it shows they do (read the other way round, a commit
    # between the two reads gave a verdict with no recommendations)
    verdicts = agent.query("select data from events where job = ? and kind = 'verdict'",
                           row[0])
    if not verdicts:
        return None
    recs = agent.query("select action, status, exclude, target_nodes, scope from "
                       "recommendations where job = ?", row[0])
    return row, recs, verdicts


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


# NCCL's own lines, the format of real logs (the NET/IB line is the example of
# nccl.ib_completion_from_peer in etc/patterns/nccl.toml; the bootstrap line
# is NVIDIA/nccl#1232's), with the job's choice of hosts and addresses: a job
# may state any layout it likes.
BOOTSTRAP = "{host}:13571:13571 [0] NCCL INFO Bootstrap : Using enp10s0:{addr}<0>"
PEER = ("{node}:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion "
        "from peer {addr}<54862> with status=12 opcode=0 len=0 vendor err 129 (Recv)")


def forged_peer(submit, mallory, node: str, host: str, addr: str) -> str:
    """A job on ``node`` whose log says address ``addr`` is ``host`` and that
    its IB peer at that address failed; its retry (restart count 1) succeeds."""
    lines = [BOOTSTRAP.format(host=host, addr=addr), PEER.format(node=node, addr=addr)]
    echo = "; ".join(f"echo '{line}'" for line in lines)
    script = (f'[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && exit 0; echo "step 1 loss 2.0"; '
              f'{echo}; sleep 2; exit 1')
    return submit("-N1", f"--nodelist={node}", "--recovery=act", "-o", "peer-%j.out",
                  script=script, as_user=mallory)


def test_a_layout_the_job_states_names_no_node_outside_it(agent_here, submit, devcluster,
                                                          unix_users):
    """The log maps the failed peer's address to node4; the job ran on node1.
    The agent reads the layout (the line is stored, the verdict weighs it) and
    blames nothing outside the job: node4 is not excluded, struck or drained."""
    mallory = unix_users("mallory")
    job_id = forged_peer(submit, mallory, "node1", "node4", "10.77.0.4")
    row, recs, verdicts = wait_for(lambda: decided(agent_here, job_id), 90,
                                   f"a verdict on job {job_id}")
    seen = agent_here.query("select pattern_id from detections where job = ?", row[0])
    assert ("nccl.ib_completion_from_peer",) in seen
    verdict = json.loads(verdicts[0][0])
    assert "node4" not in verdict["nodes"]
    for _action, _status, exclude, targets, scope in recs:
        assert "node4" not in json.loads(exclude or "[]") + json.loads(targets or "[]")
    assert agent_here.query("select node from strikes where node = 'node4'") == []
    assert not devcluster.scheduler().get_node("node4").drained


def test_one_users_output_blaming_their_own_node_keeps_it_from_their_retries_only(
        agent_here, submit, devcluster, unix_users):
    """Two of one user's jobs on node2 each say their IB peer at node2's
    (stated) address failed. Each retry excludes node2, both strikes are on the
    record, and node2 is not drained: interconnect_strikes=2 counts one voice
    per user when only the jobs' own output speaks (the old agent drained it)."""
    mallory = unix_users("mallory")
    sched = devcluster.scheduler()
    for n in (1, 2):
        job_id = forged_peer(submit, mallory, "node2", "node2", "10.77.0.2")
        row, recs, verdicts = wait_for(lambda: decided(agent_here, job_id), 90,
                                       f"a verdict on job {job_id} ({n} of 2)")
        verdict = json.loads(verdicts[0][0])
        assert (verdict["category"], verdict["nodes"]) == ("interconnect", ["node2"])
        excluded = [json.loads(exclude or "[]") for _a, _s, exclude, _t, scope in recs
                    if scope != "node"]
        assert excluded and all(x == ["node2"] for x in excluded), recs
        assert all(scope != "node" for *_, scope in recs), f"a node action: {recs}"
    strikes = agent_here.query("select user, category, witnessed from strikes "
                               "where node = 'node2'")
    assert strikes == [(mallory.name, "interconnect", 0)] * 2
    assert not sched.get_node("node2").drained


# What a site's Node Health Check quotes of a user: LBNL NHC's check_ps_cpu
# (mej/nhc scripts/lbnl_ps.nhc), run with -f, names the offending process by
# its whole command line, which its owner chooses; die() hands the message to
# helpers/node-mark-offline, which drains the node with the reason "NHC: " and
# the message. The job's process names a node outside the job and a GPU fault.
HOSTILE_NAME = ("NVRM: Xid (PCI:0000:18:00): 79, pid=4411, name=python3, GPU has fallen "
                "off the bus. node4 mlx5_0: port 1 is down")


def nhc_reason_for(user: str) -> tuple[str, str]:
    """The reason NHC's CPU check writes for ``user``'s hostile process, from
    what ``ps`` shows of it as NHC reads it, or ('', '') while it is not seen."""
    listing = subprocess.run(["ps", "axo", "user:32,uid,pid,ppid,pcpu,args"],
                             capture_output=True, text=True, timeout=10,
                             env={"COLUMNS": "1024", "PATH": "/usr/bin:/bin"}).stdout
    for line in listing.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 5 and fields[0] == user and fields[5] == "NVRM:":
            args = " ".join(fields[5:])
            return (f'NHC: check_ps_cpu:  Process "{args}" ({fields[2]}) of {user} '
                    f"using {fields[4]}% CPU (limit 0%)"), fields[2]
    return "", ""


def test_a_process_name_the_health_check_quotes_names_no_node_and_no_fault(
        agent_here, submit, devcluster, unix_users, cleanup):
    """A real unprivileged user's job runs a process whose command line is a
    kernel XID line naming node4; the site's health check (its real message
    format, done here by root as NHC does) drains the job's node quoting that
    name, and the job fails. The verdict reads NHC's check alone: the drained
    node is the job's own and is excluded; no GPU fault, no kernel line, and
    nothing of node4 is read from the quoted text."""
    mallory = unix_users("mallory")
    sched = devcluster.scheduler()
    gate = Path(tempfile.mkdtemp(prefix="rsec-nhc-", dir="/tmp"))
    gate.chmod(0o755)
    go = gate / "go"
    try:
        script = ('[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0; echo "step 1 loss 2.0"; '
                  f"bash -c 'exec -a \"$0\" sleep 600' {shlex.quote(HOSTILE_NAME)} & hostile=$!; "
                  f"for i in $(seq 600); do [ -e {go} ] && break; sleep 0.2; done; "
                  "kill $hostile; exit 1")
        job_id = submit("-N2", "--ntasks-per-node=1", "--recovery=act",
                        "-o", "nhc-%j.out", script=script, as_user=mallory)
        job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j,
                       60, f"job {job_id} RUNNING")
        batch = job.nodes[0]
        cleanup.append((batch, agent_here))
        reason, pid = wait_for(lambda: nhc_reason_for(mallory.name)[0] and
                               nhc_reason_for(mallory.name), 30,
                               "the user's process in ps")
        assert HOSTILE_NAME in reason
        submit.runner.run(["scontrol", "update", f"nodename={batch}", "state=DRAIN",
                           f"reason={reason}"])
        drained = sched.get_node(batch)
        assert drained.drained and "node4" in drained.reason and "Xid" in drained.reason
        go.touch()
        row, recs, verdicts = wait_for(lambda: decided(agent_here, job_id), 90,
                                       f"a verdict on job {job_id}")
    finally:
        go.unlink(missing_ok=True)
        gate.rmdir()
    verdict = json.loads(verdicts[0][0])
    seen = {p for (p,) in agent_here.query("select pattern_id from detections "
                                            "where job = ?", row[0])}
    # NHC's check was read (the boundary is not that the reason went unread)
    assert "nhc.check_failed" in json.dumps(verdict)
    assert "xid" not in json.dumps(verdict).lower()
    assert not any(p.startswith(("kernel.", "node.", "ib.", "mlx")) for p in seen), seen
    assert verdict["category"] == "system_software"
    assert verdict["nodes"] == [batch]
    assert not verdict.get("gpus")
    for _action, _status, exclude, targets, scope in recs:
        named = json.loads(exclude or "[]") + json.loads(targets or "[]")
        assert "node4" not in named and set(named) <= set(job.nodes), recs
        assert scope != "node", f"a node action from a quoted name: {recs}"
    assert agent_here.query("select node, category from strikes where node != ?",
                            batch) == []
    assert all(cat != "gpu_hardware" for (cat,) in agent_here.query(
        "select category from strikes where node = ?", batch))
    assert not sched.get_node("node4").drained
    ours = agent_here.query("select drained_by_us from nodes where name = ?", batch)
    assert not ours or not ours[0][0]

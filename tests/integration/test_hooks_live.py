"""Issue 3 end to end on the dev cluster: opt-in jobs register through the real
Prolog/Epilog hooks (fake NVML underneath pynvml), XIDs land tied to node, GPU
and job, and reports spool while the agent is down."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import job_row, wait_for

pytestmark = pytest.mark.live


def reports_for(agent, job_pk: int, hook: str) -> list[tuple]:
    return agent.query("select node, gpu_count, gpus from node_reports "
                       "where job = ? and hook = ? order by node", job_pk, hook)


def test_opted_in_job_registers_with_every_nodes_gpus(agent, submit, devcluster):
    job_id = submit("-N2", "--recovery=prod:action", script="sleep 1")
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered by the prolog")
    assert row[1:] == ("prod", "action", "prod:action")
    prologs = wait_for(lambda: (r := reports_for(agent, row[0], "prolog")) and len(r) == 2
                       and r, 30, "a prolog report from both nodes")
    gpus_per_node = len(json.loads((devcluster.lay.gpu_state("node1")).read_text())["gpus"])
    for node, count, gpus in prologs:
        assert count == gpus_per_node
        uuids = {g["uuid"] for g in json.loads(gpus)}
        expected = {g["uuid"] for g in json.loads(devcluster.lay.gpu_state(node).read_text())
                    ["gpus"]}
        assert uuids == expected, f"{node} reported other GPUs than its state file"
    wait_for(lambda: len(reports_for(agent, row[0], "epilog")) == 2, 60, "epilog reports")
    # the job's key is completed with slurmctld's submit time, in the background
    submit_time = wait_for(lambda: agent.query("select submit_time from jobs where id = ?",
                                               row[0])[0][0], 30, "submit time filled in")
    squeue = devcluster.scheduler().get_job(job_id)
    assert submit_time == squeue.submit_time


def test_job_without_opt_in_leaves_no_trace(agent, submit):
    job_id = submit("-N1", script="true")
    marker = submit("-N1", "--comment=recovery=lab", script="true")
    wait_for(lambda: job_row(agent, marker), 30, "comment-form job registered")
    assert job_row(agent, job_id) is None


def test_injected_xid_is_tied_to_node_gpu_and_job(agent, submit, devcluster):
    go = devcluster.lay.jobs / f"go-{time.time_ns()}"
    # the job runs until the XID is in the kernel log, so the epilog must see it
    job_id = submit("-N1", "-w", "node2", "--recovery=prod",
                    script=f"for i in $(seq 300); do [ -e {go} ] && exit 0; sleep 0.2; done")
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    result = subprocess.run([sys.executable, "-m", "recovery_devtools.devcluster", "inject", "xid",
                             "--node", "node2", "--gpu", "1", "--xid", "79",
                             "--state-dir", str(devcluster.lay.root)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    go.touch()
    gpu1 = json.loads(devcluster.lay.gpu_state("node2").read_text())["gpus"][1]
    xid = wait_for(lambda: agent.query(
        "select node, gpu_index, gpu_uuid, job from xids where xid = 79 and job = ?", row[0]),
        60, "XID 79 stored from the epilog")
    assert xid[0] == ("node2", 1, gpu1["uuid"], row[0])
    # the agent's verdict for the attempt blames node2 on the node report's XID
    verdict = wait_for(lambda: agent.query(
        "select data from events where job = ? and kind = 'verdict'", row[0]), 60, "verdict")
    data = json.loads(verdict[-1][0])
    assert (data["blame"], data["category"], data["action"], data["nodes"]) == \
        ("node", "gpu_hardware", "requeue_exclude", ["node2"])


@pytest.mark.resilience("agent down: node reports spooled and replayed",
                        "live: prolog reports spooled on the nodes and replayed into the store")
def test_reports_spool_while_the_agent_is_down(agent, submit, devcluster):
    agent.stop()
    try:
        job_id = submit("-N2", "--recovery=prod", script="true")
        spools = [devcluster.lay.spool_dir(n) for n in devcluster.node_names()]
        wait_for(lambda: sum(len(list(p.glob("*.json"))) for p in spools if p.exists()) >= 4,
                 60, "prolog and epilog reports of both nodes in the spools")
        assert job_row(agent, job_id) is None
        # the nodes that spooled (read now: once the agent is back, the epilog's
        # replayer may empty a spool before the trigger job below starts)
        nodes = sorted({p.parent.name for p in spools for _ in p.glob("*.json")})
    finally:
        agent.start()
    # the next hook run on each node replays its spool before its own report (if
    # the epilog's replayer has not delivered it already)
    trigger = submit(f"-N{len(nodes)}", "-w", ",".join(nodes), "--recovery=prod", script="true")
    wait_for(lambda: job_row(agent, trigger), 60, "the trigger job registered")
    row = wait_for(lambda: job_row(agent, job_id), 60, "the spooled job registered")
    wait_for(lambda: len(reports_for(agent, row[0], "epilog")) == 2, 60,
             "both spooled epilog reports")
    # a replayed file is unlinked just after the agent answers. A health report
    # that a node spooled while the agent was down, on a node the trigger job
    # did not use, waits for that node's next hook run: its next health check
    # (HealthCheckInterval=60) at the latest
    wait_for(lambda: not [f for p in spools if p.exists() for f in p.glob("*.json")],
             75, "empty spools on every node")

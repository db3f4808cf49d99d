"""Issue 19 live: the goodput ledger of a real recovery on the dev cluster.

The demo's recovery (a 2-node training job loses a GPU to XID 79 after it has
checkpointed; the agent requeues it without the node and it resumes), then
``recovery-ctl report goodput --json`` on the agent's store: one incident,
recovered, whose work lost matches the job's own output (the time from its last
``checkpoint saved`` line to its ``CUDA error`` line) within one checkpoint
interval, and whose steps lost match it (the step that failed, less one, minus
the checkpoint's step) within one step-line interval. The checkpoints are dated
by their save lines' own stamps."""
from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main
from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import AgentProcess, job_row, wait_for
from tests.integration.test_recovery_live import final_rec, output_has, second_node, train_job

pytestmark = pytest.mark.live
# train_job's settings: a checkpoint every 20 steps of 0.1 s; a step line every 10
CKPT_INTERVAL = 20 * 0.1
LOG_EVERY = 10
_STAMP = re.compile(r"^\[(\S+)Z\] ")
_FAILED_STEP = re.compile(r" step (\d+): CUDA error")
_SAVED_STEP = re.compile(r"checkpoint saved: \S+ step=(\d+)")


def _when(line: str) -> float:
    stamp = _STAMP.match(line).group(1)
    return datetime.fromisoformat(stamp + "+00:00").timestamp()


def truth(out: Path) -> float:
    """Work lost as the job printed it: its first CUDA error minus the last
    checkpoint saved before it."""
    lines = out.read_text(errors="replace").splitlines()
    fail = next(i for i, l in enumerate(lines) if "CUDA error on this node's GPU" in l)
    saved = [l for l in lines[:fail] if "checkpoint saved:" in l]
    return _when(lines[fail]) - _when(saved[-1])


def steps_truth(out: Path) -> int:
    """Steps lost as the job printed them: the steps done before the one that
    failed, since the last checkpoint saved before it."""
    lines = out.read_text(errors="replace").splitlines()
    fail = next(i for i, l in enumerate(lines) if "CUDA error on this node's GPU" in l)
    failed = int(_FAILED_STEP.search(lines[fail]).group(1))
    saved = [int(m.group(1)) for l in lines[:fail] if (m := _SAVED_STEP.search(l))]
    return failed - 1 - saved[-1]


def goodput(agent: AgentProcess) -> dict:
    result = CliRunner().invoke(main, ["report", "goodput", "--since", "1h", "--json",
                                       "--config", str(agent.config), "--db",
                                       str(agent.db)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_report_goodput_after_an_xid_recovery(submit, devcluster, tmp_path, cleanup):
    agent = AgentProcess(devcluster, db=tmp_path / "recovery.db")
    agent.start()
    try:
        job_id, out = train_job(submit, devcluster, tmp_path, "act")
        _, bad = second_node(devcluster.scheduler(), job_id)
        cleanup.append((bad, agent))
        wait_for(lambda: output_has(out, "checkpoint saved:", 2), 60, "2 checkpoints")
        # halfway to the next checkpoint: work lost is about a second, the size
        # of the lag the agent's reading of a save line would have added
        time.sleep(CKPT_INTERVAL / 2)
        inject_xid(devcluster.lay, bad, 0, 79)
        row = job_row(agent, job_id)
        rec = final_rec(agent, row[0])
        assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")

        def recovered():
            report = goodput(agent)
            mine = [i for i in report["incidents"] if i["job_id"] == job_id]
            return report if mine and mine[0]["outcome"] == "recovered" else None
        report = wait_for(recovered, 120, "the ledger to call the incident recovered")
    finally:
        agent.stop()
    # jobs of earlier tests still in Slurm are registered by this agent after their
    # first attempts ended: those attempts are incidents of unknown outcome
    (inc,) = [i for i in report["incidents"] if i["job_id"] == job_id]
    others = [i for i in report["incidents"] if i["job_id"] != job_id]
    assert all(i["outcome"] == "unknown" and "attempt" in i["unknown"] for i in others)
    assert inc["category"] == "gpu_hardware"
    assert inc["nodes"] == [bad] and inc["attempt"] == 0
    lost = truth(out)
    assert inc["work_lost_s"] is not None, inc["unknown"]
    assert abs(inc["work_lost_s"] - lost) <= CKPT_INTERVAL, (inc, lost)
    steps = steps_truth(out)
    assert inc["steps_lost"] is not None, inc["unknown"]
    assert abs(inc["steps_lost"] - steps) <= LOG_EVERY, (inc, steps)
    print(f"measured: work lost {inc['work_lost_s']:.3f} s (the output says {lost:.3f} s), "
          f"steps lost {inc['steps_lost']} (the output says {steps})")
    clocks = agent.query("select json_extract(data, '$.clock') from events where "
                         "kind = 'checkpoint' and job = ?", job_row(agent, job_id)[0])
    assert clocks and {c for (c,) in clocks} == {"line"}, clocks
    assert inc["downtime_s"] is not None and inc["downtime_s"] > 0
    assert inc["failure"] <= inc["detected"] <= inc["acted"] <= inc["running_again"]
    assert report["groups"]["all"]["incidents"] == 1 + len(others)
    assert report["groups"]["all"]["recovered"] == 1
    assert report["assumptions"]["requeue_delay_s"] == 120

"""Issue 4 live: the agent follows opted-in jobs' output on the dev cluster and
records hangs, stragglers and checkpoint progress."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.conftest import job_row, wait_for

pytestmark = pytest.mark.live
REPO = Path(__file__).resolve().parents[2]


def detections(agent, job_pk: int, rule: str) -> list[tuple]:
    return agent.query("select pattern_id, category, node, rank, evidence from detections "
                       "where job = ? and pattern_id = ?", job_pk, rule)


def test_silent_job_is_detected_as_hung(agent, submit):
    job_id = submit("-N1", "--recovery=prod,hang=6s", "-o", "hang-%j.out",
                    script="echo 'step 1 loss 2.0'; echo 'step 2 loss 1.9'; sleep 120")
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    (hang,) = wait_for(lambda: detections(agent, row[0], "hang"), 45, "a hang detection")
    assert hang[1] == "nccl_timeout_hang"
    evidence = json.loads(hang[4])
    assert any("step 2" in line["text"] for line in evidence["lines"])


def test_slow_rank_is_a_straggler_on_its_host(agent, submit):
    script = ("srun -N2 --ntasks-per-node=1 sh -c 'for i in $(seq 60); do "
              "if [ $SLURM_PROCID = 1 ]; then t=0.90; else t=0.30; fi; "
              "echo \"rank $SLURM_PROCID/2 $SLURMD_NODENAME step $i step_time ${t}s\"; "
              "sleep 0.3; done'")
    job_id = submit("-N2", "--recovery=prod", "-o", "straggler-%j.out", script=script)
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    (found,) = wait_for(lambda: detections(agent, row[0], "straggler"), 60,
                        "a straggler detection")
    job_nodes = agent.query("select nodes from attempts where job = ?", row[0])[0][0]
    slow_host = json.loads(job_nodes)[1]
    assert found[2] == slow_host and found[3] == 1


def test_checkpoint_progress_is_recorded_per_attempt(agent, submit, devcluster, tmp_path):
    ckpt = devcluster.lay.jobs / f"ckpt-{tmp_path.name}"
    ckpt.mkdir()
    script = (f"python3 {REPO / 'examples' / 'train.py'} --ckpt-dir {ckpt} --steps 60 "
              "--step-time 0.05 --ckpt-every 20")
    job_id = submit("-N1", f"--recovery=prod,ckpt={ckpt}", "-o", "ckpt-%j.out", script=script)
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    saved = wait_for(lambda: [r for r in agent.query(
        "select ckpt_path, ckpt_step from attempts where job = ? and attempt = 0", row[0])
        if r[0]], 60, "the attempt's newest checkpoint")
    path, step = saved[0]
    assert path.startswith(str(ckpt)) and step in (20, 40, 60)
    events = agent.query("select message from events where job = ? and kind = 'checkpoint'",
                         row[0])
    assert events and "step" in events[-1][0]

"""Issue 14, findings 3 and 4, live: an unprivileged user's job points its
output, or its ckpt= glob, at what only root may read. The agent reads job
files as root; with the job user's rights, nothing of root's reaches the store,
the API or the timeline, and the timeline says why the output was not followed.

The attacker is a real Unix user (tests/hostile.py) submitting through sbatch,
whose job does its own swapping; the agent is the dev cluster's (its
``agent.log_roots`` is the cluster's jobs directory, where every path here lies,
so what refuses is the user's rights, not the roots).
"""
from __future__ import annotations

import json
import shutil
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import job_row, wait_for

pytestmark = [pytest.mark.live, pytest.mark.security]

SECRET = "root:$6$rsecLIVESECRET:19000:0:99999:7:::"
DIR_RECHECK = 30.0   # recovery_agent.inputs.userfs.DIR_RECHECK: a kept directory is walked again
XID = "NVRM: Xid (PCI:0000:b7:00): 79, pid=1, name=x, GPU has fallen off the bus."


@pytest.fixture
def vault(devcluster):
    """A root-only directory inside the jobs directory: 0700, files 0600,
    holding a secret and a kernel XID line (which, if read, would blame a node)."""
    folder = devcluster.lay.jobs / f"vault-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o700)
    for name in ("secret.out", "out"):
        (folder / name).write_text(f"{SECRET}\n{XID}\n")
        (folder / name).chmod(0o600)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def api(agent, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}{path}", timeout=10) as resp:
        return resp.read().decode()


def events(agent, job_pk: int, kind: str) -> list[str]:
    return [row[0] for row in agent.query(
        "select message from events where job = ? and kind = ?", job_pk, kind)]


def nothing_of_root(agent, job_id: str, job_pk: int) -> None:
    """Neither the store nor the API carries a byte of the root-only files."""
    evidence = agent.query("select evidence from detections where job = ?", job_pk)
    assert not any("Xid" in row[0] or "rsec" in row[0] for row in evidence), evidence
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/timeline"):
        body = api(agent, path)
        assert SECRET not in body and "GPU has fallen off the bus" not in body, path
    xids = agent.query("select count(*) from detections where job = ? and "
                       "category = 'gpu_hardware'", job_pk)[0][0]
    assert xids == 0


def test_output_pointed_at_a_root_only_file_is_not_read(agent, submit, unix_users, vault):
    mallory = unix_users("mallory")
    job_id = submit("-N1", "--hold", "--comment=recovery=default:monitor",
                    f"--output={vault}/secret.out", script="echo hi", as_user=mallory)
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered while held")
    # released by its owner: the launch fails (the user cannot write there) and the
    # agent reads the ended attempt's output for its verdict
    agent.cluster.runner(timeout=30).run(mallory.argv(["scontrol", "release", job_id]))
    wait_for(lambda: events(agent, row[0], "verdict"), 60, "the attempt's verdict")
    nothing_of_root(agent, job_id, row[0])
    refusal = events(agent, row[0], "output_not_followed")
    assert len(refusal) == 1
    assert refusal[0].startswith("output not followed:") and "not searchable" in refusal[0]
    timeline = json.loads(api(agent, f"/v1/jobs/{job_id}/timeline"))["events"]
    assert any(e["kind"] == "output_not_followed" for e in timeline)


def test_a_directory_swapped_for_a_symlink_mid_job_is_not_followed(agent, submit,
                                                                   unix_users, vault):
    mallory = unix_users("mallory")
    own = agent.cluster.lay.jobs / f"mal-{uuid.uuid4().hex[:8]}"
    mallory.run(["mkdir", "-p", str(own / "run")])
    # the job reports, waits until the agent follows its output, swaps its output
    # directory for a link to root's, then fails in its own (still open) file
    script = (f"echo 'step 1 loss 2.0'; sleep 8; mv {own}/run {own}/run.old; "
              f"ln -s {vault} {own}/run; echo 'torch.cuda.OutOfMemoryError: CUDA out of "
              f"memory. Tried to allocate 2.00 GiB'; sleep 120")
    try:
        job_id = submit("-N1", "--comment=recovery=default:monitor",
                        f"--output={own}/run/out", script=script, as_user=mallory)
        row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
        # the user's own line after the swap is still read (the directory walked
        # at first is kept open), then the walk again finds the user's link
        wait_for(lambda: agent.query("select 1 from detections where job = ? and "
                                     "category = 'oom'", row[0]), 45,
                 "the job's own failure line, written after the swap")
        time.sleep(DIR_RECHECK + 6)      # the directory walked again, a few polls more
        nothing_of_root(agent, job_id, row[0])
        refusal = events(agent, row[0], "output_not_followed")
        assert len(refusal) == 1 and f"symbolic link owned by uid {mallory.uid}" in refusal[0]
    finally:
        shutil.rmtree(own, ignore_errors=True)


def test_a_ckpt_glob_into_root_only_files_finds_nothing(agent, submit, unix_users):
    mallory = unix_users("mallory")
    job_id = submit("-N1", "--comment=recovery=act:action,ckpt=/root/*", script="sleep 120",
                    as_user=mallory)
    row = wait_for(lambda: job_row(agent, job_id), 30, "job registered")
    wait_for(lambda: agent.query("select 1 from attempts where job = ? and start_time > 0",
                                 row[0]), 30, "the job running")
    planted = Path("/root") / f"rsec-ckpt-{uuid.uuid4().hex[:8]}-step-900.pt"
    planted.write_text("root's own file\n")    # newer than the attempt's start
    try:
        time.sleep(40)     # past the checkpoint scan interval (30 s)
        assert events(agent, row[0], "checkpoint") == []
        (ckpt,) = agent.query("select ckpt_path from attempts where job = ?", row[0])[0]
        assert ckpt is None
        assert planted.name not in api(agent, f"/v1/jobs/{job_id}")
        assert planted.name not in api(agent, f"/v1/jobs/{job_id}/timeline")
    finally:
        planted.unlink()

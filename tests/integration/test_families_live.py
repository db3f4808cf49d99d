"""Issue 15 live: one failure family a test, on the dev cluster, end to end.

Each job prints real lines of its family (quoted from the public reports the
corpus cites: the row id is above each) or makes Slurm print them itself, and
exits as such a job does; node faults go into a node's kernel log as the
driver writes them. The test checks what the agent decided and did in Slurm:
the action, and which node, if any, was excluded. Every family has unit tests
on many more lines (tests/unit/test_verdict_families.py and the packs'
examples); here the whole path runs: output file, tailer, scanner, the node
hooks' reports, attribution, policy and the actuator.
"""
from __future__ import annotations

import json
import shlex

import pytest

from recovery_devtools.devcluster.inject import inject_xid
from tests.integration.conftest import job_row, wait_for
# act_agent: the recovery suite's module agent (its own store), one per module here too
from tests.integration.test_recovery_live import act_agent, final_rec, job_now, recs  # noqa: F401

pytestmark = pytest.mark.live

# ho-hllm20-uniqueid-socket-timeout-slow-dataset (public_tune.jsonl)
STORE_TIMEOUT = ("torch.distributed.DistBackendError: [3] is setting up NCCL communicator and "
                 "retrieving ncclUniqueId from [0] via c10d key-value store by key '0', but "
                 "store->get('0') got error: Socket Timeout")
# ho-nccl1612-bootstrap-closed-before-magic (public_tune.jsonl)
PEER_CLOSED = "[0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by remote peer 10.10.1.3<36138>"
# ho-chainer7586-ompi-segv-libnccl-mlx4 (public_tune.jsonl)
NCCL_SEGFAULT = ("Signal: Segmentation fault (11)",
                 "[ 2] /usr/lib/x86_64-linux-gnu/libnccl.so.2(+0x2b136)[0x7ff2bf5c3136]",
                 "[ 3] /usr/lib/x86_64-linux-gnu/libnccl.so.2(+0x24aa0)[0x7ff2bf5bcaa0]",
                 "[ 4] /usr/lib/x86_64-linux-gnu/libnccl.so.2(+0x25d1f)[0x7ff2bf5bdd1f]")
# vllm6976-watchdog-illegal-memory-access (dev_failures.jsonl), the CUDA runtime's string
ILLEGAL_ADDRESS = "RuntimeError: CUDA error: an illegal memory access was encountered"
# ho-mockingbird774-errno28-after-8-days (public_tune.jsonl)
FULL_DISK = "OSError: [Errno 28] No space left on device"


def printing(*lines: str, code: int = 1, wait_for_file: str | None = None) -> str:
    """A batch script that prints ``lines`` (to its output file) and exits ``code``;
    with ``wait_for_file``, only once that file exists."""
    wait = (f"for i in $(seq 600); do [ -e {shlex.quote(wait_for_file)} ] && break; "
            "sleep 0.2; done; " if wait_for_file else "")
    return ('echo "step 1 loss 2.0"; ' + wait
            + "".join(f"printf '%s\\n' {shlex.quote(line)}; " for line in lines)
            + f"exit {code}")


def first_decision(agent, submit, script: str, *args: str, timeout: float = 60) -> dict:
    job_id = submit("-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                    "--recovery=act", "-o", "family-%j.out", *args, script=script)
    row = wait_for(lambda: job_row(agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(agent, row[0], timeout=timeout, attempt=0)
    rec["job_id"], rec["job_pk"] = job_id, row[0]
    return rec


def running_until(submit, devcluster, go, *lines: str) -> tuple[str, str]:
    """A two-node job that prints ``lines`` and fails once the file ``go``
    exists: its id and its second node, once Slurm runs it."""
    sched = devcluster.scheduler()
    job_id = submit("-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                    "--recovery=act", "-o", "family-%j.out",
                    script=printing(*lines, wait_for_file=str(go)))
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j, 60,
                   f"job {job_id} RUNNING")
    return job_id, job.nodes[1]


def reason_of(agent, rec_id: int) -> str:
    return agent.query("select reason from recommendations where id = ?", rec_id)[0][0] or ""


def test_a_bare_task_exit_is_unexplained_requeued_once_then_stopped(act_agent, submit,
                                                                     devcluster):
    """Slurm's own 'srun: error: NODE: task N: Exited with exit code 3' and
    nothing else: what any failure leaves behind. Requeued, no node blamed; the
    second one spends the unexplained budget (unknown_max_restarts = 1)."""
    script = "srun --kill-on-bad-exit=1 bash -c 'echo step 1 loss 2.0; exit 3'"
    rec = first_decision(act_agent, submit, script)
    assert (rec["action"], rec["status"], rec["rule"]) == ("requeue", "done", "unexplained")
    assert rec["exclude"] == []
    second = final_rec(act_agent, rec["job_pk"], timeout=90, attempt=1)
    assert (second["action"], second["rule"]) == ("stop", "unknown_budget")


def test_a_store_timeout_is_requeued_without_blaming_a_node(act_agent, submit):
    rec = first_decision(act_agent, submit, printing(STORE_TIMEOUT))
    assert (rec["action"], rec["status"]) == ("requeue", "done")
    assert rec["exclude"] == []
    assert "store" in reason_of(act_agent, rec["id"])


def test_a_peer_closing_the_connection_is_requeued_not_stopped(act_agent, submit):
    rec = first_decision(act_agent, submit, printing(PEER_CLOSED))
    assert (rec["action"], rec["status"]) == ("requeue", "done")
    # the peer (10.10.1.3) is no node of this job: nothing outside it is excluded
    assert rec["exclude"] == []


def test_a_segfault_inside_nccl_is_requeued_not_stopped(act_agent, submit):
    rec = first_decision(act_agent, submit, printing(*NCCL_SEGFAULT, code=139))
    assert (rec["action"], rec["status"]) == ("requeue", "done")
    assert "libnccl" in reason_of(act_agent, rec["id"])


def test_a_cuda_error_with_an_xid_on_the_node_excludes_that_node(act_agent, submit,
                                                                devcluster, tmp_path,
                                                                cleanup):
    """An illegal address may be the code or the GPU; XID 119 (a GSP RPC
    timeout, outside the codes the first packs knew) in that node's kernel log
    says it is the GPU."""
    go = tmp_path / "go"
    job_id, bad = running_until(submit, devcluster, go, ILLEGAL_ADDRESS)
    cleanup.append((bad, act_agent))
    inject_xid(devcluster.lay, bad, 0, 119)
    go.touch()
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
    assert rec["exclude"] == [bad]


def test_a_full_disk_stops_with_the_reason(act_agent, submit, devcluster):
    rec = first_decision(act_agent, submit, printing(FULL_DISK))
    assert (rec["action"], rec["status"]) == ("stop", "done")
    assert "no space left" in reason_of(act_agent, rec["id"]).lower()
    job = devcluster.scheduler().get_job(rec["job_id"])
    assert job.restart_count == 0
    assert [r for r in recs(act_agent, rec["job_pk"], "job") if r["action"] != "stop"] == []


# The driver's own line, written into the node's kernel log by inject_xid in the
# format NVRM prints; each code's reading is the catalog's bucket
# (tests/fixtures/corpus/xid_catalog.jsonl), not a hand-picked set.
@pytest.mark.parametrize("xid, action, excluded", [
    (64, "requeue_exclude", True),    # row remapping failure: RESET_GPU, the GPU stays bad
    (63, "requeue", False),           # a row remapping event: IGNORE, no reason to exclude
    # a graphics exception: the program's own fault in the catalog, but a node report
    # cannot tell whose program (another job's on a shared node): node evidence only
    # counts for the fatal codes, so this is a failure without evidence, requeued
    (13, "requeue", False),
], ids=["xid64-exclude", "xid63-informational", "xid13-not-ours-to-judge"])
def test_an_xid_alone_gets_its_catalog_decision(act_agent, submit, devcluster, tmp_path,
                                                cleanup, xid, action, excluded):
    """A job that fails with nothing in its own output but a step line, while
    one of its nodes' kernel log gets one XID: the catalog's bucket decides."""
    go = tmp_path / "go"
    job_id, bad = running_until(submit, devcluster, go)
    cleanup.append((bad, act_agent))
    inject_xid(devcluster.lay, bad, 0, xid)
    go.touch()
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    assert (rec["action"], rec["status"]) == (action, "done")
    assert rec["exclude"] == ([bad] if excluded else [])
    if not excluded:
        assert "without evidence" in reason_of(act_agent, rec["id"])


# a checkpoint-error write-up quoting PyTorch's inline_container.cc (filesystem.toml)
SHORT_WRITE = ("RuntimeError: [enforce fail at inline_container.cc:858] . PytorchStreamWriter "
               "failed writing file data/37: file write failed")


def test_a_checkpoint_write_error_without_a_full_disk_is_retried(act_agent, submit):
    """A short write with no ENOSPC or quota text: a transient filesystem error
    is retried once (a full disk is stopped: test_a_full_disk_stops_...)."""
    rec = first_decision(act_agent, submit, printing(SHORT_WRITE))
    assert (rec["action"], rec["status"]) == ("requeue", "done")
    assert rec["exclude"] == []
    assert "i/o error" in reason_of(act_agent, rec["id"]).lower()


def test_an_ib_failure_naming_a_peer_by_address_excludes_that_peer(act_agent, submit):
    """The printing node says its IB peer at an address failed; NCCL's bootstrap
    line of the job's other node says whose address that is (the dev cluster's
    nodes share 127.0.0.1 in Slurm, so only the log can say). The peer is
    excluded, not the node that printed the line. The lines are NCCL's formats
    (nccl.ib_completion_from_peer's example, NVIDIA/nccl#1232's bootstrap line)
    with this job's hosts."""
    script = ('[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0; '
              'peer=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | grep -vx "$SLURMD_NODENAME"'
              ' | head -n1); echo "step 1 loss 2.0"; '
              'echo "$peer:13571:13571 [0] NCCL INFO Bootstrap : Using enp10s0:10.77.0.9<0>"; '
              'echo "$SLURMD_NODENAME:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got '
              'completion from peer 10.77.0.9<54862> with status=12 opcode=0 len=0 vendor err '
              '129 (Recv)"; sleep 1; exit 1')
    rec = first_decision(act_agent, submit, script)
    nodes, printer = act_agent.query("select nodes, batch_host from attempts where job = ? "
                                     "and attempt = 0", rec["job_pk"])[0]
    assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
    assert rec["exclude"] == [n for n in json.loads(nodes) if n != printer]


# nvidia-smi's output when the loaded kernel module and the user-space driver
# differ (kernel.driver_unavailable; labdao/plex#18, mozilla/translations#1167)
NVML_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch"


def test_a_driver_library_mismatch_excludes_the_node_it_ran_on(act_agent, submit):
    """A node-level software fault: the node is excluded, the job is not stopped."""
    job_id = submit("-N1", "--requeue", "--open-mode=append", "--recovery=act",
                    "-o", "family-%j.out",
                    script='[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0; '
                           + printing(NVML_MISMATCH))
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    ran_on = act_agent.query("select nodes from attempts where job = ? and attempt = 0",
                             row[0])[0][0]
    assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
    assert rec["exclude"] == json.loads(ran_on)


# nvidia-smi's device-handle error in the 5xx drivers' layout (index, then bus
# id): the GPU stopped answering (kernel.gpu_lost; public notes quoting
# nvidia-smi, find_string id 51863788626)
GPU_HANDLE_LOST = "Unable to determine the device handle for GPU3: 0000:5F:00.0: Unknown Error"


def test_a_gpu_that_nvidia_smi_cannot_reach_excludes_the_node_it_ran_on(act_agent, submit):
    """The job's own nvidia-smi says a GPU no longer answers: the node is
    excluded and the job requeued, in whichever layout nvidia-smi prints it."""
    job_id = submit("-N1", "--requeue", "--open-mode=append", "--recovery=act",
                    "-o", "family-%j.out",
                    script='[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0; '
                           + printing(GPU_HANDLE_LOST))
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    ran_on = act_agent.query("select nodes from attempts where job = ? and attempt = 0",
                             row[0])[0][0]
    assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
    assert rec["exclude"] == json.loads(ran_on)


# Lightning's own end-of-fit line (lifecycle.lightning_fit_done), then PyTorch's
# watchdog timeout as the process groups are torn down (test_attribution.TIMEOUT's format)
FIT_DONE = "`Trainer.fit` stopped: `max_epochs=20` reached."
TEARDOWN_TIMEOUT = ("[rank0]:[E1 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective "
                    "operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) "
                    "ran for 600100 milliseconds before timing out.")


def test_a_watchdog_timeout_after_the_training_finished_is_not_requeued(act_agent, submit,
                                                                        devcluster):
    job_id = submit("-N2", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                    "--recovery=act", "-o", "family-%j.out",
                    script=printing(FIT_DONE, TEARDOWN_TIMEOUT))
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    verdict = wait_for(lambda: act_agent.query("select data from events where job = ? and "
                                               "kind = 'verdict'", row[0]), 60,
                       f"a verdict on job {job_id}")
    assert '"action": "none"' in verdict[0][0]
    assert [r for r in recs(act_agent, row[0], "job") if r["action"] != "none"] == []
    assert devcluster.scheduler().get_job(job_id).restart_count == 0


def test_a_cuda_error_that_follows_the_job_onto_other_nodes_is_stopped(act_agent, submit,
                                                                     devcluster, tmp_path,
                                                                     cleanup):
    """Reasoning across attempts. An illegal address may be the GPU: the first
    time it is requeued. An admin drains the node it ran on meanwhile, so the
    retry runs elsewhere; the same error there follows the job: it is the code,
    stopped on its second time, saying why."""
    sched = devcluster.scheduler()
    go = tmp_path / "go"
    script = (f'if [ "${{SLURM_RESTART_COUNT:-0}}" -eq 0 ]; then {printing(ILLEGAL_ADDRESS, wait_for_file=str(go))}; '
              f'else {printing(ILLEGAL_ADDRESS)}; fi')
    job_id = submit("-N1", "--requeue", "--open-mode=append", "--recovery=act",
                    "-o", "family-%j.out", script=script)
    job = wait_for(lambda: (j := job_now(sched, job_id)) and j.state == "RUNNING" and j, 60,
                   f"job {job_id} RUNNING")
    (first,) = job.nodes
    cleanup.append((first, act_agent))
    sched.drain_node(first, "test: the retry must run on another node")
    go.touch()
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    assert (rec["action"], rec["status"], rec["exclude"]) == ("requeue", "done", [])
    second = final_rec(act_agent, row[0], timeout=90, attempt=1)
    assert (second["action"], second["rule"]) == ("stop", "recurring")
    ran = act_agent.query("select nodes from attempts where job = ? and attempt = 1", row[0])
    assert first not in json.loads(ran[0][0])
    reason = reason_of(act_agent, second["id"])
    assert "follows the job" in reason and first in reason


# basicsr737-watchdog-default-pg (dev_failures.jsonl)
WATCHDOG_808 = ("[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog "
                "caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, "
                "NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 "
                "milliseconds before timing out.")


def test_a_hang_at_the_same_collective_twice_is_stopped(act_agent, submit):
    """Reasoning across attempts for hangs. A watchdog timeout alone is
    unexplained: requeued. The retry times out at the very same collective
    (ALLREDUCE number 808 of the same size): the run reaches that hang every
    time, so it is stopped as recurring, not by the unexplained budget, saying
    which collective and which attempt."""
    rec = first_decision(act_agent, submit, printing(WATCHDOG_808))
    assert (rec["action"], rec["status"], rec["exclude"]) == ("requeue", "done", [])
    second = final_rec(act_agent, rec["job_pk"], timeout=90, attempt=1)
    assert (second["action"], second["rule"]) == ("stop", "recurring")
    reason = reason_of(act_agent, second["id"])
    assert "same collective (ALLREDUCE number 808)" in reason and "attempt 0" in reason


# The drain LBNL NHC's helpers/node-mark-offline sets when a check fails, as an
# scontrol show node in a public repository prints it (find_string id 24738526160)
NHC_DRAIN = "NHC: check_ps_service:  Service sshd (process sshd) owned by root not running"


def test_a_node_the_health_check_drains_during_the_job_is_excluded(act_agent, submit,
                                                                   devcluster, tmp_path,
                                                                   cleanup):
    """Naming the node from Slurm's own state: the job's log says nothing of
    why it failed, but the site's health check drained one of its nodes while
    it ran. Only an admin or Slurm sets that reason: the verdict reads it as
    that node's evidence, and the job is requeued without it."""
    go = tmp_path / "go"
    job_id, bad = running_until(submit, devcluster, go)
    cleanup.append((bad, act_agent))
    submit.runner.run(["scontrol", "update", f"nodename={bad}", "state=DRAIN",
                       f"reason={NHC_DRAIN}"])
    go.touch()
    row = wait_for(lambda: job_row(act_agent, job_id), 30, f"job {job_id} registered")
    rec = final_rec(act_agent, row[0], attempt=0)
    assert (rec["action"], rec["status"]) == ("requeue_exclude", "done")
    assert rec["exclude"] == [bad]
    assert "nhc.check_failed" in reason_of(act_agent, rec["id"])
    # the health check's drain stays the site's: not taken over as ours
    ours = act_agent.query("select drained_by_us from nodes where name = ?", bad)
    assert not ours or not ours[0][0]

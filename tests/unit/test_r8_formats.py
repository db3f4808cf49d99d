"""Round-8 families (issue 15): an abort thrown on CUDA's exit teardown, the
ROCm runtime's GPU reset and memory fault, Slurm's launch-failure reason and
registration mismatches, slurmd's configuration fatals, submitit's signal
report, GKE's XID node condition and Ray's dead-node line (information only).

Every log line is a real one, quoted in the public thread or page named above
it (the same ones the rules in etc/patterns/*.toml cite); none is built from a
format.
"""
from __future__ import annotations

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.evidence import all_detections
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")


def verdict(lines):
    return attribute(SCANNER.scan_lines(lines, source="t"), context_from_lines(lines))


def fired(lines):
    context = context_from_lines(lines)
    return [d.rule for d in all_detections(SCANNER.scan_lines(lines, source="t"), context)
            if d.severity != "info"]


# hpcaitech/ColossalAI#1427: the last test epoch logged, then the abort
AFTER_LAST_EPOCH = [
    "                    INFO     colossalai - colossalai - INFO: [Epoch 99 / Test]: Accuracy = 0.8823 | Loss = 0.79231 | Throughput = 3403.1",
    "terminate called after throwing an instance of \u2018c10::CUDAError\u2019",
    "  what():  CUDA error: driver shutting down",
    "CUDA kernel errors might be asynchronously reported at some other API call,so the stacktrace below might be incorrect.",
]
# ComputationalRadiationPhysics/picongpu#3064: an abort on another CUDA error
ABORT_ON_OOM = [
    "terminate called after throwing an instance of 'CUDA::error' ",
    "  what():  /scratch/ws/.../picongpu/thirdParty/mallocMC/src/include/mallocMC/reservePoolPolicies/SimpleCudaMalloc_impl.hpp(42):",
    "error: out of memory",
]


def test_an_abort_on_the_runtimes_exit_teardown_is_not_a_failure():
    v = verdict(AFTER_LAST_EPOCH)
    assert v.action == "none" and not fired(AFTER_LAST_EPOCH)


def test_an_abort_on_any_other_exception_still_counts():
    assert "signal.abort" in fired(ABORT_ON_OOM)
    assert verdict(ABORT_ON_OOM).action == "requeue"


# ROCm/legacy-rocm-build#5259 (the host masked by the reporter)
ROCM_HANG = [
    "HW Exception by GPU node-4 (Agent handle: 0x1ebc04e0) reason :GPU Hang",
    "HW Exception by GPU node-4 (Agent handle: 0x2df30600) reason :GPU Hang",
    "E0902 15:10:49.013000 819010 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -6) local_rank: 0 (pid: 819025) of binary: <masked_by_issue_reporter>/bin/python",
]
# a ROCm user's issue text (find_string id 57033237149): the fault, then the hang
FAULT_THEN_HANG = [
    "Memory access fault by GPU node-1 (Agent handle: 0x556e9b7e3360) on address 0x7f52c3f5f000. Reason: Page not present or supervisor privilege.",
    "HW Exception by GPU node-1 (Agent handle: 0x563e71f098b0) reason :GPU Hang",
]


def test_a_rocm_gpu_hang_is_the_gpu_requeued_with_the_gpu_named():
    v = verdict(ROCM_HANG)
    assert (v.category, v.action) == ("gpu_hardware", "requeue")
    assert "node-4" in v.gpus


def test_a_rocm_memory_access_fault_reads_as_an_illegal_address():
    rules = fired(FAULT_THEN_HANG[:1])
    assert rules == ["cuda.illegal_address"]
    assert verdict(FAULT_THEN_HANG[:1]).action == "requeue"   # the GPU or the code: once


# AMD-AGI/Infera PR#170 (a CI wrapper's squeue summary)
LAUNCH_FAILURE = [
    "state=PENDING reason=JobLaunchFailure (dispatch confirmation failed (0/1 confirmed):",
    "                                       1 gpu/resource allocation mismatch) nodes=[]",
]
# clusterinthecloud/terraform#11
LOW_MEMORY = [
    "REASON                                  NODELIST            ",
    "Low RealMemory                          compute[001-003]    ",
]
# ComputeCanada/puppet-magic_castle#27
GRES_FATAL = ["Feb 20 18:59:13 node2.int.rubberducky.calculquebec.cloud slurmd[57977]: fatal: gres.conf duplicate records for gpu"]
# facebookincubator/submitit#1656
SUBMITIT = [
    "[2021-10-21 11:50:15,215][submitit][INFO] - Job has timed out. Ran 0 minutes out of requested 2 minutes.",
    "[2021-10-21 11:50:15,216][submitit][WARNING] - Caught signal SIGUSR1 on rmc-gpu05: this job is timed-out.",
    "[2021-10-21 11:50:15,216][submitit][INFO] - Calling checkpoint method.",
]


def test_slurm_launch_failure_moves_the_job_off_its_node():
    v = verdict(LAUNCH_FAILURE)
    assert (v.category, v.action) == ("system_software", "requeue_exclude")


def test_configuration_the_machines_do_not_meet_is_stopped():
    assert verdict(LOW_MEMORY).action == "stop"
    v = verdict(GRES_FATAL)
    assert (v.category, v.action) == ("system_software", "stop")
    assert not v.nodes       # every node given the same gres.conf fails: not this one's fault


def test_submitits_signal_report_is_a_requeue_not_a_failure_of_the_job():
    assert verdict(SUBMITIT).action == "requeue"


# GoogleCloudPlatform/container-engine-accelerators PR#497 (Xid 31 triggered on purpose)
NODE_CONDITION = ['  XidCriticalError     True    Mon, 23 Jun 2025 18:45:43 +0000   Mon, 23 Jun 2025 18:44:57 +0000   {"31":true}                  6e43a052-e544-467b-a972-63d7cd2ce80a']


def test_a_node_condition_xid_is_decided_by_its_code():
    detections = SCANNER.scan_lines(NODE_CONDITION, source="t")
    assert [(d.rule, d.xid) for d in detections] == [("kernel.xid_node_condition", 31)]
    assert verdict(NODE_CONDITION).action == "stop"      # 31: the program's bad access


# ray-project/ray#15467 (an autoscaler downscale) and #18449 (a raylet lost mid-run):
# the same line, so it fires nothing alone
RAY_DEAD = ["The node with node id: 40d7709d4275bb0784e227591eceeeb9a8604fb30e5a28e4c90d9c04 and ip: 192.168.77.252 has been marked dead because the detector has missed too many heartbeats from it. This can happen when a raylet crashes unexpectedly or has lagging heartbeats."]


def test_rays_dead_node_line_alone_fires_nothing():
    detections = SCANNER.scan_lines(RAY_DEAD, source="t")
    assert [d.rule for d in detections] == ["ray.node_marked_dead"]
    assert detections[0].host == "192.168.77.252"
    assert not fired(RAY_DEAD) and verdict(RAY_DEAD).action == "none"

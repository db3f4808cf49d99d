"""Round-8 families (issue 15): an abort thrown on CUDA's exit teardown, the
ROCm runtime's GPU reset and memory fault, Slurm's launch-failure reason and
registration mismatches, slurmd's configuration fatals, submitit's signal
report, GKE's XID node condition and Ray's dead-node line (information only).

Every log line is a real one, quoted in the public thread or page named above
it (the same ones the rules in etc/patterns/*.toml cite); none is built from a
format.
"""
from __future__ import annotations

from tests.unit.packs import fired_rules, scanner, scored_verdict  # noqa: F401 (scanner: a fixture)


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


def test_an_abort_on_the_runtimes_exit_teardown_is_not_a_failure(scanner):
    v = scored_verdict(scanner, AFTER_LAST_EPOCH)
    assert v.action == "none" and not fired_rules(scanner, AFTER_LAST_EPOCH)


def test_an_abort_on_any_other_exception_still_counts(scanner):
    assert "signal.abort" in fired_rules(scanner, ABORT_ON_OOM)
    assert scored_verdict(scanner, ABORT_ON_OOM).action == "requeue"


# ROCm/legacy-rocm-build#5259 (the host masked by the reporter)
ROCM_HANG = [
    "HW Exception by GPU node-4 (Agent handle: 0x1ebc04e0) reason :GPU Hang",
    "HW Exception by GPU node-4 (Agent handle: 0x2df30600) reason :GPU Hang",
    "E0902 15:10:49.013000 819010 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -6) local_rank: 0 (pid: 819025) of binary: <masked_by_issue_reporter>/bin/python",
]
# a ROCm user's issue text (find_string id 57033237149): the fault, then the hang
FAULT_THEN_HANG = [
    "Quantizing mlp.experts.14.up_proj in layer     [1 of 47] ██-------------------------------------------------------------| 0:19:08 / 7:39:12 [2/48] 4.2%Memory access fault by GPU node-1 (Agent handle: 0x556e9b7e3360) on address 0x7f52c3f5f000. Reason: Page not present or supervisor privilege.",
    "HW Exception by GPU node-1 (Agent handle: 0x563e71f098b0) reason :GPU Hang",
]


def test_a_rocm_gpu_hang_is_the_gpu_requeued_with_the_gpu_named(scanner):
    v = scored_verdict(scanner, ROCM_HANG)
    assert (v.category, v.action) == ("gpu_hardware", "requeue")
    assert "node-4" in v.gpus


def test_a_rocm_memory_access_fault_reads_as_an_illegal_address(scanner):
    rules = fired_rules(scanner, FAULT_THEN_HANG[:1])
    assert rules == ["cuda.illegal_address"]
    assert scored_verdict(scanner, FAULT_THEN_HANG[:1]).action == "requeue"   # the GPU or the code: once


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


def test_slurm_launch_failure_moves_the_job_off_its_node(scanner):
    v = scored_verdict(scanner, LAUNCH_FAILURE)
    assert (v.category, v.action) == ("system_software", "requeue_exclude")


def test_configuration_the_machines_do_not_meet_is_stopped(scanner):
    assert scored_verdict(scanner, LOW_MEMORY).action == "stop"
    v = scored_verdict(scanner, GRES_FATAL)
    assert (v.category, v.action) == ("system_software", "stop")
    assert not v.nodes       # every node given the same gres.conf fails: not this one's fault


def test_submitits_signal_report_is_a_requeue_not_a_failure_of_the_job(scanner):
    assert scored_verdict(scanner, SUBMITIT).action == "requeue"


# GoogleCloudPlatform/container-engine-accelerators PR#497 (Xid 31 triggered on purpose)
NODE_CONDITION = ['  XidCriticalError     True    Mon, 23 Jun 2025 18:45:43 +0000   Mon, 23 Jun 2025 18:44:57 +0000   {"31":true}                  6e43a052-e544-467b-a972-63d7cd2ce80a']


def test_a_node_condition_xid_is_decided_by_its_code(scanner):
    detections = scanner.scan_lines(NODE_CONDITION, source="t")
    assert [(d.rule, d.xid) for d in detections] == [("kernel.xid_node_condition", 31)]
    assert scored_verdict(scanner, NODE_CONDITION).action == "stop"      # 31: the program's bad access


# ray-project/ray#15467 (an autoscaler downscale) and #18449 (a raylet lost mid-run):
# the same line, so it fires nothing alone
RAY_DEAD = ["The node with node id: 40d7709d4275bb0784e227591eceeeb9a8604fb30e5a28e4c90d9c04 and ip: 192.168.77.252 has been marked dead because the detector has missed too many heartbeats from it. This can happen when a raylet crashes unexpectedly or has lagging heartbeats."]


def test_rays_dead_node_line_alone_fires_nothing(scanner):
    detections = scanner.scan_lines(RAY_DEAD, source="t")
    assert [d.rule for d in detections] == ["ray.node_marked_dead"]
    assert detections[0].host == "192.168.77.252"
    assert not fired_rules(scanner, RAY_DEAD) and scored_verdict(scanner, RAY_DEAD).action == "none"


# ROCm/legacy-rocm-build#2494 (the resets of two Radeon cards failed)
AMDGPU_RESET_FAILED = [
    "[22344.295190] amdgpu 0000:03:00.0: amdgpu: SMU: response:0xFFFFFFFF for index:47 param:0x00000000 message:Mode1Reset?",
    "[22344.295194] amdgpu 0000:03:00.0: amdgpu: GPU mode1 reset failed",
    "[22344.456139] amdgpu 0000:83:00.0: amdgpu: ASIC reset failed with error, -121 for drm dev, 0000:83:00.0",
]
# HabanaAI/Setup_and_Install#1
GAUDI_UNUSABLE = [
    "[   72.993087] habanalabs hl2: Failed to communicate with Device CPU (CPU-CP timeout)",
    "[   72.993204] habanalabs hl2: failed to initialize the H/W",
    "[   72.993269] habanalabs 0000:1a:00.0: Failed to initialize hl2. Device is NOT usable !",
]
# intel/compute-runtime#944
XE_HANG = [
    "  2026-09-13T22:23:00 xe 0000:3d:00.0: [drm] Tile0: GT0: Engine reset: engine_class=ccs, logical_mask: 0x1, guc_id=9,",
    "  state=0x29",
]


def test_other_vendors_gpus_that_cannot_be_reset_or_started_are_excluded_by_bus_id(scanner):
    v = scored_verdict(scanner, AMDGPU_RESET_FAILED)
    assert (v.category, v.action) == ("gpu_hardware", "requeue_exclude")
    assert set(v.gpus) >= {"0000:03:00", "0000:83:00"}
    v = scored_verdict(scanner, GAUDI_UNUSABLE)
    assert (v.action, v.gpus) == ("requeue_exclude", ("0000:1a:00",))


def test_an_intel_engine_hang_is_requeued_like_xid_8(scanner):
    v = scored_verdict(scanner, XE_HANG)
    assert (v.category, v.action) == ("gpu_hardware", "requeue")


# OLCF's Frontier user guide (XNACK mismatch); ROCm/TheRock#2801 (no device)
HIP_NO_BINARY = ['    "hipErrorNoBinaryForGpu: Unable to find code object for all current devices!"',
                 "    srun: error: frontier002: task 0: Aborted"]
HIP_NO_DEVICE = ["2026-01-07T00:09:11.3147822Z ERROR    test_rocm_sanity:test_rocm_sanity.py:37 :3:hip_memory.cpp           :783 : 1642835146154 us: [pid:551 tid: 0x7056b7626f80] hipHostMalloc: Returned hipErrorNoDevice : "]
# kokkos/kokkos-kernels PR#455 (the first CUDA call)
DEVICE_COUNT_UNKNOWN = ["  what():  cudaGetDeviceCount( & m_cudaDevCount ) error( cudaErrorUnknown): unknown error /ascldap/users/bmkelle/ClusterGaussSeidel/kokkos/core/src/Cuda/Kokkos_Cuda_Instance.cpp:204"]
# alexgkendall/SegNet-Tutorial#71 (glog's CHECK in Caffe)
CAFFE_OOM = ["F1215 16:35:47.650579  5231 syncedmem.cpp:51] Check failed: error == cudaSuccess (2 vs. 0)  out of memory",
             "*** Check failure stack trace: ***"]


def test_hip_and_glog_spellings_of_cuda_errors(scanner):
    v = scored_verdict(scanner, HIP_NO_BINARY)
    assert (v.category, v.action) == ("application", "stop")
    assert scored_verdict(scanner, HIP_NO_DEVICE).action == "requeue_exclude"
    assert scored_verdict(scanner, DEVICE_COUNT_UNKNOWN).action == "requeue_exclude"
    v = scored_verdict(scanner, CAFFE_OOM)
    assert (v.category, v.action) == ("oom", "stop")


# NERSC's Cray MPICH page; GoogleCloudPlatform/container-engine-accelerators#100;
# ArjunaCluster/ArjunaUsers#164
GTL = ["MPIDI_CRAY_init: GPU_SUPPORT_ENABLED is requested, but GTL library is not linked"]
POD_OUT_OF_GPUS = ["gpu-replicaset-bxbc2                    0/1     OutOfnvidia.com/gpu   0          2h    <none>        controller-2.k8s.ml.prod.srcd.host   <none>"]
REBOOTED = ["and BTW gpu nodes are down too, c015: Reason=Node unexpectedly rebooted [slurm@2022-07-23T15:27:10]"]


def test_build_setup_stops_and_node_restarts_requeue(scanner):
    assert scored_verdict(scanner, GTL).action == "stop"
    assert scored_verdict(scanner, POD_OUT_OF_GPUS).action == "requeue"
    v = scored_verdict(scanner, REBOOTED)
    assert (v.action, v.nodes) == ("requeue", ())

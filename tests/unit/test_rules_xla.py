"""JAX, XLA and TensorFlow formats of etc/patterns/xla.toml (issue 15, round 4):
the coordination service's heartbeat timeouts, fate-sharing aborts, an
unreachable leader and barrier timeouts; XLA's rendezvous warning;
TensorFlow's collective abort; XLA/TF GPU allocation failures; cuDNN version
mismatches and initialization failures; JAX finding no CUDA backend -- read
alone and through attribution.

Every line is a real one, quoted in the public thread or document the rule's
comment in etc/patterns/xla.toml names; none is built from a format string.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_pack, load_rules, shipped_dir
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# jax-ml/jax#23599 (the service's side, process 0)
HEARTBEAT = ("2024-10-09 15:47:38.568412: E external/xla/xla/tsl/distributed_runtime/coordination/"
             "coordination_service.cc:1170] /job:jax_worker/replica:0/task:0 has been set to ERROR in "
             "coordination service: UNAVAILABLE: Task /job:jax_worker/replica:0/task:0 heartbeat timeout. "
             "This indicates that the remote task has failed, got preempted, or crashed unexpectedly. Check "
             "the task logs for an earlier error to debug further. "
             "[type.googleapis.com/tensorflow.CoordinationServiceError='']")
# jax-ml/jax docs/fault_tolerance.rst: a survivor after task 3 was killed
FATE_SHARED = [
    "   E0926 17:26:32.075402  157988 coordination_service_agent.cc:332] Polled an error from coordination "
    "service (this can be an error from this or another task).",
    "   F0926 17:26:32.075587  157988 client.h:77] Terminating process because the JAX distributed service "
    "detected fatal errors. This most likely indicates that another task died; see the other task logs for "
    "more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. "
    "absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):",
    "   /job:jax_worker/replica:0/task:3",
    "   The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. "
    "preemption, eviction) to debug further.",
]
# jax-ml/jax docs/fault_tolerance.rst: every process after process 0 was killed
LEADER_GONE = [
    "   E0929 17:42:48.594192 1044529 coordination_service_agent.cc:332] Polled an error from coordination "
    "service (this can be an error from this or another task).",
    "   F0929 17:42:48.594200 1044529 client.h:77] Terminating process because the JAX distributed service "
    "detected fatal errors. This most likely indicates that another task died; see the other task logs for "
    "more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. "
    "absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
    "preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier logs "
    "from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug further.",
    "   Additional GRPC error information from remote target coordination_service while calling "
    "/tensorflow.CoordinationService/PollForError:",
    '   :UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}',
]
# ayaka14732/llama-2-jax#20: the traceback's tail
CONNECT_BARRIER = [
    '  File "/root/miniconda3/envs/jax/lib/python3.11/site-packages/jax/_src/distributed.py", line 95, in initialize',
    "    self.client.connect()",
    "jaxlib.xla_extension.XlaRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Barrier_id: "
    "PjRT_Client_Connect. Timed out task names:",
    "/job:jax_worker/replica:0/task:1",
]
# alpa-projects/alpa#826
CONNECT_TIMEOUT = "jaxlib.xla_extension.XlaRuntimeError: DEADLINE_EXCEEDED: Connect() timed out after 0 with 1 attempts."
# jax-ml/jax#22740
RENDEZVOUS = ("2024-07-29 17:14:59.920189: E external/xla/xla/service/rendezvous.cc:38] This thread has been "
              "waiting for `initialize clique for rank 6; clique=devices=[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]; "
              "stream=0; run_id=724296073` for 10 seconds and may be stuck. Expected 8 threads to join the "
              "rendezvous, but not all of them arrived on time.")
# tensorflow/tensorflow#60706
TF_ABORT = ("2023-05-25 11:10:57.934361: E tensorflow/core/common_runtime/base_collective_executor.cc:249] "
            "BaseCollectiveExecutor::StartAbort DEADLINE_EXCEEDED: Deadline Exceeded")
# google-deepmind/jax_privacy#10, jax-ml/jax#788, NVIDIA/DeepLearningExamples#405
OOM_REQUEST = "Original error: RESOURCE_EXHAUSTED: Failed to allocate request for 176.00MiB (184549376B) on device ordinal 0"
OOM_AUTOTUNE = ("2019-06-08 03:44:36.087182: E external/org_tensorflow/tensorflow/compiler/xla/service/gpu/"
                "cudnn_conv_algorithm_picker.cc:555] Resource exhausted: Failed to allocate request for 3.39GiB "
                "(3640655872B) on device ordinal 0")
OOM_TF = "  (0) Resource exhausted: Out of memory while trying to allocate 68852648264 bytes."
# google-deepmind/alphafold#1023 (matched by oom.cuda)
OOM_XLA = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7406166528 bytes."
# flatironinstitute/nemos#345: the allocator's own "not a failure" warning
BFC_NOT_A_FAILURE = ("2025-05-18 21:59:55.086788: W external/xla/xla/tsl/framework/bfc_allocator.cc:310] "
                     "Allocator (GPU_0_bfc) ran out of memory trying to allocate 3.37GiB with freed_by_count=0. "
                     "The caller indicates that this is not a failure, but this may mean that there could be "
                     "performance gains if more memory were available.")
# jax-ml/jax#16901, jax-ml/jax#15361
CUDNN_MISMATCH = " Loaded runtime CuDNN library: 8.5.0 but source was compiled with: 8.6.0. CuDNN"
DNN_INIT = "XlaRuntimeError: FAILED_PRECONDITION: DNN library initialization failed. Look at the errors above for more details."
# keras-team/keras-io's JAX example output (find_string id 2925799628), an
# issue quoted in a public repository (find_string id 22206303855)
CUSOLVER_OLDER = ("CUDA backend failed to initialize: Found cuSOLVER version 11405, but JAX was built against "
                  "version 11502, which is newer. The copy of cuSOLVER that is installed must be at least as new "
                  "as the version against which JAX was built. (Set TF_CPP_MIN_LOG_LEVEL=0 and rerun for more info.)")
CUDNN_MISSING = ("CUDA backend failed to initialize: Unable to load cuDNN. Is it installed? "
                 "(Set TF_CPP_MIN_LOG_LEVEL=0 and rerun for more info.)")
# jax-ml/jax#22626
CUDNN_HANDLE = [
    "2024-07-19 15:49:01.341533: E external/xla/xla/stream_executor/cuda/cuda_dnn.cc:439] Could not create "
    "cudnn handle: CUDNN_STATUS_INTERNAL_ERROR",
    "2024-07-19 15:49:01.341571: E external/xla/xla/stream_executor/cuda/cuda_dnn.cc:443] Memory usage: "
    "2624061440 bytes free, 12524191744 bytes total.",
]
# jax-ml/jax#28194, jax-ml/jax#24866 (with the cuInit failure before it)
NO_CUDA_BACKEND = ("RuntimeError: Unable to initialize backend 'cuda': INTERNAL: no supported devices found for "
                   "platform CUDA (you may need to uninstall the failing plugin package, or set "
                   "JAX_PLATFORMS=cpu to skip this backend.)")
CUINIT_NOT_READY = [
    "2024-11-12 15:36:48.401160: E external/xla/xla/stream_executor/cuda/cuda_driver.cc:152] failed call to "
    "cuInit: INTERNAL: CUDA error: Failed call to cuInit: CUDA_ERROR_SYSTEM_NOT_READY: system not yet initialized",
    "jaxlib.xla_extension.XlaRuntimeError: FAILED_PRECONDITION: No visible GPU devices.",
]
# benign neighbours: pytorch/xla#6771 (a clean shutdown), jax-ml/jax#12533
DISCONNECTED = ("I0000 00:00:1711301822.558010  981991 coordination_service.cc:686] "
                "/job:jax_worker/replica:0/task:3 has disconnected from coordination service.")
SHUTDOWN_PASSED = ("I0000 00:00:1711301822.557900  981991 coordination_service.cc:1195] Shutdown barrier in "
                   "coordination service has passed.")
TPU_DRIVER = "INFO:absl:Unable to initialize backend 'tpu_driver': NOT_FOUND: Unable to find driver in registry given worker: "
# what every JAX/TensorFlow GPU job prints at start: jax-ml/jax#19821,
# openxla/xla#20803, kr-colab/ReLERNN#63
STARTUP_CHATTER = [
    "2024-02-15 14:18:20.201828: W external/xla/xla/service/gpu/nvptx_compiler.cc:744] The NVIDIA driver's CUDA "
    "version is 12.2 which is older than the ptxas CUDA version (12.3.107). Because the driver is older than the "
    "ptxas version, XLA is disabling parallel compilation, which may slow down compilation. You should update "
    "your NVIDIA driver or use the NVIDIA-provided CUDA forward compatibility packages.",
    "2023-10-09 13:36:23.355516: E tensorflow/compiler/xla/stream_executor/cuda/cuda_dnn.cc:9342] Unable to "
    "register cuDNN factory: Attempting to register factory for plugin cuDNN when one has already been registered",
    "2023-10-09 13:36:23.355933: E tensorflow/compiler/xla/stream_executor/cuda/cuda_blas.cc:1518] Unable to "
    "register cuBLAS factory: Attempting to register factory for plugin cuBLAS when one has already been registered",
    "2025-02-09 09:37:34.496341: I external/local_xla/xla/stream_executor/cuda/cuda_executor.cc:901] successful "
    "NUMA node read from SysFS had negative value (-1), but there must be at least one NUMA node, so returning "
    "NUMA node zero. See more at https://github.com/torvalds/linux/blob/v6.0/Documentation",
    "2025-02-09 09:37:33.337631: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] TF-TRT Warning: Could "
    "not find TensorRT",
]


def _dets(lines):
    return SCANNER.scan_lines(lines)


def _verdict(lines):
    return attribute(_dets(lines), context_from_lines(lines))


def test_the_pack_is_shipped_and_loaded():
    assert (shipped_dir() / "xla.toml").is_file()
    ids = {r.id for r in load_pack(shipped_dir() / "xla.toml")}
    loaded = {r.id for r in load_rules() if Path(r.source).name == "xla.toml"}
    assert ids == loaded and len(ids) >= 10


@pytest.mark.parametrize("line, rules", [
    (HEARTBEAT, {"xla.coord_heartbeat_timeout"}),
    (FATE_SHARED[0], {"xla.coord_polled_error"}),
    (FATE_SHARED[1], {"xla.coord_fatal_error", "xla.coord_heartbeat_timeout"}),
    (LEADER_GONE[1], {"xla.coord_fatal_error", "xla.coord_leader_unreachable"}),
    (CONNECT_BARRIER[2], {"xla.coord_barrier_timeout"}),
    (CONNECT_TIMEOUT, {"xla.runtime_error_unavailable"}),
    (RENDEZVOUS, {"xla.rendezvous_stuck"}),
    (TF_ABORT, {"xla.tf_collective_abort"}),
    (OOM_REQUEST, {"xla.oom_allocate"}),
    (OOM_AUTOTUNE, {"xla.oom_allocate"}),
    (OOM_TF, {"xla.oom_allocate"}),
    (CUDNN_MISMATCH, {"xla.cuda_library_mismatch"}),
    (CUSOLVER_OLDER, {"xla.cuda_library_mismatch"}),
    (CUDNN_MISSING, {"xla.cuda_library_mismatch"}),
    (DNN_INIT, {"xla.dnn_init_failed"}),
    (NO_CUDA_BACKEND, {"xla.backend_init_failed"}),
    (CUINIT_NOT_READY[1], {"xla.backend_init_failed"}),
])
def test_one_line_its_rules(line, rules):
    # before: nothing fired, or python.exception_line read the runtime's
    # status as the application's own error (stop)
    assert {d.rule for d in _dets([line])} == rules


@pytest.mark.parametrize("line", [BFC_NOT_A_FAILURE, DISCONNECTED, SHUTDOWN_PASSED, TPU_DRIVER,
                                  FATE_SHARED[3], *STARTUP_CHATTER])
def test_benign_neighbours_stay_quiet(line):
    assert _dets([line]) == []


def test_heartbeat_timeout_names_the_silent_task_as_a_rank():
    (det,) = _dets([HEARTBEAT])
    assert det.role == "symptom"
    assert det.rank == 0
    verdict = _verdict([HEARTBEAT])
    assert (verdict.category, verdict.action, verdict.nodes) == ("nccl_timeout_hang", "requeue", ())


@pytest.mark.parametrize("lines", [FATE_SHARED, LEADER_GONE, CONNECT_BARRIER, [CONNECT_TIMEOUT],
                                   [RENDEZVOUS], [TF_ABORT]])
def test_coordination_and_collective_failures_are_unexplained_not_stopped(lines):
    # what any task's death leaves on the others: requeue once, blame no one
    verdict = _verdict(lines)
    assert verdict.action == "requeue"
    assert verdict.unexplained
    assert verdict.nodes == ()
    assert verdict.category in ("nccl_timeout_hang", "system_software")


def test_the_cause_before_the_fate_sharing_abort_decides():
    # the dying task's own OOM, then the coordination service's abort
    verdict = _verdict([OOM_XLA, *FATE_SHARED])
    assert (verdict.category, verdict.action) == ("oom", "stop")


@pytest.mark.parametrize("line", [OOM_REQUEST, OOM_AUTOTUNE, OOM_TF])
def test_allocation_failures_are_the_jobs_oom(line):
    verdict = _verdict([line])
    assert (verdict.category, verdict.action) == ("oom", "stop")


@pytest.mark.parametrize("lines", [[CUDNN_MISMATCH, DNN_INIT], [CUSOLVER_OLDER], [CUDNN_MISSING]])
def test_the_jobs_cuda_libraries_not_fitting_its_build_stops(lines):
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == ("application", "stop")


def test_cudnn_handle_failure_then_init_summary_is_retried():
    verdict = _verdict([*CUDNN_HANDLE, DNN_INIT])
    assert verdict.category == "cuda_error"
    assert verdict.action == "requeue"


def test_dnn_init_summary_alone_is_not_a_code_bug():
    verdict = _verdict([DNN_INIT])
    assert verdict.action == "requeue" and verdict.unexplained


def test_no_cuda_backend_follows_the_cuda_error_before_it():
    verdict = _verdict(CUINIT_NOT_READY)
    assert verdict.category == "system_software"
    assert verdict.action == "requeue_exclude"
    alone = _verdict([NO_CUDA_BACKEND])
    assert alone.action == "requeue" and alone.unexplained

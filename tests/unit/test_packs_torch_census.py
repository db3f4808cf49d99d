"""PyTorch formats the census of the distributed stack added to pytorch.toml
(issue 15, round 3b): init_process_group's store-based barrier timing out
(1.8+), the caching allocator's NVML assert that replaces a CUDA OOM message
(2.1+), gloo peers closing their connection, mp.spawn's and the pre-torchrun
launcher's exit reports, the watchdog meeting the CUDA runtime unloading at
exit, TCPStore's per-try connect/validate retry, and PyTorch's wording of
CUDA's initialization error, read alone and through attribution.

Every line is a real one, quoted in the public thread the rule's comment in
etc/patterns/pytorch.toml names; none is built from a format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# neu-vi/ezflow#194 (1.8-2.0 wording)
BARRIER = ("RuntimeError: Timed out initializing process group in store based barrier on rank: 0, "
           "for key: store_based_barrier_key:1 (world_size=2, worker_count=1, timeout=0:30:00)")
# deepspeedai/Megatron-DeepSpeed#338: the traceback's tail, as printed
BARRIER_TB = [
    "    _store_based_barrier(global_rank, default_store, timeout)",
    '  File "/usr/local/lib/python3.8/dist-packages/torch/distributed/distributed_c10d.py", line 350, in _store_based_barrier',
    "    raise RuntimeError(",
    "RuntimeError: Timed out initializing process group in store based barrier on rank: 5, for key: "
    "store_based_barrier_key:32 (world_size=8, worker_count=4, timeout=0:00:30)",
]
# ultralytics/yolov5#4574 (the INFO line while it waits)
BARRIER_WAITING = ("Waiting in store based barrier to initialize process group for rank: 0, key: "
                   "store_based_barrier_key:1 (world_size=4, worker_count=8, timeout=0:30:00)")
# pytorch/pytorch#112377, pytorch/pytorch#130486, ContextualAI/gritlm#16
NVML_R = ('RuntimeError: NVML_SUCCESS == r INTERNAL ASSERT FAILED at "/opt/conda/conda-bld/'
          'pytorch_1695392020201/work/c10/cuda/CUDACachingAllocator.cpp":1154, please report a bug to PyTorch.')
NVML_INIT = ('RuntimeError: NVML_SUCCESS == DriverAPI::get()->nvmlInit_v2_() INTERNAL ASSERT FAILED at '
             '"../c10/cuda/CUDACachingAllocator.cpp":813, please report a bug to PyTorch.')
NVML_PCI = ("RuntimeError: NVML_SUCCESS == DriverAPI::get()->nvmlDeviceGetHandleByPciBusId_v2_( pci_id, "
            '&nvml_device) INTERNAL ASSERT FAILED at "../c10/cuda/CUDACachingAllocator.cpp":1139, '
            "please report a bug to PyTorch.")
# pytorch/pytorch#123834 (collect_env output)
ENV_REPORT = "CUDA_MODULE_LOADING set to: LAZY"
# RVC-Project/Retrieval-based-Voice-Conversion-WebUI#1882
GLOO_CLOSED = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:10895"
GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
              "[192.168.70.92]:25266: Connection reset by peer")
# meta-pytorch/torchtune#2676
GLOO_TIMEOUT = ("[rank2]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
                "Timed out waiting 1800000ms for recv operation to complete")
# Plachtaa/VITS-fast-fine-tuning#284, SayaSS/vits-finetuning#32
SPAWN_EXIT = "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 1"
SPAWN_EXIT_WIN = "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 3221226505"
# lyu-yx/ACUMEN#4
SPAWN_SIGKILL = "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGKILL"
# NVIDIA/apex#919: the traceback's tail
LAUNCH_TB = [
    '  File "/home/james/anaconda3/envs/pytorch_1.1/lib/python3.7/site-packages/torch/distributed/launch.py", line 231, in main',
    "    cmd=process.args)",
    "subprocess.CalledProcessError: Command '['/home/james/anaconda3/envs/pytorch_1.1/bin/python', '-u', "
    "'distributed_data_parallel.py', '--local_rank=0']' returned non-zero exit status 1.",
]
# wenwenyu/PICK-pytorch#36
LAUNCH_EXIT = ("subprocess.CalledProcessError: Command '['/opt/conda/bin/python', '-u', 'train.py', "
               "'--local_rank=3', '-c', 'config.json', '--local_world_size', '4']' returned non-zero exit status 1.")
# NVIDIA/Fuser#2497
DRIVER_SHUTDOWN = ("[I628 20:15:42.000370615 ProcessGroupNCCL.cpp:1501] [PG  Rank 1] main process destroyed "
                   "cuda before watchdog loop exited, terminating watchdog. (Watchdog caught exception: "
                   "CUDA error: driver shutting down")
# Kai-46/ARF-svox2#9: torch._C._cuda_init() failing with cudaErrorInitializationError
CUDA_INIT_TB = [
    "    torch._C._cuda_init()",
    "RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu.",
]
# pytorch/pytorch#131117 (the warning form)
CUDA_INIT_WARN = "UserWarning: CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu."
# TheTom/vllm-swift#9
VALIDATE_RETRY = ("[W426 16:56:01.831041000 TCPStore.cpp:347] [c10d] TCP client failed to connect/validate "
                  "to host 100.64.0.1:59782 - retrying (try=6, timeout=1800000ms, delay=5241ms): "
                  "Connection reset by peer")
# sgl-project/sglang#20859
RECV_RESET = ("[rank12]:[W318 10:00:41.915284135 TCPStore.cpp:125] [c10d] recvValue failed on "
              "SocketImpl(fd=135, addr=[sglang-0-1.sglang.default.svc.transwarp.local]:48750, "
              "remote=[sglang-0.default.pod.transwarp.local]:20000): Connection reset by peer")


def _dets(lines):
    return SCANNER.scan_lines(lines)


def _verdict(lines):
    return attribute(_dets(lines), context_from_lines(lines))


@pytest.mark.parametrize("line, rule", [
    (BARRIER, "pytorch.store_barrier_timeout"),
    (NVML_R, "pytorch.oom_nvml_report"),
    (NVML_INIT, "pytorch.oom_nvml_report"),
    (NVML_PCI, "pytorch.oom_nvml_report"),
    (GLOO_CLOSED, "pytorch.gloo_peer_closed"),
    (GLOO_RESET, "pytorch.gloo_peer_closed"),
    (GLOO_TIMEOUT, "pytorch.gloo_timeout"),
    (SPAWN_EXIT, "pytorch.spawn_exitcode"),
    (SPAWN_EXIT_WIN, "pytorch.spawn_exitcode"),
    (SPAWN_SIGKILL, "signal.spawn_sigkill"),
    (LAUNCH_EXIT, "pytorch.launch_exitcode"),
    (DRIVER_SHUTDOWN, "pytorch.watchdog_driver_shutdown"),
    (VALIDATE_RETRY, "pytorch.store_validate_retry"),
    (CUDA_INIT_TB[1], "pytorch.cuda_driver_init_failed"),
    (CUDA_INIT_WARN, "pytorch.cuda_driver_init_failed"),
    (RECV_RESET, "pytorch.store_connection_lost"),
])
def test_one_line_one_rule(line, rule):
    assert [d.rule for d in _dets([line])] == [rule]


@pytest.mark.parametrize("line", [BARRIER_WAITING, ENV_REPORT])
def test_benign_neighbours_stay_quiet(line):
    assert _dets([line]) == []


@pytest.mark.parametrize("lines", [[BARRIER], BARRIER_TB])
def test_store_barrier_timeout_is_a_missing_rank_not_a_code_bug(lines):
    # before: python.runtime_error read it as the application's own error (stop)
    verdict = _verdict(lines)
    assert verdict.category == "nccl_timeout_hang"
    assert verdict.action == "requeue"
    assert verdict.nodes == ()


@pytest.mark.parametrize("line", [NVML_R, NVML_INIT, NVML_PCI])
def test_allocator_nvml_assert_is_the_oom_it_hides(line):
    verdict = _verdict([line])
    assert verdict.category == "oom"
    assert verdict.action == "stop"


def test_gloo_peer_closed_names_the_peer_and_excludes_nothing():
    (det,) = _dets([GLOO_RESET])
    assert det.role == "symptom"
    assert det.host == "192.168.70.92"
    verdict = _verdict([GLOO_RESET])
    assert verdict.category == "interconnect"
    assert verdict.action == "requeue"
    assert verdict.nodes == ()
    assert "192.168.70.92" in verdict.where


@pytest.mark.parametrize("lines", [[SPAWN_EXIT], LAUNCH_TB])
def test_launcher_exit_codes_are_unexplained_exits(lines):
    # before: python.exception_line read the launcher's report as the cause (stop)
    dets = _dets(lines)
    assert {d.role for d in dets} == {"exit"}
    assert _verdict(lines).action == "requeue"


def test_watchdog_meeting_cuda_unloading_is_teardown_not_a_cuda_fault():
    # before: cuda.error_generic (requeue, a CUDA error as the cause)
    (det,) = _dets([DRIVER_SHUTDOWN])
    assert det.severity == "info"
    assert det.action_hint == "none"
    assert _verdict([DRIVER_SHUTDOWN]).action == "none"


def test_store_validate_retry_is_a_warning_not_a_lost_store():
    (det,) = _dets([VALIDATE_RETRY])
    assert det.action_hint == "none"
    assert _verdict([VALIDATE_RETRY]).action == "none"


def test_pytorch_wording_of_cuda_initialization_error_excludes_the_node():
    # before: python.runtime_error (the application's own error, stop); the
    # NCCL/CUDA wording of the same error is cuda.initialization_error
    verdict = _verdict(CUDA_INIT_TB)
    assert verdict.category == "cuda_error"
    assert verdict.action == "requeue_exclude"

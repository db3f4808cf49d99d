"""Message formats added from the emitters' sources (issue 15, interconnect,
timeout, segfault and application families): each line through the shipped
packs, then through attribution, as ``recovery-ctl patterns test`` reads a log.

Every line is a real one, quoted in the public source that the comment above
the rule in etc/patterns/*.toml names (an issue thread, a mailing-list
archive, a public job log found with find_string); none is built from a
format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# NCCL 2.0 include/socket.h (NVIDIA/nccl#111, the host redacted as posted)
OLD_CONNECT = "*server name* [0] include/socket.h:185 WARN Call to connect failed : Connection refused"
# NCCL's socket transport thread (NVIDIA/nccl#706, the prefix garbled as posted)
PROGRESS = "[15]23:83:2526 [0] transport/net_socket.cc:219 NCCL WARN NET/Socket : socket progress error"
# verbs resources (horovod/horovod#98, deepseek-ai/DeepEP#143)
QP_FAILED = "machine [0] misc/ibvwrap.cu:269 WARN Call to ibv_create_qp failed"
CQ_ENOMEM = ("msm-h200-2:4016:4653 [7] misc/ibvwrap.cc:190 NCCL WARN Call to ibv_create_cq "
             "failed with error Cannot allocate memory")
# a QP state change that failed (dev:nccltests185): a path, not a limit
QP_UNREACHABLE = "misc/ibvwrap.cc:187 NCCL WARN Call to ibv_modify_qp failed with error Network is unreachable"
# UCX UD (openucx/ucx#5543, #7885, #2789)
UD_PEER = ("2020-08-07T14:48:23.7195928Z [swx-rdmz-ucx-legacy-02:15197:0:15197]       ud_ep.c:255  "
           "Fatal: UD endpoint 0x2a01ad0 to swx-rdmz-ucx-le:15197: unhandled timeout error")
UD_NO_DATA = ("[b5101:238310:0:238310]       ud_ep.c:270  Fatal: UD endpoint 0x7f093c002820 to "
              "<no debug data>: unhandled timeout error ")
UD_IFACE = ("Wed Aug  8 14:55:53 2018[1,31]<stderr>:[clx-hercules-046:20804:0:20804]    "
            "ud_iface.c:780  Fatal: transport error: Endpoint timeout")
# Open MPI's TCP help text and PMIx (open-mpi/ompi#7735)
HUNG_UP = ["An MPI communication peer process has unexpectedly disconnected.  This",
           "usually indicates a failure in the peer process (e.g., a crash or",
           "  Local host: ip-172-31-6-3",
           "  Local PID:  12741",
           "  Peer host:  ip-172-31-1-32",
           "[ip-172-31-1-68:27726] PMIX ERROR: UNREACHABLE in file server/pmix_server.c at line 2257"]
# Open MPI users' list archive
READV = ("[machine4][[3968,1],0][btl_tcp_frag.c:216:mca_btl_tcp_frag_recv] mca_btl_tcp_frag_recv: "
         "readv failed: Connection reset by peer (104)")
# argparse (lmy98129/VLPD#6: the script's usage, its error, torchrun's exit report)
ARGPARSE = ["usage: trainval_distributed.py [-h] [--work-dir WORK_DIR] [--local_rank LOCAL_RANK]",
            "trainval_distributed.py: error: unrecognized arguments: --local-rank=1",
            "[2023-12-08 01:40:46,962] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
            "(exitcode: 2) local_rank: 0 (pid: 53342) of binary: /home/ashitha/miniconda3/envs/"
            "Ashenv/bin/python"]
# python -m on a module that is not installed (a public README, find_string id 66425737483)
NO_MODULE = "/usr/bin/python: No module named my_mcp_server"
# an exception class named by its module (a public traceback, find_string id 1321043373)
DYNAMO = "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:"
# bus errors: NCCL's proxy thread under UCX's handler (triton-inference-server/
# hugectr_backend#42) and the DataLoader's (the BLOOM chronicles)
NCCL_SIGBUS = "[qgpuvb813-cvision:1    :0:381] Caught signal 7 (Bus error: nonexistent physical address)"
LOADER_SIGBUS = ("ERROR: Unexpected bus error encountered in worker. This might be caused by "
                 "insufficient shared memory (shm).")
# transformers' end-of-run metrics (find_string id 11955508656) and a watchdog
# timeout (dev:basicsr737-watchdog-default-pg)
METRICS = "***** train metrics *****"
HF_DONE = "Training completed. Do not forget to share your model on huggingface.co/models =)"
WATCHDOG = ("[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, "
            "NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.")


def judge(lines):
    detections = SCANNER.scan_lines(lines)
    return detections, attribute(detections, context_from_lines(lines))


def fired(detections):
    return {d.rule for d in detections if d.severity != "info"}


@pytest.mark.parametrize("line, rule", [
    (OLD_CONNECT, "nccl.socket_connect_failed"),
    (PROGRESS, "nccl.socket_progress_error"),
    (QP_FAILED, "nccl.ib_resource_limit"),
    (CQ_ENOMEM, "nccl.ib_resource_limit"),
    (QP_UNREACHABLE, "nccl.ibv_call_failed"),
    (UD_PEER, "ib.ucx_ud_timeout"),
    (UD_NO_DATA, "ib.ucx_ud_timeout"),
    (UD_IFACE, "ib.ucx_ud_timeout"),
    (READV, "mpi.tcp_io_failed"),
    (NO_MODULE, "python.import_error"),
    (DYNAMO, "python.exception_line"),
    (NCCL_SIGBUS, "signal.bus_error_unbacked_mapping"),
])
def test_each_format_reaches_its_rule(line, rule):
    assert fired(SCANNER.scan_lines([line])) == {rule}


def test_socket_symptoms_alone_are_an_unexplained_requeue():
    for line in (OLD_CONNECT, PROGRESS, READV, UD_IFACE):
        _, verdict = judge([line])
        assert (verdict.category, verdict.action, verdict.unexplained) == \
            ("interconnect", "requeue", True), line


def test_a_verbs_resource_limit_stops_and_outranks_the_generic_verbs_rule():
    for line in (QP_FAILED, CQ_ENOMEM):
        detections, verdict = judge([line])
        assert "nccl.ibv_call_failed" not in fired(detections)
        assert (verdict.category, verdict.action, verdict.nodes) == ("interconnect", "stop", ())
    # a failed QP state change is a path problem, still a requeue
    assert judge([QP_UNREACHABLE])[1].action == "requeue"


def test_a_ud_timeout_names_the_peer_not_the_printer():
    detections, verdict = judge([UD_PEER])
    assert [d.host for d in detections] == ["swx-rdmz-ucx-le"]
    assert verdict.suspects == ("swx-rdmz-ucx-le",) and verdict.nodes == ()
    # UCX's release builds carry no peer name: nothing is named
    assert judge([UD_NO_DATA])[1].suspects == ()


def test_open_mpi_peer_loss_names_the_peer_host_as_a_suspect():
    detections, verdict = judge(HUNG_UP)
    assert {"mpi.tcp_peer_hung_up", "mpi.peer_host", "mpi.pmix_unreachable"} <= fired(detections)
    assert (verdict.category, verdict.action, verdict.unexplained) == \
        ("interconnect", "requeue", True)
    assert verdict.suspects == ("ip-172-31-1-32",) and verdict.nodes == ()
    # the local host's line is not the peer
    assert not any(d.host == "ip-172-31-6-3" for d in detections)


def test_an_argument_error_stops_although_the_launcher_only_reports_an_exit_code():
    detections, verdict = judge(ARGPARSE)
    assert {"python.argparse_error", "pytorch.elastic_exitcode"} <= fired(detections)
    assert (verdict.category, verdict.action, verdict.blame) == ("application", "stop",
                                                                 "application")
    assert "python.argparse_error" in verdict.reason
    # the usage banner alone is no failure
    assert fired(SCANNER.scan_lines(ARGPARSE[:1])) == set()


@pytest.mark.parametrize("line", [NO_MODULE, DYNAMO])
def test_missing_modules_and_module_named_exceptions_are_the_application(line):
    _, verdict = judge([line])
    assert (verdict.category, verdict.action) == ("application", "stop")


def test_shared_memory_bus_errors_are_the_system_and_retried():
    for line, rule in ((NCCL_SIGBUS, "signal.bus_error_unbacked_mapping"),
                       (LOADER_SIGBUS, "signal.dataloader_bus_error")):
        detections, verdict = judge([line])
        assert rule in fired(detections)
        assert (verdict.category, verdict.action) == ("system_software", "requeue")


@pytest.mark.parametrize("marker", [METRICS, HF_DONE])
def test_a_timeout_after_the_end_of_training_redoes_nothing(marker):
    _, after = judge([marker, WATCHDOG])
    assert (after.action, after.signature) == ("none", "done")
    assert "the work had finished before it" in after.reason
    # the same timeout with the marker after it (or without one) is requeued
    _, before = judge([WATCHDOG, marker])
    assert (before.action, before.unexplained) == ("requeue", True)


# PyTorch's torch/csrc/cuda/nccl.cpp wording, wrapped by the terminal as posted
# (PrimeIntellect-ai/prime-rl#1098)
NCCL_ERROR_N = "RuntimeError: NCCL Error 3: internal error - please report this"
# gloo (pytorch/pytorch#108732, DeepAuto-AI/hip-attention#59)
GLOO_CONNECT = ("RuntimeError: [/opt/conda/conda-bld/pytorch_1682343967769/work/third_party/gloo/"
                "gloo/transport/tcp/pair.cc:799] connect [172.31.71.170]:13195: Connection refused")
GLOO_MESH = ("[rank4]:[E421 02:05:38.764490322 ProcessGroupGloo.cpp:143] Gloo connectFullMesh "
             "failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error")
# Horovod's shut-down status inside TensorFlow's error (horovod/horovod#534)
HOROVOD = ("AbortedError (see above for traceback): Horovod has been shut down. This was caused by "
           "an exception on one of the ranks or an attempt to allreduce, allgather or broadcast a "
           "tensor after one of the ranks finished execution. If the shutdown was caused by an "
           "exception, you should see the exception in the log before the first shutdown message.")
# DeepSpeed's pdsh prefix (deepspeedai/DeepSpeed#2899)
PDSH_OOM = ("gpu-q-13: torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 "
            "MiB (GPU 2; 79.17 GiB total capacity; 76.68 GiB already allocated;")


def test_pytorchs_nccl_error_n_wording_is_the_nccl_code_not_a_runtime_error():
    detections, verdict = judge([NCCL_ERROR_N])
    assert fired(detections) == {"nccl.internal_error"}
    assert (verdict.category, verdict.action, verdict.unexplained) == \
        ("interconnect", "requeue", True)


def test_gloo_connect_failures_are_symptoms_naming_the_peer():
    detections, verdict = judge([GLOO_CONNECT])
    assert fired(detections) == {"pytorch.gloo_peer_closed"}
    assert verdict.suspects == ("172.31.71.170",) and verdict.action == "requeue"
    _, mesh = judge([GLOO_MESH])
    assert (mesh.category, mesh.action, mesh.unexplained) == ("interconnect", "requeue", True)


def test_horovods_shutdown_is_an_exit_report_and_the_first_exception_decides():
    detections, verdict = judge([HOROVOD])
    assert fired(detections) == {"horovod.shut_down"}
    assert (verdict.action, verdict.unexplained, verdict.category) == ("requeue", True, None)
    # with the rank's own error before it, that error decides
    _, verdict = judge([ARGPARSE[1], HOROVOD])
    assert (verdict.category, verdict.action) == ("application", "stop")


def test_an_exception_behind_a_pdsh_host_prefix_is_still_read():
    generic = next(r for r in SCANNER.rules if r.id == "python.exception_line")
    assert generic.compiled.search(PDSH_OOM)           # the class-name fallback sees it too
    detections, verdict = judge([PDSH_OOM])
    assert (verdict.category, verdict.action) == ("oom", "stop")   # the OOM rule outranks it
    assert [d.host for d in detections] == ["gpu-q-13"]
    # a launcher's "host: " before anything that is not an exception class stays quiet
    assert not generic.compiled.search("10.3.35.83: WARN: Function: main Line: 66: NET/OFI OFI "
                                       "NCCL failure: 2")


# torch.multiprocessing.spawn's wrapper traceback as a public job log prints it
# (find_string id 41337680347), followed here by a child's NCCL error line from
# dev:nccl934-remote-error-occasional: each line real, the pairing ours
SPAWN = ['  File "/workspace/pilot/.venv/lib/python3.12/site-packages/torch/multiprocessing/'
         'spawn.py", line 220, in join',
         "    raise ProcessRaisedException(msg, error_index, failed_process.pid)",
         "torch.multiprocessing.spawn.ProcessRaisedException: ",
         "",
         "-- Process 0 terminated with the following error:",
         "Traceback (most recent call last):",
         '  File "/workspace/pilot/.venv/lib/python3.12/site-packages/torch/multiprocessing/'
         'spawn.py", line 95, in _wrap',
         "    fn(i, *args)",
         "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
         "ProcessGroupNCCL.cpp:1347, remote process exited or there was a network error, NCCL "
         "version 2.18.5"]
# accelerate's launcher re-raising its Python worker's exit (kohya-ss/sd-scripts#1354)
ACCELERATE = ("subprocess.CalledProcessError: Command '['/Users/kleinsun/open/kohya_ss/venv/bin/"
              "python', '/Users/kleinsun/Documents/open/kohya_ss/sd-scripts/sdxl_train.py', "
              "'--config_file', '/Users/kleinsun/Documents/open/kohya_ss/outputs/"
              "config_dreambooth-20240531-163416.toml']' returned non-zero exit status 1.")
# DeepSpeed's launcher (find_string id 42874239156)
DS_EXIT = ("# [2024-10-01 01:17:14,772] [ERROR] [launch.py:325:sigkill_handler] ['/tools/miniconda3/"
           "envs/finetune/bin/python', '-u', 'experiment-base-finetune_llama_3-2_1B.py', "
           "'--local_rank=1'] exits with return code = 1")


def test_spawns_wrapper_is_an_exit_report_and_the_childs_error_decides():
    detections, verdict = judge(SPAWN)
    assert [d.rule for d in detections] == ["pytorch.spawn_raised", "nccl.remote_error"]
    assert (verdict.category, verdict.action, verdict.unexplained) == \
        ("interconnect", "requeue", True)


@pytest.mark.parametrize("line, rule", [(ACCELERATE, "pytorch.launch_exitcode"),
                                        (DS_EXIT, "deepspeed.launcher_exit")])
def test_launchers_reporting_a_python_worker_exit_are_unexplained(line, rule):
    detections, verdict = judge([line])
    assert fired(detections) == {rule}
    assert (verdict.action, verdict.unexplained, verdict.category) == ("requeue", True, None)
    # the worker's own error before the launcher's report decides
    _, verdict = judge([ARGPARSE[1], line])
    assert (verdict.category, verdict.action) == ("application", "stop")

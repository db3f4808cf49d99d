"""Failures read by the phenomenon the emitter prints, not by the one log a
rule was first written for (issue 15, items 1 and 2): XIDs whose catalog
cause is the program, CUDA errors that may be the GPU, torch elastic's
teardown on a signal, the c10d store's connect and bind errors, kernel and
cgroup memory kills, and a verdict made of symptoms alone.

Every log line here is a real one, quoted in the public source named above
it (the rule's comment in etc/patterns/ names it too); none is built from a
format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext, context_from_lines
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.detect.patterns import APPLICATION_XIDS, load_rules, xid_category
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")


def verdict(lines: list[str]):
    return attribute(SCANNER.scan_lines(lines, source="t"), context_from_lines(lines))


def fired(lines: list[str]) -> set[str]:
    return {d.rule for d in SCANNER.scan_lines(lines, source="t") if d.severity != "info"}


# -- XIDs whose catalog cause is the program -----------------------------------------

# openwall/john#2491 (an OpenCL kernel's out-of-range access)
XID13 = ("[139600.598066] NVRM: Xid (PCI:0000:05:00): 13, Graphics SM Warp Exception on "
         "(GPC 0, TPC 0): Out Of Range Address")
# kubernetes-sigs/dra-driver-nvidia-gpu#904 (a test program writing through a null pointer)
XID43 = "[1231741.378609] NVRM: Xid (PCI:0009:01:00): 43, pid=3188489, name=trigger_xid, channel 0x0b00000a"
# flashinfer-ai/flashinfer#3869 (an out-of-bounds write in an allreduce kernel)
XID31 = ("19:15:34  NVRM: Xid (PCI:0000:9a:00): 31, pid=477445, name=python3, channel 0x00000002, "
         "intr 00000000.")
# wilicc/gpu-burn#1: the GPU fell off the bus
XID79 = "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus."


@pytest.mark.parametrize("line", [XID13, XID43, XID31])
def test_an_xid_the_catalog_puts_on_the_program_is_the_application(line):
    detection = SCANNER.scan_lines([line], source="t")[0]
    assert (detection.rule, detection.category, detection.action_hint) == (
        "kernel.xid", "application", "stop")
    v = verdict([line])
    assert (v.category, v.action, v.blame) == ("application", "stop", "application")


def test_a_gpu_fault_xid_stays_the_gpu():
    v = verdict([XID79])
    assert (v.category, v.action, v.blame) == ("gpu_hardware", "requeue_exclude", "node")


def test_xid_category_follows_the_catalog_and_the_reading():
    assert {13, 31, 43} <= APPLICATION_XIDS
    assert xid_category(13, "stop") == "application"
    assert xid_category(79, "requeue_exclude") == "gpu_hardware"
    # an SXid is the NVSwitch's, and a code read another way keeps the default
    assert xid_category(13, "stop", "sxid") == "gpu_hardware"
    assert xid_category(13, "requeue", default="gpu_hardware") == "gpu_hardware"


def test_a_node_report_of_an_application_xid_blames_the_code_not_the_node():
    event = Detection(rule="xid", category="gpu_hardware", severity="error", action_hint="none",
                      evidence=(Evidence(XID13, "hook:g1/epilog"),), host="g1", xid=13,
                      pci="0000:05:00", origin="system", detail=XID13)
    v = attribute([], AttributionContext(nodes=("g1",), node_events=(event,)))
    assert (v.category, v.action, v.blame, v.nodes) == ("application", "stop", "application", ())


# -- CUDA errors that may be the GPU: retried, excluded with node evidence --------------

# torch/cutorch#197 (Lua torch's THC, 300,000 steps in), nv-tlabs/3dgrut#191 (21 minutes in)
UNKNOWN_MID_RUN = [
    "luajit: cuda runtime error (30) : unknown error at /tmp/luarocks_cutorch-scm-1-9927/cutorch/lib/THC/THCStorage.c:113",
    "  what():  CUDA error: unknown error",
]
# facebookresearch/maskrcnn-benchmark#238 (THC's init), NVIDIA/gpu-operator#1146 (the validator)
UNKNOWN_AT_INIT = [
    "THCudaCheck FAIL file=/opt/conda/conda-bld/pytorch-nightly_1542964575207/work/aten/src/THC/THCGeneral.cpp line=51 error=30 : unknown error",
    "Failed to allocate device vector A (error code unknown error)!",
]
# a llama.cpp build note and a CUDA.jl note (find_string ids 55104342092, 56051759896)
INVALID_IMAGE = ["CUDA error: device kernel image is invalid",
                 "CUDA error: device kernel image is invalid (code 200, ERROR_INVALID_IMAGE)"]


@pytest.mark.parametrize("line", UNKNOWN_MID_RUN)
def test_an_unknown_cuda_error_in_a_running_program_is_retried(line):
    v = verdict([line])
    assert (v.category, v.action, v.blame, v.nodes) == ("cuda_error", "requeue", "unknown", ())
    assert v.signature == "cuda:unknown"     # the repeat rule tells the node from the code


def test_an_unknown_cuda_error_with_a_gpu_xid_on_the_node_excludes_it():
    event = Detection(rule="xid", category="gpu_hardware", severity="critical",
                      action_hint="none", evidence=(Evidence(XID79, "hook:g1/epilog"),),
                      host="g1", xid=79, pci="0000:02:00", origin="system", detail=XID79)
    lines = [UNKNOWN_MID_RUN[1]]
    v = attribute(SCANNER.scan_lines(lines, source="t"),
                  AttributionContext(nodes=("g1", "g2"), node_events=(event,)))
    assert (v.blame, v.action, v.nodes) == ("node", "requeue_exclude", ("g1",))


@pytest.mark.parametrize("line", UNKNOWN_AT_INIT)
def test_an_unknown_cuda_error_where_cuda_starts_is_the_node(line):
    assert fired([line]) == {"cuda.unknown_error_at_init"}
    assert verdict([line]).action == "requeue_exclude"


@pytest.mark.parametrize("line", INVALID_IMAGE)
def test_a_kernel_image_the_driver_cannot_load_is_the_node_driver(line):
    assert fired([line]) == {"cuda.driver_too_old"}
    v = verdict([line])
    assert (v.category, v.action) == ("system_software", "requeue_exclude")


# -- torch elastic's teardown and c10d's store port ------------------------------------

# pytorch/pytorch#150916 (the agent SIGTERMed from outside), GanjinZero/RRHF#35
AGENT_SIGNALLED = [
    "W0409 07:28:49.530000 1359 torch/distributed/elastic/agent/server/api.py:719] Received 15 death signal, shutting down workers",
    "W0409 07:28:49.531000 1359 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 1365 closing signal SIGTERM",
]
SIGNAL_EXCEPTION = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 2920830 got signal: 1"
# huggingface/accelerate#2246 (a launcher per task, one port per node)
PORT_TAKEN = [
    "[W socket.cpp:436] [c10d] The server socket has failed to bind to [::]:12211 (errno: 98 - Address already in use).",
    "[W socket.cpp:436] [c10d] The server socket has failed to bind to 0.0.0.0:12211 (errno: 98 - Address already in use).",
    "[E socket.cpp:472] [c10d] The server socket has failed to listen on any local network address.",
]


@pytest.mark.parametrize("lines", [AGENT_SIGNALLED, [SIGNAL_EXCEPTION]])
def test_an_agent_signalled_from_outside_alone_is_an_unexplained_requeue(lines):
    v = verdict(lines)
    assert (v.category, v.action, v.blame, v.unexplained) == (
        "system_software", "requeue", "unknown", True)


def test_a_cause_outranks_the_agent_signal_whatever_the_order():
    # the signal is what a failure elsewhere leaves behind: the port clash decides
    v = verdict(AGENT_SIGNALLED + PORT_TAKEN)
    assert (v.category, v.action) == ("application", "stop")
    assert "pytorch.address_in_use" in v.reason


def test_the_agent_stopping_its_workers_alone_fires_nothing():
    assert fired([AGENT_SIGNALLED[1]]) == set()


def test_the_store_port_taken_on_the_node_is_the_launch_configuration():
    v = verdict(PORT_TAKEN)
    assert (v.category, v.action, v.blame) == ("application", "stop", "application")


# -- memory kills without a CUDA OOM ---------------------------------------------------

# an AWS ParallelCluster run log, an HPL note, a NEURON script's output (mpiexec)
# (find_string ids 46107263071, 28227498076, 19816677129)
MPI_KILLED = [
    "mpirun noticed that process rank 12 with PID 6866 on node queue1-dy-compute-resource-1-1 exited on signal 9 (Killed).",
    "mpirun noticed that process rank 5 with PID 0 on node sta-fpga-d exited on signal 9 (Killed).",
    "mpiexec noticed that process rank 0 with PID 0 on node kseniia-pc exited on signal 9 (Killed).",
]
# chrisknewman/tusas#149 (Slurm 23.02+'s wording)
SLURM_OOM = ("slurmstepd: error: Detected 1 oom_kill event in StepId=440575.0. Some of the step "
             "tasks have been OOM Killed.")
# deepseek-ai/DeepSeek-Coder#55 as a fine-tuning FAQ quotes it (find_string id 12064442746)
DS_SIGKILL = next(r for r in load_rules() if r.id == "deepspeed.launcher_sigkill").examples_match[0]
# deepspeedai/DeepSpeed#6896: a rank that aborted is no memory kill
MPI_ABORTED = "prterun noticed that process rank 7 with PID 0 on node gpu0304 exited on signal 6 (Aborted)."


@pytest.mark.parametrize("line", MPI_KILLED)
def test_a_rank_the_mpi_launcher_saw_killed_is_in_the_oom_family(line):
    assert fired([line]) == {"signal.mpi_rank_killed"}
    v = verdict([line])
    # an exit report alone: the OOM family, retried within the unexplained budget
    assert (v.category, v.action, v.unexplained) == ("oom", "requeue", True)


def test_the_cgroup_oom_line_with_the_rank_killed_is_the_cause():
    v = verdict([MPI_KILLED[0], SLURM_OOM])
    assert (v.category, v.action) == ("oom", "stop")
    assert v.reason.startswith("slurm.oom_kill")


def test_deepspeed_reporting_a_sigkilled_worker_reads_as_torchrun_s_exitcode_minus_9():
    assert fired([DS_SIGKILL]) == {"deepspeed.launcher_sigkill"}
    assert (verdict([DS_SIGKILL]).category, verdict([DS_SIGKILL]).action) == ("oom", "stop")


def test_a_rank_killed_by_another_signal_is_no_memory_kill():
    assert fired([MPI_ABORTED]) == {"signal.mpi_rank_signal"}


# horovod/horovod#2656 (Open MPI's summary, its last line cut by the poster)
MPI_SUMMARY = [
    "Primary job  terminated normally, but 1 process returned",
    "a non-zero exit code. Per user-direction, the job has been aborted.",
    "--------------------------------------------------------------------------",
    "mpirun detected that one or more processes exited with non",
]


def test_the_mpi_launcher_summary_alone_is_an_unexplained_failure_not_benign():
    v = verdict(MPI_SUMMARY)
    assert (v.category, v.action, v.unexplained) == (None, "requeue", True)


def test_the_mpi_launcher_summary_after_a_memory_kill_keeps_the_oom():
    v = verdict([MPI_KILLED[0], SLURM_OOM] + MPI_SUMMARY)
    assert (v.category, v.action) == ("oom", "stop")


# -- symptom vs cause ------------------------------------------------------------------

def _symptom_examples():
    for rule in load_rules():
        if rule.role in ("symptom", "exit") and rule.severity != "info" and rule.scope == "line":
            for line in rule.examples_match:
                yield pytest.param(rule.id, line, id=f"{rule.id}:{line[:40]}")


@pytest.mark.parametrize("rule_id, line", list(_symptom_examples()))
def test_a_shipped_symptom_or_exit_line_alone_never_stops_or_blames_the_code(rule_id, line):
    found = SCANNER.scan_lines([line], source="t")
    if any(d.role in ("root", "cause") and d.severity != "info" for d in found):
        return      # a more specific cause claims the line (it outranks the symptom)
    v = attribute(found, context_from_lines([line]))
    assert v.action != "stop" and v.blame != "application", (rule_id, v)
    assert v.category != "application", (rule_id, v)
    assert v.unexplained or v.action == "none", (rule_id, v)


def test_a_site_symptom_rule_asking_to_stop_is_still_an_unexplained_requeue():
    # a symptom's own action hint never turns a verdict of symptoms into a stop
    line = AGENT_SIGNALLED[0]
    symptom = Detection(rule="site.symptom", category="application", severity="error",
                        action_hint="stop", role="symptom", evidence=(Evidence(line, "t", 1),))
    v = attribute([symptom])
    assert (v.blame, v.action, v.category, v.unexplained) == ("unknown", "requeue", None, True)


def test_a_cause_after_the_symptoms_still_decides():
    # the symptom comes first in the log; the cause is later and still wins
    v = verdict([AGENT_SIGNALLED[0]] + [XID13])
    assert (v.category, v.action) == ("application", "stop")


# a training journal quoted in a public repository (find_string id 24564955514)
CUDNN_NO_ALGO = "RuntimeError: Unable to find a valid cuDNN algorithm to run convolution"


def test_cudnn_finding_no_algorithm_with_workspace_is_the_oom_family():
    assert fired([CUDNN_NO_ALGO]) == {"oom.cudnn_no_algorithm"}
    assert (verdict([CUDNN_NO_ALGO]).category, verdict([CUDNN_NO_ALGO]).action) == ("oom", "stop")


# -- a traceback the log ends inside ---------------------------------------------------

# flatironinstitute/cryoSBI#66 (98 epochs in; the excerpt ends inside the traceback)
CUT_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/home/paq/programs/micromamba/envs/cryoSBI/bin/train_npe_model", line 8, in <module>',
    "    sys.exit(cl_npe_train_no_saving())",
]
# facebookresearch/maskrcnn-benchmark#238: the same header, then its exception line
FINISHED_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "<stdin>", line 1, in <module>',
    '  File "/home/belhal/anaconda3/envs/maskrcnn/lib/python3.7/site-packages/torch/cuda/__init__.py", line 162, in _lazy_init',
    "    torch._C._cuda_init()",
    "RuntimeError: cuda runtime error (30) : unknown error at /opt/conda/conda-bld/pytorch-nightly_1542964575207/work/aten/src/THC/THCGeneral.cpp:51",
]


def test_a_log_that_ends_inside_a_traceback_is_an_unexplained_failure():
    found = SCANNER.scan_lines(CUT_TRACEBACK, source="t")
    assert [(d.rule, d.line) for d in found] == [("python.traceback_unfinished", 1)]
    v = verdict(CUT_TRACEBACK)
    assert (v.category, v.action, v.unexplained) == (None, "requeue", True)


def test_a_finished_traceback_is_read_by_its_exception_line_only():
    assert fired(FINISHED_TRACEBACK) == {"cuda.unknown_error_at_init"}


def test_a_cause_before_a_cut_traceback_decides():
    v = verdict(PORT_TAKEN + CUT_TRACEBACK)
    assert (v.category, v.action) == ("application", "stop")


# an echo client's traceback in a public repository (find_string id 43285035631)
REFUSED_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "echo_client.py", line 7, in <module>',
    "    s.connect((HOST, PORT))",
    "ConnectionRefusedError: [Errno 111] Connection refused",
]


def test_a_connection_the_peer_refused_is_a_symptom_not_the_program_s_bug():
    assert fired(REFUSED_TRACEBACK) == {"python.connection_error"}
    v = verdict(REFUSED_TRACEBACK)
    assert (v.category, v.action, v.blame, v.unexplained) == (
        "system_software", "requeue", "unknown", True)

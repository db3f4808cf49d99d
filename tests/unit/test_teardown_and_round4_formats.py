"""Round-4 families (issue 15): task exits that are a requeue's or a cleanup's
teardown (evidence._teardown_exits), pyxis's task-setup summary versus its
reasons, pyxis's seccomp failure on a node, and a segfault whose crashing
thread faulthandler shows inside a torch.distributed collective.

Every log line is a real one, quoted in the public thread named above it (the
threads the rules in etc/patterns/*.toml cite); none is built from a format.
"""
from __future__ import annotations

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines, parse_layout
from recovery_agent.detect.evidence import _teardown_exits, all_detections
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# facebookincubator/submitit#1708 (host redacted by the reporter)
REQUEUE = [
    "slurmstepd: error: *** JOB 608 ON SERVER_NAME CANCELLED AT 2022-08-12T02:06:12 DUE TO JOB REQUEUE ***",
    "slurmstepd: error: *** STEP 608.0 ON SERVER_NAME CANCELLED AT 2022-08-12T02:06:12 DUE TO JOB REQUEUE ***",
    "slurmstepd: error: Failed to send MESSAGE_TASK_EXIT: Connection refused",
    "srun: error: SERVER_NAME: tasks 2-3: Exited with exit code 1",
]
# ComputationalRadiationPhysics/picongpu#198 (killall in a German locale)
KILLALL = ["picongpu: Kein Prozess abgebrochen",
           "srun: error: taurusi2031: tasks 10-11: Exited with exit code 1"]
TASK_EXIT = "srun: error: taurusi2031: tasks 10-11: Exited with exit code 1"
# NVIDIA/pyxis#135 (slurmstepd-<node> argv0), #42 (seccomp on a stateless node)
PYXIS_ALONE = [
    "slurmstepd-sp-0016: error: pyxis: couldn't start container",
    "slurmstepd-sp-0016: error: spank: required plugin spank_pyxis.so: task_init() failed with rc=-1",
    "slurmstepd-sp-0016: error: Failed to invoke spank plugin stack",
    "srun: error: sp-0016: task 0: Exited with exit code 1",
]
SECCOMP = [
    "srun: Node cn03, 1 tasks started",
    "slurmstepd: error: pyxis: seccomp filter failed: Function not implemented",
    "slurmstepd: error: spank: required plugin spank_pyxis.so: task_init() failed with rc=-1",
    "slurmstepd: error: Failed to invoke spank plugin stack",
    "srun: error: cn03: task 0: Exited with exit code 1",
]
# NVIDIA/pyxis#61: the reason is printed before the summary
PYXIS_WITH_REASON = [
    "slurmstepd: error: pyxis: container start failed with error code: 1",
    "slurmstepd: error: pyxis: couldn't start container",
    "slurmstepd: error: spank: required plugin spank_pyxis.so: task_init() failed with rc=-1",
]
# sgl-project/sglang#3745 (faulthandler dump; the reporter's path redacted)
SEGV_IN_COLLECTIVE = [
    "Fatal Python error: Segmentation fault",
    "",
    "Thread 0x00007f2e93fff640 (most recent call first):",
    '  File "/XXXX/sglang/python/sglang/srt/managers/scheduler.py", line 462 in watchdog_thread',
    '  File "/usr/lib/python3.10/threading.py", line 953 in run',
    "",
    "Current thread 0x00007f2ea0870640 (most recent call first):",
    '  File "/usr/local/lib/python3.10/dist-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
    '  File "/usr/local/lib/python3.10/dist-packages/torch/distributed/c10d_logger.py", line 83 in wrapper',
]
# pytorch/pytorch#72086: the crash in the elastic store (PyTorch's binding)
SEGV_IN_STORE = [
    "Fatal Python error: Segmentation fault",
    "",
    "Current thread 0x00007f4ebf9d3740 (most recent call first):",
    '  File "/home/gaoxiang/.local/lib/python3.10/site-packages/torch/distributed/elastic/utils/store.py", line 31 in get_all',
]


def judge(lines):
    detections = SCANNER.scan_lines(lines, source="log")
    context = context_from_lines(lines)
    return all_detections(detections, context), attribute(detections, context)


def fired(detections):
    return {d.rule for d in detections if d.severity != "info"}


def test_task_exits_after_a_requeue_notice_are_its_teardown():
    weighed, verdict = judge(REQUEUE)
    assert "slurm.requeued" in {d.rule for d in weighed}
    assert "slurm.task_exit" not in fired(weighed)
    assert verdict.action == "none"


def test_the_exit_right_after_a_killall_that_found_nothing_is_the_cleanups():
    weighed, verdict = judge(KILLALL)
    assert fired(weighed) == set()
    assert verdict.action == "none"


def test_the_same_task_exit_alone_still_fires_and_is_requeued():
    weighed, verdict = judge([TASK_EXIT])
    assert fired(weighed) == {"slurm.task_exit"}
    assert verdict.action == "requeue" and verdict.unexplained


def _det(rule, line, role="exit", severity="warning", source="log"):
    return Detection(rule=rule, category="application", severity=severity, role=role,
                     action_hint="none" if severity == "info" else "requeue",
                     evidence=(Evidence("x", source, line),))


def test_teardown_reaches_only_exits_near_a_killall_and_never_causes():
    killall = _det("signal.killall_found_nothing", 1, severity="info")
    far = _det("slurm.task_exit", 9)
    assert _teardown_exits([killall, far])[1].severity == "warning"
    cause = _det("python.exception_line", 2, role="cause")
    kept = _teardown_exits([_det("slurm.requeued", 1, severity="info"), cause])
    assert kept[1].severity == "warning"
    # a failure line between the killall and the exit: the exit is not the cleanup's
    between = _teardown_exits([killall, _det("cuda.oom", 2, role="cause"),
                               _det("slurm.task_exit", 3)])
    assert between[2].severity == "warning"


def test_a_requeue_in_another_log_does_not_reach_this_one():
    requeued = _det("slurm.requeued", 1, severity="info", source="other")
    out = _teardown_exits([requeued, _det("slurm.task_exit", 5)])
    assert out[1].severity == "warning"


def test_pyxis_summary_alone_is_an_unexplained_requeue():
    _, verdict = judge(PYXIS_ALONE)
    assert verdict.category == "system_software"
    assert verdict.action == "requeue" and verdict.unexplained


def test_pyxis_with_its_reason_still_stops():
    _, verdict = judge(PYXIS_WITH_REASON)
    assert verdict.action == "stop"


def test_pyxis_seccomp_failure_excludes_the_node_srun_started_it_on():
    assert parse_layout(SECCOMP).nodes == ("cn03",)
    _, verdict = judge(SECCOMP)
    assert verdict.action == "requeue_exclude"
    assert verdict.nodes == ("cn03",)


def test_a_segfault_inside_a_collective_is_the_communication_library():
    _, verdict = judge(SEGV_IN_COLLECTIVE)
    assert verdict.category == "segfault"
    assert verdict.action == "requeue" and verdict.blame != "application"
    assert "all_reduce" in verdict.reason


def test_a_segfault_elsewhere_in_torch_distributed_still_stops():
    _, verdict = judge(SEGV_IN_STORE)
    assert verdict.action == "stop"


def test_a_collective_frame_under_another_threads_header_does_not_count():
    lines = [SEGV_IN_COLLECTIVE[0], "",
             "Thread 0x00007f2e93fff640 (most recent call first):",
             SEGV_IN_COLLECTIVE[7]]
    _, verdict = judge(lines)
    assert verdict.action == "stop"

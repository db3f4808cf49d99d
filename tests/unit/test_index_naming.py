"""Nodes named by a number, and CUDA errors read for who caused them: srun's
step node index and task id, an XLA coordination-service task id, a CUDA
initialization error in a forked worker, NVLink and contained GPU errors.

Every log line here is a real one, copied from the public source named in the
comment before it; contexts built from data (not lines) stand for what Slurm
or the rest of the log told the agent.
"""
from __future__ import annotations

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import (AttributionContext, _agreed, _node_index,
                                           context_from_lines, parse_layout, with_host)
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# ai-dynamo/dynamo's multi-node TRT-LLM example output (find_string id 14119021257):
# two steps of one job, srun -v
LAUNCH = [
    "srun: launching StepId=453374.17 on host node1, 1 tasks: 0",
    "srun: launching StepId=453374.18 on host node1, 4 tasks: [0-3]",
    "srun: launching StepId=453374.18 on host node2, 4 tasks: [4-7]",
    "srun: launching StepId=453374.18 on host node3, 4 tasks: [8-11]",
    "srun: launching StepId=453374.18 on host node4, 4 tasks: [12-15]",
]
# The Open MPI users list, 2014-04 (find_string id 44265414900; the mail wrapped it)
IO_LOST = "srun: error: step_launch_notify_io_failure: aborting, io error with slurmstepd on node 0"
# arvados commit 12027's message (find_string id 52485198605)
NO_CONTACT = "srun: error: Cannot communicate with node 0.  Aborting job."
# an existing slurm.toml example: srun names the task a node could not launch
LAUNCH_FAILED = "srun: error: task 256 launch failed: Error configuring interconnect"
# jax-ml/jax#23599: the coordination service (task 0's) on task 0 ... and
# jax-ml/jax docs/fault_tolerance.rst: a survivor losing the service (the leader)
HEARTBEAT = ("2024-10-09 15:47:38.568412: E external/xla/xla/tsl/distributed_runtime/coordination/"
             "coordination_service.cc:1170] /job:jax_worker/replica:0/task:0 has been set to ERROR "
             "in coordination service: UNAVAILABLE: Task /job:jax_worker/replica:0/task:0 heartbeat "
             "timeout. This indicates that the remote task has failed, got preempted, or crashed "
             "unexpectedly. Check the task logs for an earlier error to debug further. "
             "[type.googleapis.com/tensorflow.CoordinationServiceError='']")
LEADER = ("   F0929 17:42:48.594200 1044529 client.h:77] Terminating process because the JAX "
          "distributed service detected fatal errors. This most likely indicates that another task "
          "died; see the other task logs for more details. Disable Python buffering, i.e. `python "
          "-u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send "
          "RPC to coordination service. Either the leader task was preempted/died/restarted "
          "unexpectedly or this task is experiencing network issues. Check earlier logs from 1) "
          "this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug "
          "further.")


def _verdict(lines, context):
    return attribute(SCANNER.scan_lines(lines), context)


# -- srun's step node index ----------------------------------------------------------

def test_launch_lines_give_the_step_node_index_and_the_task_hosts():
    layout = parse_layout(LAUNCH)
    assert layout.node_index == {0: "node1", 1: "node2", 2: "node3", 3: "node4"}
    assert layout.task_hosts[0] == "node1" and layout.task_hosts[13] == "node4"


def test_a_node_index_steps_disagree_on_names_no_node():
    assert _node_index([["a", "b"], ["b", "c"], ["a", "b", "d"]]) == {2: "d"}
    assert _agreed([{0: "a", 1: "b"}, {0: "c"}]) == {1: "b"}    # srun task ids alike


def test_srun_io_loss_names_the_indexed_node_as_a_suspect():
    lines = [*LAUNCH, IO_LOST]
    verdict = attribute(SCANNER.scan_lines(lines), context_from_lines(
        lines, nodes=("node1", "node2", "node3", "node4")))
    assert (verdict.action, verdict.blame, verdict.unexplained) == ("requeue", "unknown", True)
    assert verdict.suspects == ("node1",) and verdict.nodes == ()


def test_srun_node_index_maps_through_the_layout_not_the_job_order():
    context = AttributionContext(nodes=("n1", "n2", "n3"), node_index={0: "n3", 1: "n1"})
    assert _verdict([NO_CONTACT], context).suspects == ("n3",)


def test_srun_node_index_unknown_names_no_node():
    for context in (AttributionContext(nodes=("n1", "n2")),
                    AttributionContext(nodes=("n1", "n2"), task_hosts={0: "n2"})):
        verdict = _verdict([IO_LOST], context)
        assert verdict.suspects == () and verdict.nodes == () and verdict.where == ()


def test_srun_node_index_of_a_one_node_job_is_its_node():
    verdict = _verdict([IO_LOST], AttributionContext(nodes=("gpu7",)))
    assert verdict.suspects == ("gpu7",) and verdict.where == ("gpu7",)


def test_a_task_that_failed_to_launch_names_its_node():
    context = AttributionContext(nodes=("nid1", "nid2"), task_hosts={256: "nid2"})
    assert _verdict([LAUNCH_FAILED], context).where == ("nid2",)
    unplaced = _verdict([LAUNCH_FAILED], AttributionContext(nodes=("nid1", "nid2")))
    assert unplaced.where == () and unplaced.nodes == ()


# -- XLA coordination-service task ids ---------------------------------------------

def test_a_coordination_task_maps_through_srun_tasks_not_ranks():
    # task 0 is Slurm task 0 (SLURM_PROCID); NCCL rank 0 of the same job may be elsewhere
    context = AttributionContext(nodes=("a", "b"), rank_hosts={0: "b"}, task_hosts={0: "a"})
    verdict = _verdict([HEARTBEAT], context)
    assert (verdict.action, verdict.unexplained, verdict.suspects) == ("requeue", True, ("a",))


def test_a_lost_coordination_service_suspects_its_host_not_the_reporters():
    context = AttributionContext(nodes=("a", "b", "c"), task_hosts={0: "a", 1: "b", 2: "c"})
    verdict = _verdict([LEADER, LEADER], context)
    assert verdict.suspects == ("a",) and verdict.nodes == () and verdict.blame == "unknown"


def test_a_coordination_task_not_placed_names_no_node():
    verdict = _verdict([HEARTBEAT, LEADER], AttributionContext(nodes=("a", "b"),
                                                                rank_hosts={0: "b"}))
    assert verdict.suspects == () and verdict.where == ()


# -- CUDA initialization error in a forked worker ----------------------------------

# feiyunzhang/i3d-non-local-pytorch#7 (PyTorch < 1.2 re-raises the worker's traceback)
WORKER_TRACEBACK = [
    "RuntimeError: Traceback (most recent call last):",
    '  File "/usr/local/lib/python2.7/dist-packages/torch/utils/data/_utils/worker.py", line 99, '
    "in _worker_loop",
    "    samples = collate_fn([dataset[i] for i in batch_indices])",
    '  File "/usr/local/lib/python2.7/dist-packages/torch/utils/data/_utils/collate.py", line 59, '
    "in default_collate",
    "    return torch.tensor(batch)",
    "RuntimeError: CUDA error: initialization error",
]
# pytorch/pytorch#33407 (THC, in a multiprocessing child)
THC_CHILD = [
    "THCudaCheck FAIL file=/pytorch/aten/src/THC/THCGeneral.cpp line=50 error=3 : initialization error",
    "Process Process-2:",
    "Traceback (most recent call last):",
]
# NVIDIA/nccl#1029: CUDA cannot start on the node itself
NODE_INIT = ("rdma-test-gpu-worker-1: rdma-test-gpu-worker-1:2918:4483 [4] init.cc:263 NCCL WARN "
             "Cuda failure 'initialization error'")


def test_cuda_initialization_error_in_a_forked_worker_stops_without_blaming_the_node():
    for lines in (WORKER_TRACEBACK, THC_CHILD):
        verdict = _verdict(lines, AttributionContext(nodes=("g1", "g2")))
        assert (verdict.blame, verdict.action, verdict.nodes) == ("application", "stop", ())
        assert "forked worker" in verdict.reason


def test_pytorchs_forked_subprocess_message_stops():
    # facebookresearch/pycls#183
    verdict = _verdict(["RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA "
                        "with multiprocessing, you must use the 'spawn' start method"],
                       AttributionContext(nodes=("g1",)))
    assert (verdict.blame, verdict.action, verdict.nodes) == ("application", "stop", ())


def test_cuda_initialization_error_outside_a_worker_still_excludes_the_node():
    verdict = _verdict([NODE_INIT], AttributionContext(nodes=("rdma-test-gpu-worker-1", "w2")))
    assert (verdict.blame, verdict.action, verdict.nodes) == (
        "node", "requeue_exclude", ("rdma-test-gpu-worker-1",))


# -- NVLink and contained errors -----------------------------------------------------

# MIC-DKFZ/nnUNet#1519; a public experiment report (find_string id 59652336300)
NVLINK = "RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution"
CONTAINED = ("torch.AcceleratorError: CUDA error: Invalid access of peer GPU memory over nvlink "
             "or a hardware error")


def test_an_nvlink_error_blames_the_node_that_printed_it():
    detections = with_host(SCANNER.scan_lines([NVLINK]), "gpu07")
    verdict = attribute(detections, AttributionContext(nodes=("gpu06", "gpu07")))
    assert (verdict.action, verdict.blame, verdict.nodes) == ("requeue_exclude", "node", ("gpu07",))
    assert verdict.signature == "cuda:nvlink"
    unnamed = attribute(SCANNER.scan_lines([NVLINK]), AttributionContext(nodes=("gpu06", "gpu07")))
    assert unnamed.nodes == () and unnamed.signature == "cuda:nvlink"


def test_a_contained_error_is_retried_with_its_node_as_the_suspect():
    # the catalog's Xid 94 (contained): restart the program, the GPU stays usable
    detections = with_host(SCANNER.scan_lines([CONTAINED]), "gpu07")
    verdict = attribute(detections, AttributionContext(nodes=("gpu06", "gpu07")))
    assert (verdict.action, verdict.blame, verdict.nodes) == ("requeue", "unknown", ())
    assert verdict.signature == "cuda:contained" and verdict.suspects == ("gpu07",)


def test_nvlink_error_with_the_nodes_xid_names_the_gpu():
    # the Xid 74 line of kernel_gpu.toml's kernel.nvlink_fatal examples
    xid = SCANNER.scan_lines(["[449410.332316] NVRM: Xid (PCI:0003:00:00): 74, pid='<unknown>', "
                              "name=<unknown>, NVLink: fatal error detected on link 14(0x0, 0x0, "
                              "0x10000, 0x0, 0x0, 0x0, 0x0)"])
    events = tuple(Detection(**{**d.__dict__, "host": "gpu07", "evidence": (
        Evidence(d.evidence[0].text, "hook:gpu07/epilog"),)}) for d in xid)
    verdict = attribute(SCANNER.scan_lines([NVLINK]),
                        AttributionContext(nodes=("gpu06", "gpu07"), node_events=events))
    assert (verdict.blame, verdict.nodes) == ("node", ("gpu07",))
    assert verdict.gpus == ("0003:00:00",)


def test_the_tasks_the_service_lists_as_unhealthy_are_the_suspects():
    # jax-ml/jax docs/fault_tolerance.rst: what every surviving task prints
    lines = [
        "   E0926 17:26:32.075402  157988 coordination_service_agent.cc:332] Polled an error from "
        "coordination service (this can be an error from this or another task).",
        "   F0926 17:26:32.075587  157988 client.h:77] Terminating process because the JAX "
        "distributed service detected fatal errors. This most likely indicates that another task "
        "died; see the other task logs for more details. Disable Python buffering, i.e. `python "
        "-u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following "
        "tasks are unhealthy (stopped sending heartbeats):",
        "   /job:jax_worker/replica:0/task:3",
        "   The tasks have crashed. Check the task logs for an earlier error, or scheduler events "
        "(e.g. preemption, eviction) to debug further.",
    ]
    context = AttributionContext(nodes=("a", "b"), task_hosts={0: "a", 1: "a", 2: "b", 3: "b"},
                                 rank_hosts={3: "a"})
    verdict = _verdict(lines, context)
    assert (verdict.action, verdict.unexplained, verdict.suspects) == ("requeue", True, ("b",))
    assert _verdict(lines, AttributionContext(nodes=("a", "b"))).suspects == ()


def test_the_lost_leader_is_the_steps_first_node_when_tasks_are_not_placed():
    # jax's SlurmCluster: the coordinator is the first host of SLURM_STEP_NODELIST
    context = AttributionContext(nodes=("a", "b"), node_index={0: "b", 1: "a"})
    assert _verdict([LEADER], context).suspects == ("b",)


def _node_event(line: str, host: str) -> tuple[Detection, ...]:
    return tuple(Detection(**{**d.__dict__, "host": host, "evidence": (
        Evidence(d.evidence[0].text, f"hook:{host}/epilog"),)}) for d in SCANNER.scan_lines([line]))


def test_a_contained_error_excludes_the_node_only_with_an_uncontained_xid():
    # Xid 95: an Inspur repair ticket quoting the node's kernel log (find_string id
    # 66017441585); Xid 94: the example NVIDIA's driver source gives for it
    # (NVIDIA/open-gpu-kernel-modules, find_string id 36408523)
    xid95 = _node_event("NVRM: Xid (PCI:0000:37:00): 95, pid=5171, Uncontained: FBHUB. RST: Yes, "
                        "D-RST: No", "gpu07")
    xid94 = _node_event("NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE User Channel "
                        "(0x9). RST: No, D-RST: No", "gpu07")
    nodes = ("gpu06", "gpu07")
    hard = attribute(SCANNER.scan_lines([CONTAINED]),
                     AttributionContext(nodes=nodes, node_events=xid95))
    assert (hard.blame, hard.action, hard.nodes, hard.gpus) == (
        "node", "requeue_exclude", ("gpu07",), ("0000:37:00",))
    soft = attribute(SCANNER.scan_lines([CONTAINED]),
                     AttributionContext(nodes=nodes, node_events=xid94))
    assert soft.action == "requeue" and soft.nodes == ()


def test_nccls_initialization_error_is_not_read_as_a_forked_worker():
    # NVIDIA/nccl#1029's NCCL line, with pytorch/pytorch#33407's multiprocessing header
    verdict = _verdict([NODE_INIT, "Process Process-2:"],
                       AttributionContext(nodes=("rdma-test-gpu-worker-1", "w2")))
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("rdma-test-gpu-worker-1",))

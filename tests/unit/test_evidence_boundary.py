"""What a job's own output may prove (issue 14, finding 2): a host it names
counts only inside the job's allocation, and a kernel or daemon message printed
into it is no node evidence at all. Pure functions; the live, unprivileged-user
version is tests/integration/test_security_evidence_live.py."""
from __future__ import annotations

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext
from recovery_agent.detect.evidence import all_detections
from recovery_agent.detect.model import Detection, Evidence, Verdict
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.decide.policy import confined, decide

XID_NODE4 = ("Dec  1 07:30:00 node4 kernel: [ 5123.443210] NVRM: Xid (PCI:0000:18:00): 79, "
             "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
CUDA_ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def scan(lines, origin):
    stream = Scanner(load_rules(), engine="re").stream("/home/m/slurm-9.out", origin=origin)
    found = []
    for n, line in enumerate(lines, 1):
        found += stream.feed(line, n)
    return found + stream.flush()


def test_kernel_line_in_job_output_blames_no_node():
    found = scan([XID_NODE4, "srun: error: node1: task 0: Exited with exit code 1"], "job")
    xid = next(d for d in found if d.rule == "kernel.xid")
    assert xid.origin == "job" and xid.emitter == "system" and xid.host == "node4"
    verdict = attribute(found, AttributionContext(nodes=("node1",)))
    assert "node4" not in verdict.nodes
    assert verdict.category != "gpu_hardware"
    # even one naming the job's own node proves nothing: users can print it
    own = scan([XID_NODE4.replace("node4", "node1")], "job")
    assert attribute(own, AttributionContext(nodes=("node1",))).blame != "node"


def test_the_same_line_from_a_node_source_is_node_evidence():
    found = scan([XID_NODE4], "system")
    verdict = attribute(found, AttributionContext(nodes=("node3", "node4")))
    assert verdict.blame == "node" and verdict.nodes == ("node4",)
    # offline analysis of a file an admin picked (origin unknown) reads it as before
    assert attribute(scan([XID_NODE4], ""), AttributionContext()).nodes == ("node4",)


def test_host_named_in_job_output_counts_only_inside_the_allocation():
    peer = Detection(rule="nccl.ib_completion_from_peer", category="interconnect",
                     action_hint="requeue_exclude", host="node4", origin="job",
                     evidence=(Evidence("NET/IB : Got completion from peer node4 ...",
                                        "/o"),))
    outside = attribute([peer], AttributionContext(nodes=("node1", "node2")))
    assert outside.nodes == ()
    inside = attribute([peer], AttributionContext(nodes=("node1", "node4")))
    assert inside.nodes == ("node4",)
    unknown = attribute([peer], AttributionContext())   # the allocation is not known
    assert unknown.nodes == ()


def test_decisions_never_leave_the_allocation():
    verdict = Verdict(blame="node", category="gpu_hardware", action="requeue_exclude",
                      confidence=0.9, nodes=("node4",), reason="whatever")
    kept = confined(verdict, ("node1", "node2"))
    assert kept.blame == "unknown" and kept.nodes == () and kept.action == "requeue"
    assert "node4" in kept.reason
    both = confined(Verdict(blame="node", category="interconnect", action="requeue_exclude",
                            confidence=0.9, nodes=("node1", "node4")), ("node1", "node2"))
    assert both.nodes == ("node1",)
    decision = decide(kept)
    assert "node4" not in decision.exclude and decision.drain == ()


def test_hardware_drain_needs_node_level_evidence():
    verdict = Verdict(blame="node", category="gpu_hardware", action="requeue_exclude",
                      confidence=0.8, nodes=("node2",), reason="cuda.ecc_uncorrectable")
    only_job = decide(verdict, witnessed=())
    assert only_job.exclude == ("node2",) and only_job.drain == ()
    assert "not drained" in only_job.reason
    assert decide(verdict, witnessed=("node2",)).drain == ("node2",)


def test_all_detections_keep_node_reports_as_evidence():
    event = Detection(rule="node.xid", category="gpu_hardware", severity="critical",
                      host="node2", xid=79, origin="system", emitter="system",
                      evidence=(Evidence("NVRM: Xid (PCI:0000:18:00): 79, ...",
                                         "hook:node2"),))
    job_lines = scan([CUDA_ECC], "job")
    ctx = AttributionContext(nodes=("node1", "node2"), node_events=(event,))
    assert any(d.rule == "node.xid" and d.role == "root"
               for d in all_detections(job_lines, ctx))
    assert attribute(job_lines, ctx).nodes == ("node2",)

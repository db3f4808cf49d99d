"""Attribution: which detection wins, and which node (if any) is to blame."""
from __future__ import annotations

from recovery_agent.detect.attempts import PriorAttempt
from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import AttributionContext, context_from_lines, parse_layout
from recovery_agent.detect.evidence import all_detections
from recovery_agent.detect.straggler import straggler_verdict
from recovery_agent.detect.model import Detection, Evidence, Verdict
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")
TIMEOUT = ("[rank{r}]:[E1 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
           "operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) ran "
           "for 600100 milliseconds before timing out.")


def _verdict(lines: list[str], **context) -> Verdict:
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines, **context))


def test_nothing_detected_means_nothing_to_do():
    verdict = _verdict(["step 1 loss 2.0", "step 2 loss 1.9"])
    assert (verdict.blame, verdict.category, verdict.action, verdict.rests_on) == (
        "unknown", None, "none", ())


def test_an_application_error_before_timeouts_is_the_cause():
    lines = ["[rank2]: ValueError: label out of range"] + [TIMEOUT.format(r=r) for r in (0, 1)]
    verdict = _verdict(lines)
    assert (verdict.blame, verdict.category, verdict.action) == ("application", "application",
                                                                 "stop")
    assert verdict.rests_on == (0,)


def test_timeouts_alone_requeue_without_blame():
    verdict = _verdict([TIMEOUT.format(r=r) for r in range(4)])
    assert (verdict.blame, verdict.category, verdict.action, verdict.nodes) == (
        "unknown", "nccl_timeout_hang", "requeue", ())
    assert verdict.rests_on == (0, 1, 2, 3)


def test_an_xid_from_the_node_report_explains_the_log():
    lines = [TIMEOUT.format(r=0), "RuntimeError: CUDA error: unspecified launch failure"]
    xid = Detection(rule="xid", category="gpu_hardware", host="gpu-b2", xid=79, pci="0000:3b:00",
                    detail="GPU has fallen off the bus.",
                    evidence=(Evidence("NVRM: Xid ... 79", "hook:gpu-b2/epilog", time=150.0),))
    context = AttributionContext(nodes=("gpu-b1", "gpu-b2"), node_events=(xid,),
                                 window=(100.0, 200.0))
    verdict = attribute(SCANNER.scan_lines(lines), context)
    assert (verdict.blame, verdict.category, verdict.action, verdict.nodes, verdict.gpus) == (
        "node", "gpu_hardware", "requeue_exclude", ("gpu-b2",), ("0000:3b:00",))
    assert verdict.rests_on == (2,)
    assert all_detections(SCANNER.scan_lines(lines), context)[2].role == "root"


def test_node_events_outside_the_window_are_ignored():
    xid = Detection(rule="xid", category="gpu_hardware", host="gpu-b2", xid=79,
                    evidence=(Evidence("old", "hook", time=10.0),))
    context = AttributionContext(node_events=(xid,), window=(100.0, 200.0))
    assert attribute([], context).action == "none"


def test_slurm_node_fail_and_node_state():
    lines = [TIMEOUT.format(r=0)]
    verdict = _verdict(lines, nodes=("a1", "a2"), node_fail=("a2",))
    assert (verdict.blame, verdict.nodes, verdict.action) == ("node", ("a2",), "requeue_exclude")
    verdict = _verdict(lines, nodes=("a1", "a2"), node_states={"a1": "IDLE", "a2": "DOWN+DRAIN"})
    assert verdict.nodes == ("a2",)


def test_ranks_map_to_hosts_from_the_log():
    lines = ["srun: launching StepId=77.0 on host gpu-c1, 4 tasks: [0-3]",
             "srun: launching StepId=77.0 on host gpu-c2, 4 tasks: [4-7]",
             "    [5] finished collective #8, but didn't join collective #9 (count from 1)"]
    detections = SCANNER.scan_lines(lines)
    context = context_from_lines(lines)
    assert context.rank_hosts[5] == "gpu-c2"
    assert all_detections(detections, context)[0].host == "gpu-c2"
    assert attribute(detections, context).action == "stop"


def test_layout_from_nccl_and_slurm_lines():
    layout = parse_layout([
        "[2025-01-01T00:00:00] sched: Allocate JobId=9 NodeList=gpu-[01-02] #CPUs=8",
        "gpu-01:100:100 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>",
        "gpu-02:200:200 [1] NCCL INFO comm 0x55 rank 3 nranks 4 cudaDev 1 busId 1b000 - Init "
        "COMPLETE",
        "gpu-01:100:100 [0] NCCL INFO comm 0x66 rank 3 nranks 2 cudaDev 0 busId 1b000 - Init "
        "COMPLETE",
        "  host      : gpu-01", "  rank      : 0 (local_rank: 0)"])
    assert layout.nodes == ("gpu-01", "gpu-02")
    assert layout.addresses == {"10.0.0.1": "gpu-01"}
    assert layout.rank_hosts == {0: "gpu-01", 3: "gpu-02"}   # the widest communicator wins


def test_a_peer_address_becomes_its_host():
    lines = ["gpu-07:1:1 [0] NCCL INFO Bootstrap : Using ib0:10.9.0.7<0>",
             "gpu-03:5:6 [2] transport/net_ib.cc:1 NCCL WARN NET/IB : Got completion from peer "
             "10.9.0.7<4000> with status=12 opcode=0 len=0 vendor err 129"]
    assert _verdict(lines).nodes == ("gpu-07",)


def test_a_single_node_job_names_its_node():
    verdict = _verdict(["slurmstepd: error: execve(): /var/spool/slurmd/job1/slurm_script: "
                        "No such file or directory"], nodes=("solo1",))
    assert (verdict.blame, verdict.nodes) == ("node", ("solo1",))


def test_the_node_common_to_repeated_failures_is_blamed():
    lines = [TIMEOUT.format(r=0)]
    earlier = (PriorAttempt(("n1", "n2", "n3")), PriorAttempt(("n3", "n4", "n5")))
    verdict = _verdict(lines, nodes=("n3", "n6"), previous=earlier)
    assert (verdict.blame, verdict.nodes, verdict.action) == ("node", ("n3",), "requeue_exclude")
    assert "common to 3 failed attempts" in verdict.reason
    application = Verdict(blame="application", category="application", action="stop",
                          confidence=0.9)
    verdict = _verdict(lines, nodes=("n3", "n6"), previous=(PriorAttempt(("n3",), application),))
    assert verdict.nodes == ()


def test_two_xids_take_the_stronger_action():
    lines = ["NVRM: Xid (PCI:0000:01:00): 32, Channel ID 00000005 intr 00008000",
             "NVRM: Xid (PCI:0000:01:00): 69, Class Error: ChId 0005"]
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action, verdict.blame, verdict.gpus) == (
        "gpu_hardware", "requeue", "node", ("0000:01:00",))


def test_an_application_fault_reported_by_the_gpu_blames_the_application():
    verdict = _verdict(["NVRM: Xid (PCI:0000:cb:00): 13, Graphics SM Warp Exception"])
    assert (verdict.blame, verdict.action, verdict.gpus) == ("application", "stop", ())


def test_info_lines_alone_decide_nothing():
    verdict = _verdict(["slurmstepd: error: *** JOB 5 ON n1 CANCELLED AT 2025-01-01T00:00:00 ***"])
    assert (verdict.category, verdict.action, verdict.reason) == (
        None, "none", "only informational lines")


def _straggler(host: str | None, rank: int) -> Detection:
    return Detection(rule="straggler", category="interconnect", severity="warning",
                     action_hint="none", host=host, rank=rank,
                     detail=f"rank {rank} on {host} is slow" if host else f"rank {rank} is slow")


def test_a_straggler_blames_the_slow_hosts_and_rests_on_the_new_detections():
    earlier = SCANNER.scan_lines([TIMEOUT.format(r=0)])
    slow = [_straggler("gpu-a03", 5), _straggler(None, 6), _straggler("gpu-a04", 7)]
    verdict = straggler_verdict(earlier + slow, slow)
    assert verdict == Verdict(blame="node", category="straggler", action="kill_requeue",
                              confidence=0.6, nodes=("gpu-a03", "gpu-a04"),
                              rests_on=(1, 2, 3), reason="rank 5 on gpu-a03 is slow")


def test_a_straggler_on_no_named_host_blames_no_node():
    slow = [_straggler(None, 2)]
    verdict = straggler_verdict(slow, slow)
    assert (verdict.blame, verdict.nodes, verdict.rests_on, verdict.action) == (
        "unknown", (), (0,), "kill_requeue")
    assert verdict.reason == "rank 2 is slow"

"""Naming the node from the formats that print it, and taking nothing that is
no node: slurmstepd's cancel notices, PyTorch's process-group prefix for the
default group's rank, and the names posters and containers put where a
hostname goes (a redaction placeholder, a Docker container id).

Every line is a real one, copied verbatim from the public source named above
it (an issue thread, or a job log quoted in a public repository).
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import LayoutLines, context_from_lines
from recovery_agent.detect.origin import line_origin, names_no_node
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# (line, host, rank)
NAMED = [
    # a shell prompt before a tool that reads the machine it runs on: an admin's
    # look at that node (clustervision/trinity#219, Azure/az-hop#269,
    # xxd3vin/workspace#19)
    ("[root@node045 ~]# ibstatus", "node045", None),
    ("[xpillons@h9svu000000 ~]$ nvidia-smi", "h9svu000000", None),
    ("[root@bh174 chenyang]# nvidia-smi ", "bh174", None),
    # grep's "FILE:" before a syslog line (grep over several logs), the host after
    # the time stamp: aws/aws-parallelcluster#1150 (r6 tune row)
    ("messages:Jun 17 20:18:08 ip-172-31-27-211 kernel: INFO: task strat1_sim:78808 blocked "
     "for more than 120 seconds.", "ip-172-31-27-211", None),
    # slurmstepd's notice names the node it runs on, after "ON"
    # https://github.com/Nextomics/NextDenovo/issues/114
    ("slurmstepd: error: *** JOB 867816 ON c0700a-s1 CANCELLED AT 2021-05-11T12:06:17 DUE TO "
     "TIME LIMIT ***", "c0700a-s1", None),
    # https://github.com/labsyspharm/mcmicro/issues/163
    ("slurmstepd: error: *** JOB 13055114 ON compute-h-17-51 CANCELLED AT 2020-07-11T22:48:26 "
     "DUE TO TIME LIMIT ***", "compute-h-17-51", None),
    # a step's notice, then srun's report for the other node
    # https://github.com/desihub/desitarget/issues/628
    ("slurmstepd: error: *** STEP 32233190.0 ON nid01934 CANCELLED AT 2020-07-03T02:59:56 DUE "
     "TO TIME LIMIT ***", "nid01934", None),
    ("srun: error: nid01935: tasks 8-15: Terminated", "nid01935", None),
    # older releases put the node last, before or after the closing stars
    # https://github.com/marbl/canu/issues/1067
    ("slurmstepd: *** JOB 830329 CANCELLED AT 2018-08-06T17:21:44 DUE TO TIME LIMIT on n447 ***",
     "n447", None),
    # a cluster's documentation quoting a job's error file (find_string id 6002978768)
    ("slurmstepd: *** JOB 6398 CANCELLED AT 2015-09-04T16:40:47 *** on a1a-u2-c10-b1",
     "a1a-u2-c10-b1", None),
    # PyTorch >= 2.4 prefixes the default group's messages with its global rank
    # https://github.com/instructlab/training/pull/520
    ("  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated "
     "with exception: [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, "
     "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1) ran for 90 milliseconds before "
     "timing out.", None, 3),
    # https://github.com/XPixelGroup/BasicSR/issues/737 (the [rankN]: prefix agrees)
    ("[rank1]:[E626 06:24:44.906457629 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID "
     "0(default_pg) Rank 1] Exception (either an error or timeout) detected by watchdog at work: "
     "808, last enqueued NCCL work: 811, last completed NCCL work: 807.", None, 1),
    # NCCL's host:pid:tid: a name with "hostname" in it is still a name
    # https://github.com/NVIDIA/nccl/issues/1814
    ("hostname-test:986:1338 [6] NCCL INFO NCCL_IB_TIMEOUT set by environment to 18.",
     "hostname-test", None),
    # torchrun's [defaultN]: (a local rank, no node) before NCCL's prefix (a job log in
    # a public repository, find_string id 66280673503)
    ("[default0]:tp4-dp2-inference-pods-0:78:140 [0] NCCL INFO comm 0x55bde6678070 rank 0 "
     "nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0", "tp4-dp2-inference-pods-0", None),
    # a log quoted in a thread ("> " before each line; find_string id 69394828704)
    ("> node-0:188802:188816 [3] NCCL INFO comm 0x342c6e0 rank 3 nranks 4 cudaDev 3 busId "
     "800000 commId 0xa140d81a47b5f3aa - Init START", "node-0", None),
    # the printer of a local IB error whose peer is an IPv6 link-local address
    # https://github.com/NVIDIA/nccl/issues/928
    ("H100-2:19989:20082 [1] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion from "
     "peer fe80::966d:ae03:8b:df78%ib0<53249> with error 4, opcode 32564, len 32564, vendor "
     "err 81 (Send)", "H100-2", None),
]

WATCHDOG_PG_RANK = next(line for line, _, rank in NAMED if rank == 3)

# lines whose prefixes or notices name no machine one could exclude
UNNAMED = [
    # a container's hostname is its id (NCCL's prefix inside Docker)
    # https://github.com/NVIDIA/nccl/issues/1838
    "[2025-09-09 23:51:24] 9b405963aa12:774:854 [0] transport/shm.cc:590 NCCL WARN Cuda failure "
    "217 'peer access is not supported between these two devices'",
    # a poster's stand-in for the hostname
    # https://github.com/NVIDIA/nccl-tests/issues/188
    "user:16901:16967 [2] misc/socket.cc:441 NCCL WARN socketFinalizeAccept: wrong type 4 != 3",
    # a redacted node in slurmstepd's notice
    # https://github.com/ZettaAI/zetta_utils/issues/671
    "slurmstepd: error: *** JOB 494583 ON ... CANCELLED AT 2024-04-20T09:09:37 DUE TO TIME "
    "LIMIT ***",
    # a redacted host in NCCL's prefix (find_string id 66280673503)
    "[default3]:...:81:150 [3] NCCL INFO ncclCommSplit comm 0x557cb9834e50 rank 3 nranks 4 "
    "cudaDev 3 nvmlDev 3 busId 87000 parent 0x557cb94049d0 splitCount 2 color 2003953581 key 3- "
    "Init START",
    # shell prompts before a launch name the machine a command was typed on, not
    # a failing node
    # https://github.com/facebookresearch/deit/issues/28
    "(deit92) [yuxin.fang@gpu-dev006 deit]$ NCCL_DEBUG=INFO bash train.sh",
    # https://github.com/vllm-project/vllm/issues/5222
    "root@server01:~# hostnamectl",
    # ... or before nothing (ArjunaCluster/ArjunaUsers#52)
    "(abnn) mingzeya@c002:~/CGCNN_project/AbNN_benchmark/hform/case1    $ ",
    # glog chatter: a bare [Rank N] is the group's own numbering, not taken
    # https://github.com/pytorch/pytorch/issues/88000
    "I1028 12:13:38.405081 632355 ProcessGroupNCCL.cpp:843] [Rank 0] NCCL watchdog thread "
    "started!",
]


@pytest.mark.parametrize("line, host, rank", NAMED, ids=lambda v: str(v)[:40])
def test_the_format_names_its_node_or_rank(line, host, rank):
    origin = line_origin(line)
    assert (origin.host, origin.rank) == (host, rank)


@pytest.mark.parametrize("line", UNNAMED, ids=lambda v: v[:40])
def test_no_node_is_taken_from_what_is_no_host(line):
    origin = line_origin(line)
    assert (origin.host, origin.address, origin.rank) == (None, None, None)
    assert all(d.host is None for d in SCANNER.scan_lines([line]))


def test_another_groups_rank_is_not_the_global_rank():
    # PG 3's rank 5 (https://github.com/sgl-project/sglang/issues/1693)
    line = ("  what():  [PG 3 Rank 5] Process group watchdog thread terminated with exception: "
            "[Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9141, "
            "OpType=_ALLGATHER_BASE, NumelIn=19008, NumelOut=152064, Timeout(ms)=600000) ran "
            "for 600020 milliseconds before timing out.")
    assert line_origin(line).rank is None


def test_a_redacted_peer_address_names_no_peer():
    # the address NCCL printed, masked by the poster (https://github.com/NVIDIA/nccl/issues/1814)
    line = ("NCCL WARN NET/IB : Got completion from peer xxx.xxx.xxx.xxx<55921> with status=12 "
            "opcode=1 len=0 vendor err 129 (Send) localGid ::ffff:29.87.4.221 "
            "remoteGids::ffff:29.87.88.182")
    found = SCANNER.scan_lines([line])
    assert found and all(d.host is None for d in found)


@pytest.mark.parametrize("name, none", [
    ("localhost", True), ("user", True), ("USERNAME", True), ("hostname", True),
    ("SERVER_NAME", True), ("gpu-xxx", True), ("xxx.xxx.xxx.xxx", True), ("9b405963aa12", True),
    ("xxxx108", False),
    ("hostname-test", False), ("H100-2", False), ("nid01934", False), ("deadbeef", False),
    ("a100-st-p4d24xlarge-22", False), ("master", False),
])
def test_names_no_node(name, none):
    assert names_no_node(name) is none


def test_a_rank_from_the_group_prefix_reaches_its_node():
    # NCCL's init line puts rank 3 on tesla-106 (a job log in a public repository,
    # find_string id 31276347573); the default group's prefix on the watchdog line
    # names rank 3, so the verdict names that node
    init = ("tesla-106:13398:14208 [3] NCCL INFO comm 0x7fd174001060 rank 3 nranks 4 cudaDev 3 "
            "busId b1000 - Init COMPLETE")
    watchdog = WATCHDOG_PG_RANK
    context = context_from_lines([init, watchdog])
    assert context.rank_hosts.get(3) == "tesla-106"
    verdict = attribute(SCANNER.scan_lines([init, watchdog]), context)
    assert "tesla-106" in verdict.where + verdict.nodes + verdict.suspects


def test_newer_nccl_init_lines_with_a_rank_tag_map_the_rank():
    # NCCL >= 2.27 tags init lines with [Rank N] after the level (find_string id 69779674152)
    line = ("macpro2019-01:253809:253907 [3] NCCL INFO [Rank 3] ncclCommInitAll_impl comm "
            "0x588ff95e26d0 rank 3 nranks 4 cudaDev 3 nvmlDev 3 busId 1e000 commId "
            "0x1c50a375ab9ec53d - Init START")
    assert line_origin(line).host == "macpro2019-01"
    assert context_from_lines([line]).rank_hosts == {3: "macpro2019-01"}


# -- a hostless node-side failure in a log every prefixed line of which one host printed --

# an NCCL line of a Slurm job on qgpu2009 (https://github.com/huggingface/accelerate/issues/2246)
# and PyTorch's report of an uncorrectable ECC error
# (https://github.com/tloen/alpaca-lora/issues/123),
# put together here as one node's log
ONE_HOST = "qgpu2009:9502:9525 [0] NCCL INFO Using network IB"
OTHER_HOST = "qgpu2008:35184:35221 [1] NCCL INFO Using network IB"
ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def _verdict(lines, **known):
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines, **known))


def test_a_hostless_failure_is_on_the_one_host_that_printed_the_log():
    assert context_from_lines([ONE_HOST, ECC]).printers == ("qgpu2009",)
    verdict = _verdict([ONE_HOST, ECC])
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("qgpu2009",))


def test_two_printing_hosts_leave_a_hostless_failure_unplaced():
    verdict = _verdict([ONE_HOST, OTHER_HOST, ECC])
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ())


def test_known_job_nodes_win_over_the_printers():
    # several nodes known (from Slurm): which one printed the bare line is not known
    verdict = _verdict([ONE_HOST, ECC], nodes=("qgpu2008", "qgpu2009"))
    assert verdict.nodes == ()


def test_a_rule_naming_another_node_never_falls_back_to_the_printer():
    # slurmstepd on jean-zay-iam17 reports that some node of the job failed: the
    # printer is not the failed node (a Jean Zay job log quoted in a public
    # repository, find_string id 13860421536)
    line = ("slurmstepd: error: *** STEP 1943824.0 ON jean-zay-iam17 CANCELLED AT "
            "2023-03-06T03:17:51 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    assert context_from_lines([line]).printers == ("jean-zay-iam17",)
    verdict = _verdict([line])
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ())


def test_a_peer_fqdn_of_the_printing_host_is_that_host_not_a_suspect():
    # NCCL names its peer by FQDN, its own prefix by the short name: the same node
    # (https://github.com/dmlc/xgboost/issues/7982)
    lines = ["ip-172-31-12-104:28056:17126 [0] misc/socket.cc:523 NCCL WARN Net : Connection "
             "closed by remote peer ip-172-31-12-104.ap-southeast-1.compute.internal<36803>"]
    [found] = SCANNER.scan_lines(lines)
    assert found.host == "ip-172-31-12-104.ap-southeast-1.compute.internal"
    context = context_from_lines(lines)
    assert context.printers == ("ip-172-31-12-104",)
    verdict = attribute([found], context)
    assert verdict.suspects == () and verdict.where == ("ip-172-31-12-104",)


def test_srun_names_the_failed_node_and_slurmstepds_printer_is_not_blamed():
    # srun names the failed node; slurmstepd's notice is printed on another node of
    # the job (a Jean Zay job log quoted in a public repository, find_string id 13860421536)
    lines = ["srun: error: Node failure on jean-zay-iam37",
             "srun: Job step aborted: Waiting up to 62 seconds for job step to finish.",
             "slurmstepd: error: *** STEP 1943824.0 ON jean-zay-iam17 CANCELLED AT "
             "2023-03-06T03:17:51 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***"]
    verdict = _verdict(lines)
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("jean-zay-iam37",))


@pytest.mark.parametrize("line, pci", [
    # nvidia-smi's lost-GPU line names the GPU by its bus id, with or without a space
    # https://github.com/NVIDIA/nvidia-docker/issues/1553
    ("Unable to determine the device handle for GPU 0000:09:00.0: Unknown Error", "0000:09:00"),
    # https://github.com/pdbear/syno_nvidia_gpu_driver/issues/22
    ("Unable to determine the device handle for GPU0000:07:00.0: Unknown Error", "0000:07:00"),
])
def test_a_pci_bus_id_names_the_gpu(line, pci):
    [found] = SCANNER.scan_lines([line])
    assert (found.category, found.pci) == ("gpu_hardware", pci)


def test_an_environment_dump_names_the_node_the_script_ran_on():
    # printenv inside a job (a cluster guide in a public repository, find_string
    # id 54080347048): SLURMD_NODENAME is the node; the dump names no other
    lines = ["SLURM_LAUNCH_NODE_IPADDR=192.168.1.203", "SLURM_GTIDS=0", "SLURMD_NODENAME=cn1",
             "TMPDIR=/tmp"]
    assert context_from_lines(lines).printers == ("cn1",)
    verdict = _verdict([*lines, ECC])
    assert verdict.nodes == ("cn1",)


def test_the_controllers_syslog_host_is_not_a_node_of_the_job():
    # slurmctld's journal on the control node
    # (https://github.com/stackhpc/ansible-role-openhpc/issues/95):
    # its lines speak of other nodes, the printer is none of them
    line = ("Feb 24 09:21:38 nrel-control.novalocal slurmctld[26180]: error: Duplicated "
            "NodeHostName nrel-hpc-0 in the config file")
    assert line_origin(line).host is None
    assert context_from_lines([line]).printers == ()


def test_a_slurmd_log_line_names_the_node_in_its_cancel_notice():
    # slurmd's own log, [time] [step] before the message
    # (https://github.com/ai4d-iasc/trixie/issues/45)
    line = ("[2020-12-14T09:43:55.500] [63532.0] error: *** STEP 63532.0 ON cn106 CANCELLED AT "
            "2020-12-14T09:43:55 ***")
    assert line_origin(line).host == "cn106"


def test_torchruns_failure_summary_names_the_failed_ranks_node():
    # torchrun's ChildFailedError block (an issue thread kept in a public
    # repository, find_string id 69432362941)
    lines = ["Root Cause (first observed failure):", "[0]:",
             "  time      : 2026-06-12_01:14:57", "  host      : pool0-01753",
             "  rank      : 0 (local_rank: 0)", "  exitcode  : -9 (pid: 3908423)",
             "  error_file: <N/A>", "  traceback : Signal 9 (SIGKILL) received by PID 3908423"]
    context = context_from_lines(lines)
    assert (context.rank_hosts, context.printers) == ({0: "pool0-01753"}, ("pool0-01753",))
    # a container's id in that field names no node (find_string id 69757755398)
    other = [*lines[:3], "  host      : 4b1a9e8a140f", *lines[4:]]
    assert context_from_lines(other).printers == ()


def test_torchruns_summary_behind_a_prefix_or_on_one_line_still_places_the_rank():
    # the same summary behind a log collector's timestamp (modelscope/ms-swift
    # PR 8307, a tune row) and with its line breaks lost in an issue comment
    # (ogx-ai/llama-stack-apps#15, a tune row)
    stamped = ["2026-09-17 13:40:05 [1]:",
               "2026-09-17 13:40:05   time      : 2026-09-17_13:40:05",
               "2026-09-17 13:40:05   host      : standalone-q1xmje-13716191-worker-0",
               "2026-09-17 13:40:05   rank      : 0 (local_rank: 0)",
               "2026-09-17 13:40:05   exitcode  : 1 (pid: 226)"]
    context = context_from_lines(stamped)
    assert context.rank_hosts == {0: "standalone-q1xmje-13716191-worker-0"}
    flat = ("Hi any idea how to fix: Root Cause (first observed failure): [0]: time : "
            "2024-07-25_12:48:53 host : ip-119-181-1-31.ec2.internal rank : 0 (local_rank: 0) "
            "exitcode : -9 (pid: 6774) error_file: <N/A> traceback : Signal 9 (SIGKILL) "
            "received by PID 6774")
    context = context_from_lines([flat])
    assert (context.rank_hosts, context.printers) == (
        {0: "ip-119-181-1-31.ec2.internal"}, ("ip-119-181-1-31.ec2.internal",))
    # the layout lines the agent keeps while it tails a log keep them too
    kept = LayoutLines()
    for line in [*stamped, flat, "step 12 loss 2.0 host: a rank: 3"]:
        kept.feed(line)
    assert kept.lines == [stamped[2], stamped[3], flat]
    # a field name padded like the summary's, but no summary: nothing taken
    # from a line that only says "host" in passing
    assert context_from_lines(["connecting to host db01 on rank 3"]).printers == ()


def test_a_rank_placed_on_a_container_id_names_no_node():
    # NCCL's init line inside Docker puts rank 3 on the container's id (a log in a
    # public repository, find_string id 36910972912); the watchdog line's rank 3
    # then names no node
    init = ("3767c65d25c4:855:867 [3] NCCL INFO comm 0x562b860dc3d0 rank 3 nranks 4 cudaDev 3 "
            "nvmlDev 3 busId e7000 commId 0x40531e6886adf963 - Init START")
    verdict = attribute(SCANNER.scan_lines([init, WATCHDOG_PG_RANK]),
                        context_from_lines([init, WATCHDOG_PG_RANK]))
    assert verdict.where == () and verdict.nodes == () and verdict.suspects == ()


def test_nccl_tests_device_table_places_each_rank():
    # nccl-tests' "Using devices" table (https://github.com/NVIDIA/nccl/issues/1925)
    lines = ["#  Rank  0 Group  0 Pid 2620968 on nccl-sleep-c7d759db6-2bp29 device  0 [0008:01:00] "
             "NVIDIA GB200",
             "#  Rank  4 Group  0 Pid 3769900 on nccl-sleep-c7d759db6-cgz82 device  0 [0008:01:00] "
             "NVIDIA GB200"]
    layout = context_from_lines(lines)
    assert (layout.rank_hosts[0], layout.rank_hosts[4]) == ("nccl-sleep-c7d759db6-2bp29",
                                                            "nccl-sleep-c7d759db6-cgz82")

"""Naming the node from text: line prefixes, the layout a log states, peer
addresses through a nodes file, ``patterns test --node/--nodes-file``.

Every log line here is a real one, copied from a public source: ``tune:`` and
``dev:`` name rows of tests/fixtures/corpus (each row has its URL), others the
GitHub thread they were posted in.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from recovery_agent.interfaces.ctl import main
from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import (AttributionContext, context_from_lines, node_addresses,
                                           parse_layout, read_node_addresses, with_host)
from recovery_agent.detect.evidence import all_detections
from recovery_agent.detect.model import Detection, Evidence
from recovery_agent.detect.origin import line_origin
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# (line, host, rank, srun task)
PREFIXES = [
    # syslog RFC 3164 (tune:ho-slurmappliance287-syslog-gpu0-api-mismatch-012)
    ("Jun 30 11:07:05 gpu-0 kernel: NVRM: API mismatch: the client has the version 535.54.03, "
     "but#012NVRM: this kernel module has the version 530.30.02.  Please#012NVRM: make sure "
     "that this kernel module and all NVIDIA driver components#012NVRM: have the same "
     "version.", "gpu-0", None, None),
    # journalctl with a localized month
    # (tune:ho-nbfc181-journal-aer-receiver-error-benign-fan-service)
    ("jan. 29 20:50:17 kevin kernel: pcieport 0000:00:1c.5: AER: Corrected error received: "
     "id=00e5", "kevin", None, None),
    # journalctl -k, a daemon[pid] tag (leptonai/gpud#1209)
    ("Feb 14 05:03:41 000-000-00000-1-gpu-1 systemd[1]: Starting systemd-remount-fs.service - "
     "Remount Root and Kernel File Systems...", "000-000-00000-1-gpu-1", None, None),
    ("Feb 14 05:03:41 000-000-00000-1-gpu-1 kernel: mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 "
     "Link INIT", "000-000-00000-1-gpu-1", None, None),
    # dmesg -T and plain dmesg name no node (dev:gpud-xid13-sm-warp-exception,
    # tune:ho-gpuburn1-aer-surprise-down-then-xid79)
    ("[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', "
     "name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction "
     "Encoding", None, None, None),
    ("[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
     None, None, None),
    # dmesg device names are not hosts (geerlingguy/arm-nas#16)
    ("[   11.097374] mlx5_core 0004:01:00.0: Port module event: module 0, Cable plugged",
     None, None, None),
    # Talos' dmesg forwarder: an IP address names the node
    # (tune:ho-ogkm942-talos-sxid24007-xid62-45-vllm)
    ("192.168.11.119: kern: warning: [2026-04-22T21:25:20.458998481Z]: NVRM: GPU at "
     "PCI:0000:48:00: GPU-5fc0bcec-c2e1-38dc-8994-2a9f9f3b709e", "192.168.11.119", None, None),
    # a monitoring agent's JSON record (NVIDIA/NVSentinel#1475)
    ('{"time":"2026-07-10T07:38:05.417260137Z","level":"INFO","msg":"Attempting to send health '
     'event","module":"syslog-health-monitor","version":"e2e-6bc8cbc4","events":{"version":1,'
     '"nodeName":"aks-gpu-123-vmss00000r","processingStrategy":1}]}}',
     "aks-gpu-123-vmss00000r", None, None),
    # NCCL host:pid:tid [dev] (tune:ho-nccl1405-ib-status12-k8s-worker-peer)
    ("kp-ddp-worker-0:3468:3905 [4] NCCL INFO transport/net.cc:1302 -> 6",
     "kp-ddp-worker-0", None, None),
    # behind a collector timestamp and NCCL 2.26+'s own (dev:nccl1920-socket-send-reset-by-peer)
    ("2025-11-24T03:20:21.001128133Z gpu-server320 [5] NCCL INFO misc/socket.cc:64 -> 6",
     "gpu-server320", None, None),
    # behind Open MPI's --tag-output (tune:ho-nccl230-ib-local-catastrophic-error-container)
    ("2019-06-02T16:13:44.884Z: [1,12]<stdout>:container-e275-1553839402050-12124-01-000057:"
     "815:864 [0] misc/ibvwrap.cu:220 NCCL WARN Call to ibv_get_async_event failed",
     "container-e275-1553839402050-12124-01-000057", 12, None),
    # pdsh's host: then NCCL's (tune:ho-nccl1029-pdsh-worker1-cuda-initialization-error)
    ("rdma-test-gpu-worker-1: rdma-test-gpu-worker-1:2918:4483 [4] init.cc:263 NCCL WARN Cuda "
     "failure 'initialization error'", "rdma-test-gpu-worker-1", None, None),
    # DeepSpeed's pdsh IP prefix and PyTorch's [rankN]:
    # (tune:ho-deepspeed6705-pdsh-prefixed-watchdog-allreduce)
    ("202.197.0.170: [rank1]:[E1101 17:03:05.825965173 ProcessGroupNCCL.cpp:1709] [PG 1 Rank 1] "
     "Timeout at NCCL work: 395, last enqueued NCCL work: 395, last completed NCCL work: 394.",
     "202.197.0.170", 1, None),
    # srun --label (dev:pytorch135486-fatal-python-segfault-barrier)
    ("0: g1002:2128869:2128880 [0] NCCL INFO Setting affinity for GPU 0 to "
     "ffff0000,00000000,ffff0000,00000000", "g1002", None, 0),
    ("0: Fatal Python error: Segmentation fault", None, None, 0),
    # srun's task summary, indented as posted (tune:ho-habitat298-srun-two-nodes-segfault-rebuild)
    ("        srun: error: nid04277: task 1: Segmentation fault (core dumped)",
     "nid04277", None, None),
    ("srun: error: taurusi2031: tasks 10-11: Exited with exit code 1", "taurusi2031", None, None),
    # a Ray worker's ip= (tune:ho-verl3873-watchdog-second-rollout-step-hang)
    ("(WorkerDict pid=97397, ip=33.97.231.144) [rank3]:[E1023 02:44:30.941975491 "
     "ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=26, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1200000) ran "
     "for 1200007 milliseconds before timing out.", "33.97.231.144", 3, None),
    # UCX's [host:pid:tid] (tune:ho-ucx5732-rc-retry-exceeded-some-runs-fail, openucx/ucx#8487,
    # openucx/ucx#3087 behind mpirun's ctime and --tag-output)
    ("[r40c1t7n3:108757:0:108757] ib_mlx5_log.c:136  Transport retry count exceeded on "
     "mlx5_1:1/IB (synd 0x15 vend 0x81 hw_synd 0/0)", "r40c1t7n3", None, None),
    ("[1661938336.553723] [vhost-node1:1499693:6]           flush.c:26   UCX  ERROR req "
     "0x7fc2d40b3c00: error during flush: Endpoint timeout, flush comp 0x7fc2d40b3c90 count "
     "reduced to 2", "vhost-node1", None, None),
    ("Mon Dec 10 08:18:05 2018[1,8]<stderr>:[hpc-polar-01-vm001:13210:0:13210]    "
     "ud_iface.c:732  UCX Fatal: transport error: Endpoint timeout", "hpc-polar-01-vm001", 8,
     None),
    # cuda_memtest's [date][host][dev]: (tune:ho-cudamemtest33-host-prefixed-no-kernel-image-sm35)
    ("[11/21/2021 13:15:17][nis-arch][0]:NVRM version: NVIDIA UNIX x86_64 Kernel Module  "
     "470.86  Tue Oct 26 21:55:45 UTC 2021", "nis-arch", None, None),
    # a plain exception names nothing (dev:nccl934-remote-error-occasional)
    ("ncclRemoteError: A call failed possibly due to a network error or a remote process "
     "exiting prematurely.", None, None, None),
    # journalctl -o short-iso, a +0200 offset (systemd/systemd#29134)
    ("2023-09-08T17:20:30+0200 tarta r710_fan_controller.sh[20911]: Highest drive temperature: "
     "43 Celcius.", "tarta", None, None),
    # journalctl short with an FQDN (systemd/systemd#2342)
    ("Jan 17 10:44:43 myhost.mylocalnetwork.example systemd[1411]: Reached target Basic System.",
     "myhost.mylocalnetwork.example", None, None),
    # syslogd's facility.severity between host and tag (linux-scsi list, "qla2xxx: Fix
    # discovery issues in FC-AL topology", June 2022)
    ("Jun 20 13:51:46 tony13 kern.warn kernel: qla2xxx [0000:00:00.0]-0005: : QLogic Fibre "
     "Channel HBA Driver: 10.02.07.400-k-debug.", "tony13", None, None),
    # Open MPI's BTL prefix [host][[job,vpid],rank][file] (open-mpi/ompi#2168)
    ("[ivy08][[463,1],0][btl_tcp_endpoint.c:803:mca_btl_tcp_endpoint_complete_connect] "
     "connect() to 10.102.1.194 failed: No route to host (113)", "ivy08", 0, None),
    # MPICH/Intel MPI hydra's proxy on the node (cBio/cbio-cluster#256)
    ("[proxy:0:0@cpu-6-2.local] HYD_pmcd_pmip_control_cmd_cb (./pm/pmiserv/pmip_cb.c:883): "
     "assert (!closed) failed", "cpu-6-2.local", None, None),
    # UCX inside a test harness (openucx/ucx#5744)
    ("[swx-rdmz-ucx-new-02:21840:0:21840] Caught signal 6 (Aborted: tkill(2) or tgkill(2))",
     "swx-rdmz-ucx-new-02", None, None),
    # kubectl logs --prefix (geerlingguy/ansible-for-kubernetes#75)
    ('[pod/echo-req-7cfd7bf68f-nk5kr/hello] 172.17.0.1 - - [22/Nov/2020:17:19:05 +0000] "GET '
     '/test HTTP/1.1" 200 7269 "-" "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:83.0) '
     'Gecko/20100101 Firefox/83.0" "-"', "echo-req-7cfd7bf68f-nk5kr", None, None),
    # clush's own report and its host: prefix (clustershell/clustershell#425), pdsh's
    # (chaos/pdsh#109), an EC2 name behind pdsh (aws/aws-parallelcluster#2416)
    ("clush: c01: exited with exit code 255", "c01", None, None),
    ("c01: ssh: Could not resolve hostname c01: Name or service not known", "c01", None, None),
    ("pdsh@rocks7: compute-0-0: ssh exited with exit code 127", "compute-0-0", None, None),
    ("ip-10-0-248-39: /bin/ssh_target_checker.sh: line 27: syntax error near unexpected token "
     "`<'", "ip-10-0-248-39", None, None),
    # Ray: the worker's ip=, not a driver name after it (OpenRLHF/OpenRLHF#621); NCCL's
    # name inside it (ray-project/ray#59778)
    ("(RayWorkerWrapper pid=92234, ip=172.19.24.110) mlx5: host_unknown: got completion with "
     "error: [repeated 2x across cluster]", "172.19.24.110", None, None),
    ("(RayWorkerWrapper pid=581, ip=10.225.128.18) k8s17:581:581 [0] NCCL INFO P2P Chunksize "
     "set to 131072", "k8s17", None, None),
    # RFC 3339 syslog of a Slurm 14.11 step (Open MPI users list, April 2015: "--export=NONE"
    # and orted); old slurmd's slurmd[host]: prefix in a job's output (Open MPI users list,
    # February 2014, hostname redacted by the poster)
    ("2015-04-15T08:53:54+08:00 nod0138 slurmstepd[3122]: error: execve(): orted: No such file "
     "or directory", "nod0138", None, None),
    ("slurmd[xxxx108]: *** STEP 131823.4 KILLED AT 2014-02-12T13:30:32 WITH SIGNAL 9 ***",
     "xxxx108", None, None),
    # an EC2 head node's syslog (aws/aws-parallelcluster#2701)
    ("Apr 30 13:26:32 ip-10-0-33-4 pcluster_ssh_target_checker: Target Host github.com is not in "
     "any VPC CIDR 10.0.0.0/16", "ip-10-0-33-4", None, None),
    # journalctl -o json quoted by a shipper (pantheon-systems/journal-2-logstash README):
    # its _HOSTNAME is a Docker container's id, which names no node
    ('logger_1   | 2016/02/12 18:19:15 [DEBUG] Received from journal: { "__CURSOR" : '
     '"s=aae5e906525c4c00be5e9d5026bbf40a;i=35c;b=7f0ea6b7d19f47f9a9bc928f32512ae7;m=ddc296aab;'
     't=52b96b46b549a;x=e92c6b237a40211b", "__REALTIME_TIMESTAMP" : "1455301155574938", '
     '"__MONOTONIC_TIMESTAMP" : "59528276651", "_BOOT_ID" : "7f0ea6b7d19f47f9a9bc928f32512ae7", '
     '"PRIORITY" : "6", "_UID" : "0", "_GID" : "0", "_MACHINE_ID" : '
     '"9d52a846ee1a4be2b2d6e563162c6aa3", "_HOSTNAME" : "63c73cd1ec2e", "_TRANSPORT" : "stdout", '
     '"MESSAGE" : "hello there", "_PID" : "97", "_COMM" : "cat" } }', None, None,
     None),
    # an Elastic (ECS) record's host.name (elastic/apm-server#9846): a container's id
    # ("containerized":true), which names no node
    ('        {"log.level":"info","@timestamp":"2022-12-19T09:04:29.432Z","message":"Host info",'
     '"component":{"binary":"filebeat","dataset":"elastic_agent.filebeat","id":'
     '"filestream-monitoring","type":"filestream"},"log.logger":"beat","log.origin":'
     '{"file.line":1106,"file.name":"instance/beat.go"},"service.name":"filebeat","system_info":'
     '{"ecs.version":"1.6.0","host":{"architecture":"x86_64","boot_time":"2022-12-19T08:53:42Z",'
     '"containerized":true,"ip":["127.0.0.1/8","172.18.0.5/16"],"kernel_version":'
     '"5.4.0-1096-gcp","mac":["02:42:ac:12:00:05"],"name":"71d9b4dc0964","os":{"codename":'
     '"focal","family":"debian","major":20,"minor":4,"name":"Ubuntu","patch":5,"platform":'
     '"ubuntu","type":"linux","version":"20.04.5 LTS (Focal Fossa)"},"timezone":"UTC",'
     '"timezone_offset_sec":0}},"ecs.version":"1.6.0"}', None, None, None),
]

# benign prefixes that name no node (each a real line)
NO_NODE = [
    # OpenWrt logread -t: a facility, not a host (defanator/openwrt-loki-exporter#20)
    "Tue Apr 29 07:08:24 2025 [1745896104.164] kern.info kernel: [1523164.641079] ath10k_pci "
    "0000:00:00.0: mac flush vdev 0 drop 0 queues 0x1 ar->paused: 0x0  arvif->paused: 0x0",
    # dmesg with every --time-format at once (util-linux/util-linux#2648)
    "[17159596.699613] [Fri Dec 22 12:26:24 2023] [  +0.000000] 2023-12-22T12:26:24,559615-08:00 "
    "device vethab20cf5 entered promiscuous mode",
    # dmesg --raw (util-linux/util-linux#614)
    "<5>[    0.000000] Linux version 4.9.84-1 (builder@ymir-builder) (gcc version 7.3.0 20180125 "
    "(release) (PLD-Linux) ) #1 SMP Sun Feb 25 23:55:04 CET 2018",
    # dmesg --time-format iso: the process name is no host (equinor/ert#7797)
    "2024-04-29T14:55:41,678628+02:00 pool invoked oom-killer: gfp_mask=0x6200ca"
    "(GFP_HIGHUSER_MOVABLE), order=0, oom_score_adj=0",
    # a kernel tag without a host (leptonai/gpud#182)
    "[1105056.784211] kernel: nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid "
    "context, skipping further processing",
    # a device name after a kernel stamp (linux-nvme/nvme-cli#1593)
    "[ 2408.204381] nvme0: Identify(0x6), Invalid Field in Command (sct 0x0 / sc 0x2) MORE",
    # Ray without ip=, and NCCL on a host that calls itself localhost (ray-project/ray#7788,
    # ray-project/ray#40850)
    "(pid=81331) E0328 18:23:00.165781 81395 core_worker.cc:382] Raylet failed. Shutting down.",
    "(RayTrainWorker pid=83498) localhost:83498:84555 [0] NCCL INFO Pattern 1, crossNic 0, "
    "nChannels 2, bw 2.400000/1.200000, type SYS/SYS, sameChannels 1",
    # flux's seconds-since-start (tune:ho-fluxcore6289-flux-shell-oom-host)
    "29.475s: flux-shell[0]: ERROR: oom: Memory cgroup out of memory: killed 1 task on picl7.",
    # a log level, glog's severity+date (tune:ho-openremode9-cudagetdevicecount-insufficient-
    # driver-host, tune:ho-pytorch150916-elastic-agent-received-15-death-signal)
    "ERROR: cudaGetDeviceCount CUDA driver version is insufficient for CUDA runtime version",
    "W0409 07:28:49.530000 1359 torch/distributed/elastic/agent/server/api.py:719] Received 15 "
    "death signal, shutting down workers",
    # srun naming the Slurm function that failed, not a node (tune:r3-pcluster4179-srun-
    # rpc-timeouts-many-nodes)
    "srun: error: slurm_receive_msgs: [[ip-172-31-230-255.ec2.internal]:6818] failed: Socket "
    "timed out on send/recv operation",
    # PyTorch's rank prefix (tune:ho-keysvalues92-rank0-oom-with-other-process-list)
    '[rank0]:   File "/home/ubuntu/virtenvs/keysvals_cuda12.8/lib/python3.12/site-packages/'
    'litgpt/lora.py", line 355, in conv1d',
]


@pytest.mark.parametrize("line, host, rank, task", PREFIXES, ids=lambda v: str(v)[:30])
def test_line_prefixes_name_the_node(line, host, rank, task):
    origin = line_origin(line)
    assert (origin.host, origin.rank, origin.task) == (host, rank, task)


@pytest.mark.parametrize("line", NO_NODE, ids=lambda v: v[:30])
def test_benign_prefixes_name_no_node(line):
    assert line_origin(line).host is None


def test_a_hostname_that_spells_an_ip_gives_the_address():
    # EC2's ip-A-B-C-D (aws/aws-parallelcluster#2416) and a pod's A-B-C-D
    # (pytorch/pytorch#124380): the name stays, the address maps a peer to it
    ec2 = line_origin("ip-10-0-248-39: /bin/ssh_target_checker.sh: line 27: syntax error near "
                      "unexpected token `<'")
    assert (ec2.host, ec2.address) == ("ip-10-0-248-39", "10.0.248.39")
    layout = parse_layout(["10-12-3-162:7990:8056 [0] NCCL INFO NET/Socket : Using "
                           "[0]eno3:10.12.3.162<0>"])
    assert layout.addresses == {"10.12.3.162": "10-12-3-162"}


def test_a_loopback_peer_names_no_node():
    # NCCL's socket to itself (tune:ho-awsome192-socketstartconnect-loopback-ifname)
    found = SCANNER.scan_lines(["10: socketStartConnect: Connect to 127.0.0.1<45069> failed : "
                                "Software caused connection abort"])
    assert found and all(d.host is None for d in found)


def test_an_ip_prefix_is_kept_as_the_address_and_a_name_wins():
    assert line_origin(PREFIXES[13][0]).address == "202.197.0.170"
    # pdsh's name and NCCL's name agree; an IP is only an address
    assert line_origin(PREFIXES[12][0]).address is None


# -- a detection's host: the peer its rule names, else the printing node ------------

PEER_LINE = ("kp-ddp-worker-0:3468:3905 [4] ib_plugin.c:1615 NCCL WARN NET/IB : Got completion "
             "from peer 10.216.210.236<54862> with status=12 opcode=0 len=0 vendor err 129 "
             "(Recv) localGid fd00:1148:9000:5000:4:200:3:ff22 "
             "remoteGidsfd00:1148:9000:5000:4:200:3:ff1f")


def test_a_peer_named_in_the_message_is_the_host_not_the_printer():
    [found] = SCANNER.scan_lines([PEER_LINE])
    assert (found.rule, found.host, found.action_hint) == (
        "nccl.ib_completion_from_peer", "10.216.210.236", "requeue_exclude")


def test_a_local_fault_is_the_printing_node():
    [found] = SCANNER.scan_lines([PREFIXES[12][0]])   # a CUDA rule, whichever pack has it
    assert (found.category, found.host) == ("cuda_error", "rdma-test-gpu-worker-1")


def test_a_rule_with_a_peer_group_never_falls_back_to_the_printer():
    # NCCL printed the peer as an empty string (tune:ho-nccl1405-ib-error5-vendor249-occasional);
    # --node would otherwise name the printing node as the peer
    line = ("NET/IB : Got completion from peer with error 5, opcode 0, len 5384, vendor err 249 "
            "(Send)")
    [found] = SCANNER.scan_lines([line])
    assert (found.rule, found.host) == ("nccl.ib_completion_error", None)


def test_the_global_rank_comes_from_the_prefix():
    [found] = SCANNER.scan_lines([PREFIXES[18][0]])
    assert (found.rule, found.rank) == ("nccl.watchdog_timeout", 3)


# -- the layout a log states ---------------------------------------------------------

# HPE Cray MPICH's abort line names the rank and its node (Perlmutter, LUMI: public
# job logs quoted in repositories, find_string "MPICH ERROR [Rank"; tune:r3-e3sm8699)
CRAY_ABORT = ("MPICH ERROR [Rank 1534] [job id 114930.0] [Mon Feb 15 14:58:48 2021] [unknown] "
              "[nid001192] - Abort(672797967) (rank 1534 in comm 0): Fatal error in PMPI_Isend: "
              "Other MPI error, error stack:")
CRAY_LABELLED = ("2047: MPICH ERROR [Rank 2047] [job id 57638547.0] [Fri Aug 28 22:45:13 2026] "
                 "[nid004069] - Abort(1) (rank 2047 in comm 432): application called "
                 "MPI_Abort(comm=0xC4000001, 1) - process 2047")


def test_cray_mpich_abort_lines_name_the_rank_and_its_node():
    assert line_origin(CRAY_ABORT)[:2] == ("nid001192", 1534)
    assert line_origin(CRAY_LABELLED)[:3] == ("nid004069", 2047, 2047)
    # without the bracketed fields nothing is named (cray_common_memops, no host)
    assert line_origin("MPICH ERROR [Rank 0] - Abort(1): Internal error").host is None
    layout = parse_layout([CRAY_ABORT, CRAY_LABELLED])
    assert layout.rank_hosts == {1534: "nid001192", 2047: "nid004069"}
    assert layout.task_hosts == {2047: "nid004069"}


def test_srun_labels_carry_a_task_and_its_ranks_to_a_host():
    # tune:ho-nccl1176-avoid-record-streams-warning-benign (NVIDIA/nccl#1176)
    lines = ["2: [rank18]:[W ProcessGroupNCCL.cpp:2302] Warning: "
             "0TORCH_NCCL_AVOID_RECORD_STREAMS=1 has no effect for point-to-point collectives. "
             "(function operator())",
             "2: compute-st-p4de24xlarge-3:4871:7029 [2] NCCL INFO Channel 00/1 : 1[2] -> 0[2] "
             "[send] via NET/AWS Libfabric/1/GDRDMA/Shared"]
    layout = parse_layout(lines)
    assert layout.task_hosts == {2: "compute-st-p4de24xlarge-3"}
    assert layout.rank_hosts == {18: "compute-st-p4de24xlarge-3"}


def test_a_hostless_line_under_a_task_label_gets_the_task_host():
    # dev:pytorch135486-fatal-python-segfault-barrier
    lines = [PREFIXES[14][0], PREFIXES[15][0]]
    context = context_from_lines(lines)
    bare = Detection(rule="signal.segfault", category="segfault",
                     evidence=(Evidence(lines[1], "log", 2),))
    assert all_detections([bare], context)[0].host == "g1002"


def test_nccl_init_and_bootstrap_lines_map_ranks_and_addresses():
    lines = [
        # tune:ho-lightning20434-broadcast-seq1-timeout-after-init
        # (Lightning-AI/pytorch-lightning#20434)
        "babel-0-31:2324239:2324522 [3] NCCL INFO ncclCommInitRank comm 0x5584021f39f0 rank 3 "
        "nranks 4 cudaDev 3 nvmlDev 3 busId e1000 commId 0xb886029f29f1a815 - Init COMPLETE",
        # Lightning-AI/pytorch-lightning#14986
        "hpc-25-15:21476:21476 [2] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB "
        "em1:172.18.28.82<0>",
        # NVIDIA/nccl#1232 (behind an mpirun-style label)
        "[0] node0:13571:13571 [0] NCCL INFO Bootstrap : Using enp10s0:10.10.7.107<0>",
        # pytorch/pytorch#124380
        "10-12-3-162:7990:8056 [0] NCCL INFO NET/Socket : Using [0]eno3:10.12.3.162<0>",
    ]
    layout = parse_layout(lines)
    assert layout.rank_hosts == {3: "babel-0-31"}
    assert layout.addresses == {"172.18.28.82": "hpc-25-15", "10.10.7.107": "node0",
                                "10.12.3.162": "10-12-3-162"}


def test_slurm_node_list_and_tasks_per_node_give_ranks_in_block_order():
    # printenv in a Slurm step, quoted on the Open MPI users list
    lines = ["SLURM_NODELIST=borgo[086,140]", "SLURM_NTASKS_PER_NODE=4", "SLURM_NNODES=2",
             "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4(x2)"]
    layout = parse_layout(lines)
    assert layout.nodes == ("borgo086", "borgo140")
    assert [layout.rank_hosts[r] for r in range(8)] == ["borgo086"] * 4 + ["borgo140"] * 4


def test_one_task_per_node_says_nothing_about_ranks():
    # "srun env | egrep ^SLURM_" in a 2-node allocation, the same list (torchrun-style:
    # one launcher per node, whose ranks are not Slurm tasks)
    layout = parse_layout(["SLURM_NODELIST=node[1-2]", "SLURM_NNODES=2", "SLURM_JOBID=29",
                           "SLURM_TASKS_PER_NODE=1(x2)"])
    assert (layout.nodes, layout.rank_hosts) == (("node1", "node2"), {})


# -- addresses and names to nodes -------------------------------------------------------

def test_nodes_file_reads_name_address_lines_and_scontrol_records():
    # scontrol show node as posted in a public cluster runbook (multi-line record)
    text = "\n".join([
        "NodeName=worker-1 Arch=x86_64 CoresPerSocket=32 ",
        "   CPUAlloc=0 CPUEfctv=128 CPUTot=128 CPULoad=0.67",
        "   NodeAddr=10.5.170.103 NodeHostName=worker-1 Version=24.11.5",
        "   OS=Linux 5.15.0-164-generic #174-Ubuntu SMP Fri Nov 14 20:25:16 UTC 2025 ",
        "# name address...",
        "kp-ddp-worker-1 10.216.210.236 kp-ddp-worker-1.cluster.local",
    ])
    assert read_node_addresses(text) == {
        "worker-1": "worker-1", "10.5.170.103": "worker-1",
        "kp-ddp-worker-1": "kp-ddp-worker-1", "10.216.210.236": "kp-ddp-worker-1",
        "kp-ddp-worker-1.cluster.local": "kp-ddp-worker-1"}


def test_an_address_two_nodes_share_names_neither():
    # Slurm's own records: NodeAddr, NodeHostname
    found = node_addresses([("gpu01", "10.1.0.1", "gpu01.ib.example.org"),
                            ("gpu02", "10.1.0.2", "gpu02.ib.example.org"),
                            ("dev1", "127.0.0.1", "localhost"), ("dev2", "127.0.0.1", "localhost")])
    assert found["10.1.0.1"] == "gpu01" and found["gpu02.ib.example.org"] == "gpu02"
    assert found["gpu01"] == "gpu01" and found["dev2"] == "dev2"
    assert "127.0.0.1" not in found and "localhost" not in found
    # a file that gives one address twice says the same
    text = "dev1 127.0.0.1\ndev2 127.0.0.1\ngpu03 10.1.0.3"
    assert read_node_addresses(text) == {"dev1": "dev1", "dev2": "dev2", "gpu03": "gpu03",
                                         "10.1.0.3": "gpu03"}


def test_a_peer_address_in_the_job_is_excluded_by_name():
    [found] = SCANNER.scan_lines([PEER_LINE])
    context = AttributionContext(nodes=("kp-ddp-worker-0", "kp-ddp-worker-1"),
                                 addresses={"10.216.210.236": "kp-ddp-worker-1"})
    verdict = attribute([found], context)
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("kp-ddp-worker-1",))


def test_an_fqdn_is_the_job_node_of_its_short_name():
    # the peer as NCCL's getnameinfo printed it (tune:ho-nccl795-broken-pipe-after-remote-segfault)
    line = ("a100-st-p4d24xlarge-22:183006:183181 [1] misc/socket.cc:538 NCCL WARN Net : "
            "Connection closed by remote peer a100-st-p4d24xlarge-22.luciodelelis-92732890-0458-"
            "4f76-8369-c4fee80b23e7.pcluster<47861>")
    [found] = SCANNER.scan_lines([line])
    context = AttributionContext(nodes=("a100-st-p4d24xlarge-21", "a100-st-p4d24xlarge-22"))
    assert all_detections([found], context)[0].host == "a100-st-p4d24xlarge-22"


def test_with_host_fills_only_lines_no_prefix_placed():
    found = SCANNER.scan_lines([PREFIXES[5][0], PREFIXES[12][0]])
    assert [d.host for d in with_host(found, "gpu-q7")] == ["gpu-q7", "rdma-test-gpu-worker-1"]


# -- recovery-ctl patterns test --node / --nodes-file -----------------------------------

def test_patterns_test_node_names_a_hostless_kernel_log(tmp_path: Path):
    log = tmp_path / "kern.log"
    log.write_text(PREFIXES[5][0] + "\n")
    result = CliRunner().invoke(main, ["patterns", "test", "--engine", "re", "--json",
                                       "--node", "gpu-q7", str(log)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verdict"]["nodes"] == ["gpu-q7"]
    assert {d["host"] for d in report["detections"]} == {"gpu-q7"}


def test_patterns_test_nodes_file_turns_a_peer_address_into_a_node(tmp_path: Path):
    log = tmp_path / "job.err"
    log.write_text(PEER_LINE + "\n")
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("kp-ddp-worker-1 10.216.210.236\n")
    result = CliRunner().invoke(main, ["patterns", "test", "--engine", "re", "--json",
                                       "--nodes-file", str(nodes), str(log)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verdict"]["nodes"] == ["kp-ddp-worker-1"]
    assert report["detections"][0]["host"] == "kp-ddp-worker-1"

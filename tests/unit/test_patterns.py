"""Pattern packs: every shipped rule's examples, the loader's errors, site packs."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from recovery_agent.detect import model
from recovery_agent.detect.engines import hyperscan_probe, required_literals
from recovery_agent.detect.patterns import (QUIET_XIDS, REQUEUE_XIDS, STOP_XIDS, load_pack,
                                            load_rules, shipped_dir, xid_action)
from recovery_agent.detect.scanner import Scanner
from recovery_agent.errors import ConfigError
from slurm_hooks.kmsg import FATAL_XIDS

RULES = load_rules()
LINE_RULES = [r for r in RULES if r.scope == "line"]
SCANNER = Scanner(RULES, engine="re")
CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "xid_catalog.jsonl"


def _examples(kind: str):
    for rule in RULES:
        for line in getattr(rule, f"examples_{kind}"):
            yield pytest.param(rule, line, id=f"{rule.id}:{line[:40]}")


def test_shipped_packs_cover_every_category_and_area():
    assert {r.category for r in RULES} == set(model.CATEGORIES)
    files = {Path(r.source).stem for r in RULES}
    assert {"nccl", "cuda", "pytorch", "python", "kernel_gpu", "interconnect", "oom",
            "filesystem", "signals", "slurm"} <= files
    assert len({r.id for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule, line", _examples("match"))
def test_match_examples_fire_through_the_scanner(rule, line):
    assert rule.compiled.search(line)
    if rule.scope != "line":
        return
    hits = SCANNER.hits(line, range(len(SCANNER.line_rules)))
    ids = {r.id for r, _ in hits}
    # a more specific rule may claim the line; then it outranks this one
    assert rule.id in ids or max(r.priority for r, _ in hits) > rule.priority, ids


@pytest.mark.parametrize("rule, line", _examples("no_match"))
def test_no_match_examples_stay_quiet(rule, line):
    assert rule.compiled.search(line) is None


@pytest.mark.parametrize("rule", LINE_RULES, ids=lambda r: r.id)
def test_every_shipped_line_rule_is_documented_and_prefilterable(rule):
    assert rule.examples_match and rule.examples_no_match and rule.description
    assert required_literals(rule.regex) is not None, "no literal for the re prefilter"


@pytest.mark.skipif(hyperscan_probe() is not None, reason="hyperscan does not import")
@pytest.mark.parametrize("rule", LINE_RULES, ids=lambda r: r.id)
def test_every_line_rule_compiles_in_hyperscan(rule):
    import hyperscan
    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    db.compile(expressions=[rule.regex.encode()], ids=[0], elements=1,
               flags=[hyperscan.HS_FLAG_MULTILINE])


@pytest.mark.parametrize("line, category", [
    ("[rank0]:[E1 ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation "
     "timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600001 "
     "milliseconds before timing out.", "nccl_timeout_hang"),
    ("n1:1:2 [0] transport/net_ib.cc:1 NCCL WARN NET/IB : Got completion from peer "
     "10.0.0.2<4000> with status=12 opcode=0 len=0 vendor err 129", "interconnect"),
    ("RuntimeError: NCCL error: unhandled system error, NCCL version 2.19.3", "interconnect"),
    ("ncclRemoteError: remote process exited or there was a network error", "interconnect"),
    ("RuntimeError: CUDA error: misaligned address", "cuda_error"),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "application"),
    ("  exitcode  : -11 (pid: 9)", "segfault"),
    ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=python, An uncorrectable double bit "
     "error (DBE) has been detected on GPU", "gpu_hardware"),
    ("[1.2] mlx5_core 0000:5e:00.0 ibp94s0: Link down", "interconnect"),
    ("ibv_poll_cq: transport retry counter exceeded", "interconnect"),
    ("Memory cgroup out of memory: Killed process 12 (python)", "oom"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20 MiB", "oom"),
    ("OSError: [Errno 116] Stale file handle", "system_software"),
    ("LustreError: 11-0: fs-OST0001-osc: operation ost_read failed: rc = -107",
     "system_software"),
    ("OSError: [Errno 28] No space left on device", "system_software"),
    ("Segmentation fault (core dumped)", "segfault"),
    ("slurmstepd: error: *** JOB 1 ON n1 CANCELLED AT 2025-01-01T00:00:00 DUE TO TIME LIMIT ***",
     "system_software"),
    # the communication families, on real lines (the packs' comments say where from)
    ("[0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by remote peer "
     "10.10.1.3<36138>", "interconnect"),
    ("socketStartConnect: Connect to 10.45.234.83<47527> failed : Software caused connection "
     "abort", "interconnect"),
    ("...-48:34050:34121 [0] transport/net_ib.cc:93 NCCL WARN NET/IB : Got async event : port "
     "error", "interconnect"),
    ("gpu47:4962:5097 [1] transport/nvls.cc:223 NCCL WARN Cuda failure 999 'unknown error",
     "system_software"),
    ("[W514 18:33:36.536327028 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on "
     "SocketImpl(fd=3, addr=[localhost]:34658, remote=[localhost]:1234): Failed to recv, got 0 "
     "bytes. Connection was likely closed. Did the remote server shutdown or crash?",
     "system_software"),
    ("[E socket.cpp:793] [c10d] The client socket has timed out after 60s while trying to "
     "connect to (IP1, 2222).", "nccl_timeout_hang"),
    ("[1661938336.553723] [vhost-node1:1499693:6]           flush.c:26   UCX  ERROR req "
     "0x7fc2d40b3c00: error during flush: Endpoint timeout, flush comp 0x7fc2d40b3c90 count "
     "reduced to 2", "interconnect"),
])
def test_issue_families_are_covered(line, category):
    found = SCANNER.scan_lines([line])
    assert [d.category for d in found] == [category]


@pytest.mark.parametrize("line", [
    "node1:12:12 [0] NCCL INFO Channel 00/24 :    0   1   2   3   4   5   6   7",
    "node1:12:30 [0] net_fastsocket.cc:785 NCCL WARN Maximum retry reached for accept 3.",
    "[rank0]:[W101 00:00:00.0 ProcessGroupNCCL.cpp:1479] Warning: WARNING: "
    "destroy_process_group() was not called before program exit",
    "[INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step.",
    "slurmstepd: error: *** JOB 7 ON n2 CANCELLED AT 2025-01-01T00:00:00 DUE TO JOB REQUEUE ***",
    "/lib/python3.11/site-packages/torch/distributed/launch.py:208: FutureWarning: deprecated",
    "6,3973,227996636,-;nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid "
    "context, skipping further processing",
    # NCCL and c10d chatter that precedes a working run (pytorch/pytorch#68893,
    # Oneflow-Inc/oneflow#3586, NVIDIA/nccl#1618, meta-pytorch/torchtune#2676)
    "[0m ip-172-31-0-137:14605:14673 [0] misc/ibvwrap.cc:63 NCCL WARN Failed to open "
    "libibverbs.so[.1]",
    "worker:101542:101934 [0] NCCL INFO Call to connect returned Connection timed out, retrying",
    "[03/16][2025-02-25 15:46:48,389] [misc/socket.cc:602] [s11gn1268:pid=3987720] NCCL WARN "
    "socketPollConnect poll() failed, ret 1, error Connection timed out, revents 8, connect to "
    "172.16.30.229:39953",
    "[W503 01:52:07.597517393 socket.cpp:204] [c10d] The hostname of the client socket cannot "
    "be retrieved. err=-3",
])
def test_benign_noise_does_not_fire(line):
    # information-level rules (a requeue notice) may note a line; none fires
    assert [d.rule for d in SCANNER.scan_lines([line]) if d.severity != "info"] == []


# -- the loader ------------------------------------------------------------------

GOOD = """
[[rule]]
id = "site.disk_smart"
category = "system_software"
action = "requeue_exclude"
regex = '''smartd\\[\\d+\\]: Device: (?P<host>\\S+) .*FAILED SMART'''
examples.match = ["smartd[77]: Device: gpu-x1 /dev/nvme0 FAILED SMART self-check"]
examples.no_match = ["smartd[77]: Device: gpu-x1 /dev/nvme0 passed"]
"""


def _pack(tmp_path: Path, body: str, name: str = "site.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("change, message", [
    (("'''smartd", "'''(smartd"), "bad regex"),
    (('action = "requeue_exclude"', 'action = "requeue_exclude"\ncolour = "red"'), "colour"),
    (('category = "system_software"', 'category = "disk"'), "category 'disk'"),
    (('action = "requeue_exclude"', 'action = "reboot"'), "action 'reboot'"),
    (("FAILED SMART self-check", "failed smart self-check"), "example does not match"),
    (("/dev/nvme0 passed", "/dev/nvme0 FAILED SMART again"), "no_match example matches"),
    (("(?P<host>", "(?P<node>"), "unknown named group"),
    (("FAILED SMART'''", "FAILED(?= SMART)'''"), "not supported"),
    (('examples.match = [', 'examples.nope = [1]\nexamples.match = ['), "examples"),
])
def test_bad_rule_names_file_and_rule(tmp_path, change, message):
    path = _pack(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError) as err:
        load_pack(path)
    assert str(path) in str(err.value) and "'site.disk_smart'" in str(err.value)
    assert message in str(err.value)


def test_duplicate_ids_within_and_across_packs(tmp_path):
    with pytest.raises(ConfigError, match=r"site.toml: rule 'site.disk_smart': duplicate"):
        load_pack(_pack(tmp_path, GOOD + GOOD))
    other = tmp_path / "other"
    other.mkdir()
    _pack(tmp_path, GOOD)
    _pack(other, GOOD, "again.toml")
    with pytest.raises(ConfigError, match=r"again.toml: rule 'site.disk_smart': duplicate id"):
        load_rules([tmp_path, other], shipped=False)
    clash = GOOD.replace("site.disk_smart", "nccl.watchdog_timeout")
    with pytest.raises(ConfigError, match="duplicate id"):
        load_rules([_pack(other, clash, "again.toml").parent])


def test_unreadable_or_misshapen_pack(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_pack(_pack(tmp_path, "[[rule]\nid = 1"))
    with pytest.raises(ConfigError, match="unknown top-level"):
        load_pack(_pack(tmp_path, 'rules = ["x"]'))
    with pytest.raises(ConfigError, match="not found"):
        load_rules([tmp_path / "missing"], shipped=False)


def test_site_pack_dir_adds_rules_to_the_scanner(tmp_path):
    _pack(tmp_path, GOOD)
    rules = load_rules([tmp_path])
    assert rules[-1].id == "site.disk_smart" and len(rules) == len(RULES) + 1
    found = Scanner(rules).scan_lines(["smartd[9]: Device: gpu-x7 /dev/nvme1 FAILED SMART"])
    assert [(d.rule, d.host, d.action_hint) for d in found] == [
        ("site.disk_smart", "gpu-x7", "requeue_exclude")]


def test_shipped_dir_is_the_repository_packs():
    assert shipped_dir() == Path(__file__).resolve().parents[2] / "etc" / "patterns"


# -- XID actions ------------------------------------------------------------------

@pytest.mark.skipif(not CATALOG.exists(), reason="shared corpus not present")
def test_xid_buckets_follow_the_catalog():
    buckets: dict = {}
    for line in CATALOG.read_text().splitlines():
        row = json.loads(line)
        buckets.setdefault(row["job_recovery_action"], set()).add(row["xid"])
    assert buckets["requeue_exclude_node"] == set(FATAL_XIDS)
    assert buckets["requeue"] == set(REQUEUE_XIDS)
    assert buckets["stop"] == set(STOP_XIDS)
    assert buckets["none"] == set(QUIET_XIDS)


@pytest.mark.parametrize("xid, message, kind, action", [
    (79, "GPU has fallen off the bus.", "xid", "requeue_exclude"),
    (145, "RLW_RXPIPE Nonfatal XC0 i0 Link 13", "xid", "none"),
    (154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "xid",
     "requeue_exclude"),
    (154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "xid",
     "none"),
    (13, "Graphics SM Warp Exception", "xid", "stop"),
    (94, "Contained ECC error", "xid", "requeue"),
    (63, "Row Remapper", "xid", "none"),
    (20034, "Fatal, Link 48 LTSSM Fault Up", "sxid", "requeue_exclude"),
    (12028, "Non-fatal, Link 4", "sxid", "none"),
])
def test_xid_action(xid, message, kind, action):
    assert xid_action(xid, message, kind) == action


# -- emitter families: GPU, CUDA, kernel, Slurm, OOM, signals, filesystems --------
# Real lines only: each is quoted from the public report the rule's comment in
# etc/patterns/ names.

@pytest.mark.parametrize("line, rule, category, action", [
    # node-level software faults exclude the node, they do not stop the job
    ("[task 2025-07-01T05:06:30.005+00:00] [train] [nvidia-smi(stdout)] Failed to initialize "
     "NVML: Driver/library version mismatch", "kernel.driver_unavailable", "system_software",
     "requeue_exclude"),
    ("[ 8957.099615] NVRM: API mismatch: the client has the version 570.148.08, but",
     "kernel.driver_api_mismatch", "system_software", "requeue_exclude"),
    ("Unable to determine the device handle for GPU0000:03:00.0: Unknown Error",
     "kernel.gpu_lost", "gpu_hardware", "requeue_exclude"),
    ("[   23.991672] NVRM: GPU 0000:07:00.0: RmInitAdapter failed! (0x61:0x56:1770)",
     "kernel.gpu_init_failed", "system_software", "requeue_exclude"),
    ("[   24.302465] NVRM: GPU6 _kgspIsHeartbeatTimedOut: Heartbeat timed out, currentTimeMs "
     "812751949 heartbeat 1899482 heartbeatWithOffsetMs 812745879 diff 6070 timeout 5200",
     "kernel.gsp_timeout", "gpu_hardware", "requeue_exclude"),
    ("[<ffffffffc33d41c2>] uvm_spin_loop+0xb2/0xe0 [nvidia_uvm]", "kernel.nvidia_driver_stack",
     "system_software", "requeue_exclude"),
    ("Failed to initialize NVML: Unknown Error", "kernel.nvml_init_unknown", "system_software",
     "requeue"),
    # CUDA: may be the GPU / the node's driver stack / the program / OOM
    ("ERROR 02-21 06:30:25 core.py:291] RuntimeError: CUDA error: an illegal memory access was "
     "encountered", "cuda.illegal_address", "cuda_error", "requeue_exclude"),
    ("Failed to allocate device vector A (error code unknown error)!", "cuda.unknown_error_at_init",
     "cuda_error", "requeue_exclude"),
    ("Cuda failure 802 'system not yet initialized'", "cuda.system_not_ready",
     "system_software", "requeue_exclude"),
    ("RuntimeError: CUDA error: device-side assert triggered", "cuda.device_assert",
     "application", "stop"),
    ("[11/21/2021 13:15:17][nis-arch][0]:ERROR: CUDA error: no kernel image is available for "
     "execution on the device, line 590, file /home/nis/Downloads/cuda_memtest-dev/tests.cu",
     "cuda.no_kernel_image", "application", "stop"),
    ("RuntimeError: CUDA out of memory. Tried to allocate 60.00 MiB (GPU 0; 11.17 GiB total "
     "capacity; 505.96 MiB already allocated; 12.50 MiB free; 530.00 MiB reserved in total by "
     "PyTorch)", "oom.cuda_foreign_memory", "oom", "requeue_exclude"),
    # kernel messages by format
    ("[35881895.791331] Out of memory: Kill process 21518 (python2) score 752 or sacrifice child",
     "oom.kernel_killer", "oom", "stop"),
    ("Memory cgroup out of memory: Killed process 629 (onmt_train) total-vm:14119556kB, "
     "anon-rss:6538204kB, file-rss:80652kB, shmem-rss:16kB, UID:0 pgtables:13432kB "
     "oom_score_adj:0", "oom.kernel_killer", "oom", "stop"),
    ("[11189.970968] EDAC MC3: 1 UE memory read error on CPU_SrcID#1_MC#1_Chan#2_DIMM#0 "
     "(channel:2 slot:0 page:0xb757589 offset:0x140 grain:32 -  OVERFLOW err_code:0101:0092 "
     "socket:1 imc:1 rank:0 bg:3 ba:0 row:1a1e8 col:180)", "kernel.memory_uncorrectable",
     "system_software", "requeue_exclude"),
    ("mce: [Hardware Error]: CPU 7: Machine Check Exception: 5 Bank 0", "kernel.machine_check",
     "system_software", "requeue_exclude"),
    ("[  +0.000001] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: "
     "0000:00:03.0", "kernel.pcie_aer_fatal", "gpu_hardware", "requeue_exclude"),
    ("kernel:[ 5508.496754] watchdog: BUG: soft lockup - CPU#72 stuck for 23s! "
     "[cuda-EvtHandlr:4856]", "kernel.soft_lockup", "system_software", "requeue_exclude"),
    ("[  721.028170] INFO: task nvc:[driver]:5403 blocked for more than 120 seconds.",
     "kernel.hung_task", "system_software", "requeue"),
    # segfault traps naming the library: not the user's code
    ("[Thu Oct 10 03:06:53 2024] pt_main_thread[2536443]: segfault at 7f797fe00000 ip "
     "00007f7c7ac69996 sp 00007f7c12fd7c30 error 4 in libnccl.so.2[7f7c7ac00000+d3d3000]",
     "signal.kernel_segfault_comm_library", "segfault", "requeue"),
    ("[Sat Aug 23 11:05:44 2025] llama-server[383019]: segfault at 20e403fd8 ip "
     "00007fe8ef318637 sp 00007fe84ee2ff80 error 4 in libcuda.so.575.64.05[518637,"
     "7fe8eefc5000+e97000] likely on CPU 114 (core 50, socket 0)",
     "signal.kernel_segfault_driver_library", "segfault", "stop"),
    ("[152970.213392] llama-parallel[398992]: segfault at 8 ip 00007f8fb6e5bde0 sp "
     "00007ffd3eda32e8 error 4 in libllama.so[7f8fb6e2c000+103000] likely on CPU 10 (core 20, "
     "socket 0)", "signal.kernel_segfault", "segfault", "stop"),
    # filesystems: a full disk stops with its reason, a failed write is retried
    ("OSError: [Errno 122] Disk quota exceeded", "fs.quota", "system_software", "stop"),
    ("RuntimeError: write(): fd 29 failed with Input/output error", "fs.io_error",
     "system_software", "requeue"),
    ("Lustre: fs-abcd12345-OST0000-osc-XXXXX: This client was evicted by fs-abcd12345-OST0000; "
     "in progress operations using this service will fail.", "fs.lustre_evicted",
     "system_software", "requeue"),
    ("kernel: EXT4-fs error (device sda1): ext4_journal_check_start:83: comm kworker: Detected "
     "aborted journal", "fs.local_disk_error", "system_software", "requeue_exclude"),
])
def test_emitter_families_classify_real_lines(line, rule, category, action):
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.category, d.action_hint) for d in found] == [(rule, category, action)]


@pytest.mark.parametrize("line, rule, role", [
    ("srun: error: taurusi2031: tasks 10-11: Exited with exit code 1", "slurm.task_exit",
     "exit"),
    ("slurmstepd: error: *** STEP 440575.0 ON nid001277 CANCELLED AT 2023-12-05T07:16:01 ***",
     "slurm.cancelled", "exit"),
    ("slurmstepd: *** JOB 1479012 CANCELLED AT 2015-02-04T06:33:25 *** on sh-2-3",
     "slurm.cancelled", "exit"),
    ("terminate called after throwing an instance of 'c10::DistBackendError'", "signal.abort",
     "exit"),
    ("prterun noticed that process rank 7 with PID 0 on node gpu0304 exited on signal 6 "
     "(Aborted).", "signal.mpi_rank_signal", "exit"),
])
def test_task_exits_and_cancellations_are_exits_not_application_errors(line, rule, role):
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.role) for d in found] == [(rule, role)]
    assert found[0].action_hint in ("requeue", "none")


@pytest.mark.parametrize("line, host", [
    ("srun: error: Node failure on jean-zay-iam37", "jean-zay-iam37"),
    ("slurmstepd-irene2430: error: Munge decode failed: Unauthorized credential for client "
     "UID=37773 GID=31889 (49 retries left ...)", "irene2430"),
    ("srun: error: Task launch for StepId=10301666.2 failed on node gpu016: Socket timed out on "
     "send/recv operation", "gpu016"),
])
def test_slurm_lines_name_their_node(line, host):
    assert [d.host for d in SCANNER.scan_lines([line])] == [host]


def test_the_node_failure_line_does_not_blame_the_node_that_printed_it():
    # slurmstepd on jean-zay-iam17 reports that another node of the job failed
    line = ("slurmstepd: error: *** STEP 1943824.0 ON jean-zay-iam17 CANCELLED AT "
            "2023-03-06T03:17:51 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***")
    assert [(d.rule, d.host) for d in SCANNER.scan_lines([line])] == [("slurm.node_failure", None)]


def test_stack_frames_in_the_nvlink_code_are_the_fabric():
    line = ("192.168.11.119: kern: warning: [2026-04-22T21:27:51.289597368Z]:  "
            "knvlinkSyncLinkMasksAndVbiosInfo_IMPL+0xb7/0x1a0 [nvidia]")
    assert [(d.rule, d.category) for d in SCANNER.scan_lines([line])] == [
        ("kernel.nvidia_nvlink_stack", "gpu_hardware")]


# -- communication layer (issue 15): NCCL error classes, watchdog, IB statuses ----------

@pytest.mark.parametrize("line, rule, category, action", [
    # ncclInvalidArgument (v2.18+ string): NCCL refused the call, a retry repeats it
    ("WARNING:megatron.core.utils:InvalidArgument (4): invalid argument (run with "
     "NCCL_DEBUG=WARN for details)", "nccl.invalid_usage", "application", "stop"),
    # an old libnccl under headers that know ncclConfig_t fields: two NCCL installs
    ("Invalid config blocking attribute value -2147483648", "nccl.library_mismatch",
     "system_software", "stop"),
    ("Detected mixed local Net device counts across ranks (min 1, max 2). Set "
     "NCCL_IGNORE_NET_MISMATCH=1 to continue.", "nccl.net_config_mismatch", "interconnect",
     "stop"),
    ("train-run-env3-list2-parallel-0:15483:15645 [0] transport/net_ib.cc:665 NCCL WARN "
     "NET/IB : collective mismatch error local size 546816 remote 524288 addr 7ff7d1530000 "
     "rkey 2553d seq 14/1c", "nccl.ib_collective_mismatch", "interconnect", "stop"),
    ("torch.distributed.DistNetworkError: The client socket has failed to connect to any "
     "network address of (llama2-70b-n2-testys-master-0, 23456). The client socket has failed "
     "to connect to 172-16-100-89.llama2-70b-n2-testys-master-0.default.svc.cluster.local:23456 "
     "(errno: 113 - No route to host).", "pytorch.store_unreachable", "system_software",
     "requeue"),
])
def test_communication_errors_classify_by_error_class(line, rule, category, action):
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.category, d.action_hint) for d in found] == [(rule, category, action)]


def test_a_connect_to_loopback_is_configuration_and_names_no_node():
    line = ("10: Last error: 10: socketStartConnect: Connect to 127.0.0.1<45069> failed : "
            "Software caused connection abort")
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.action_hint, d.host) for d in found] == [
        ("nccl.socket_loopback_peer", "stop", None)]
    # the same failure to a real peer stays a transient symptom naming that peer
    other = SCANNER.scan_lines(["socketStartConnect: Connect to 10.45.234.83<47527> failed : "
                                "Software caused connection abort"])
    assert [(d.rule, d.role, d.action_hint, d.host) for d in other] == [
        ("nccl.socket_connect_failed", "symptom", "requeue", "10.45.234.83")]


def test_a_watchdog_timeout_under_ten_seconds_is_a_misconfigured_timeout():
    short = ("  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread "
             "terminated with exception: [Rank 3] Watchdog caught collective operation timeout: "
             "WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1) ran for "
             "90 milliseconds before timing out.")
    assert [(d.rule, d.action_hint) for d in SCANNER.scan_lines([short])] == [
        ("nccl.watchdog_timeout_too_short", "stop")]
    normal = ("[rank1]:[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog "
              "caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, "
              "NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 "
              "milliseconds before timing out.")
    assert [(d.rule, d.role, d.action_hint) for d in SCANNER.scan_lines([normal])] == [
        ("nccl.watchdog_timeout", "symptom", "requeue")]


def test_open_mpi_openib_retry_exceeded_names_the_peer():
    line = ("[[61410,1],65][btl_openib_component.c:3238:handle_wc] from bng1aviationdc22 to: "
            "bng1aviationdc26 error polling LP CQ with status RETRY EXCEEDED ERROR status number "
            "12 for wr_id 774739584 opcode 1  vendor error 129 qp_idx 0")
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.category, d.action_hint, d.host) for d in found] == [
        ("ib.openib_retry_exceeded", "interconnect", "requeue_exclude", "bng1aviationdc26")]
    # a peer Open MPI only knows by number is not a node name
    numbered = ("[[51298,1],2][btl_openib_component.c:3496:handle_wc] from ib7-bc2qq42-be01p02 "
                "to: 3 error polling LP CQ with status RETRY EXCEEDED ERROR status number 12 for "
                "wr_id 217ce00 opcode 0  vendor error 129 qp_idx 0")
    assert [d.host for d in SCANNER.scan_lines([numbered])] == [None]


@pytest.mark.parametrize("text, rule", [
    # the fixed texts of ProcessGroupNCCL.cpp as the source writes them (PyTorch 1.6-1.8
    # blocking wait and watchdog, 2.3-2.5 heartbeat monitor): no public log quoting them
    # was found, so the source text itself is the test
    ("] Caught collective operation timeout for work: ", "nccl.watchdog_timeout"),
    ("] Watchdog caught collective operation timeout for work: ", "nccl.watchdog_timeout"),
    ("NCCL Operation Timed Out", "nccl.watchdog_timeout"),
    ("First PG on this rank that detected no heartbeat of its watchdog.", "nccl.watchdog_stuck"),
])
def test_older_and_newer_watchdog_wordings_are_timeout_symptoms(text, rule):
    found = SCANNER.scan_lines([text])
    assert [(d.rule, d.category, d.role, d.action_hint) for d in found] == [
        (rule, "nccl_timeout_hang", "symptom", "requeue")]


def test_an_hca_nccl_skips_is_information_not_a_failure():
    # NCCL skips the device and goes on (zai-org/ImageReward#65: a pod shown only
    # some of the node's HCAs ran fine); the node it names is kept for later lines
    found = SCANNER.scan_lines(["NCCL WARN NET/IB : Unable to open device erdma_1"])
    assert [(d.rule, d.category, d.severity, d.action_hint) for d in found] == [
        ("nccl.ib_device_unusable", "interconnect", "info", "none")]
    assert {r.id: r.host_from_prefix for r in RULES}["nccl.ib_device_unusable"]


def test_nccl_internal_errors_are_the_network_layer():
    line = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/"
            "c10d/ProcessGroupNCCL.cpp:3144, internal error - please report this issue to the "
            "NCCL developers, NCCL version 2.21.5")
    assert [(d.rule, d.category, d.role) for d in SCANNER.scan_lines([line])] == [
        ("nccl.internal_error", "interconnect", "symptom")]


def test_a_closed_rendezvous_is_an_exit_of_this_node_not_an_application_error():
    # pytorch/pytorch#91943: the traceback ends in the bare RendezvousClosedError()
    lines = ["Traceback (most recent call last):",
             '  File "/usr/local/lib/python3.6/dist-packages/torch/distributed/elastic/rendezvous/'
             'dynamic_rendezvous.py", line 634, in run',
             "    raise RendezvousClosedError()",
             "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"]
    found = SCANNER.scan_lines(lines)
    assert [(d.rule, d.role, d.action_hint) for d in found] == [
        ("pytorch.rendezvous_closed", "exit", "requeue")]


def test_ucx_without_a_transport_to_the_peer_is_configuration():
    # openucx/ucx#10738: the wireup error, then the endpoint failure it causes
    lines = ["[1750835683.514002] [TENCENT64:1392 :0]          select.c:649  UCX  ERROR   no active "
             "messages transport to <no debug data>: rc_verbs/mlx5_bond_1:1 - Destination is "
             "unreachable, rc_mlx5/mlx5_bond_1:1 - Destination is unreachable",
             "[1750835683.514020] [TENCENT64:1392 :0]         libperf.c:1183 UCX  ERROR "
             "ucp_ep_create() failed: Destination is unreachable"]
    found = SCANNER.scan_lines(lines)
    assert [(d.rule, d.action_hint) for d in found] == [
        ("ib.ucx_no_transport", "stop"), ("ib.ucx_error", "requeue")]
    assert found[1].role == "symptom"

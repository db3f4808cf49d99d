"""The kernel's and the shared filesystems' messages outside the NVIDIA driver
(issue 15, the census of the Linux 6.1 block/NVMe/ext4/xfs/NFS/mlx5 sources,
lustre-release and the BeeGFS client in /tmp/team/i15/census-kernel.md): the
rules of filesystem.toml and kernel_node.toml for them, run end to end through
the shipped packs and attribution.

The decision each test pins: a fault of this node's own disk, NIC or Lustre
client excludes the node (and names it); a shared filesystem that stopped
answering is a retry on any node, never an exclusion.

Every log line is a real one, copied from the public log the rule's comment
cites (a thread, or a find_string id for a quoted kernel log).
"""
from __future__ import annotations

import pytest

from tests.unit.packs import rules_of, scanner, verdict_of  # noqa: F401 (scanner: a fixture)


# -- this node's own disk: exclude -------------------------------------------------

# find_string id 268098766: an xfs filesystem on dm-0 losing its disk (a stable
# patch's dmesg quote).
XFS_SHUTDOWN = [
    ' XFS (dm-0): metadata I/O error in "xfs_imap_to_bp+0x61/0xe0 [xfs]" at daddr 0x491520 len 32 error 5',
    " XFS (dm-0): log I/O error -5",
    " XFS (dm-0): Metadata I/O Error (0x1) detected at xfs_trans_read_buf_map+0x1ea/0x4b0 [xfs] (fs/xfs/xfs_trans_buf.c:311).  Shutting down filesystem.",
    " XFS (dm-0): Please unmount the filesystem and rectify the problem(s)",
]


def test_xfs_shutdown_excludes_the_node(scanner):
    # the post-5.17 shutdown format and "log I/O error %d" each fire alone
    assert rules_of(scanner, XFS_SHUTDOWN[1:2]) == {"fs.local_disk_error"}
    assert rules_of(scanner, XFS_SHUTDOWN[2:3]) == {"fs.local_disk_error"}
    verdict = verdict_of(scanner, XFS_SHUTDOWN)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


# find_string id 5723476810: an NVMe drive that stopped answering (mailing list).
NVME_GONE = [
    "> [  232.372876] nvme nvme0: I/O 8 QID 0 timeout, reset controller",
    "> [  323.643688] nvme nvme0: Device not ready; aborting reset",
    "> [  323.675893] print_req_error: I/O error, dev nvme0n1, sector 1088653384 flags 80700",
]


def test_nvme_controller_that_will_not_reset_excludes_the_node(scanner):
    for line in NVME_GONE:
        assert rules_of(scanner, [line]) == {"fs.local_disk_error"}, line
    verdict = verdict_of(scanner, NVME_GONE)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


@pytest.mark.parametrize("line", [
    # find_string id 27836439357 (md raid5 member), 56833645960 (scsi medium error)
    "[  368.433679] blk_update_request: critical medium error, dev sdc, sector 557528",
    "[ 2545.428393] critical medium error, dev sdd, sector 4 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
    # find_string id 935098778: an NVMe media/data-integrity status (sct 0x2)
    "[   93.496218] nvme2n1: I/O Cmd(0x1) @ LBA 62464, 1024 blocks, I/O Error (sct 0x2 / sc 0x82) MORE",
    # find_string id 16422157112: a SCSI disk gone offline under ext4
    "[59994.680331] sd 7:0:0:0: rejecting I/O to offline device",
    "[59994.680743] Aborting journal on device sdd-8.",
])
def test_block_layer_failures_of_a_local_disk(scanner, line):
    assert rules_of(scanner, [line]) == {"fs.local_disk_error"}


def test_an_nvme_abort_that_may_recover_is_not_a_disk_failure(scanner):
    # find_string id 28908166744: the first, recoverable step before any reset
    assert "fs.local_disk_error" not in rules_of(scanner, ["> [   83.556196] nvme nvme0: I/O 164 QID 2 timeout, aborting"])


# -- this node's NIC firmware: exclude, name the NIC -------------------------------

# openucx/ucx#7738: pdsh-prefixed dmesg of a node whose ConnectX firmware
# stopped completing CREATE_DCT commands.
MLX5_CMD_TIMEOUT = [
    "b1360: [14280.445220] mlx5_core 0000:61:00.0: wait_func_handle_exec_timeout:1104:(pid 141183): cmd[22]: CREATE_DCT(0x710) No done completion",
    "b1360: [14280.445226] mlx5_core 0000:61:00.0: wait_func:1132:(pid 141181): CREATE_DCT(0x710) timeout. Will cause a leak of a command resource",
]


def test_mlx5_firmware_command_timeout_excludes_the_node_and_names_the_nic(scanner):
    assert rules_of(scanner, MLX5_CMD_TIMEOUT) == {"node.mlx5_cmd_timeout"}
    verdict = verdict_of(scanner, MLX5_CMD_TIMEOUT)
    assert (verdict.category, verdict.action) == ("interconnect", "requeue_exclude")
    assert "0000:61:00" in set(verdict.where)


# -- this node's Lustre client crashed: exclude ------------------------------------

# find_string id 44559401863: an LBUG in the Lustre client's osc layer.
LUSTRE_LBUG = [
    "root@dfs-fuzzing:~# [  154.265547] LustreError: 298:0:(osc_request.c:1819:osc_brw_prep_request()) ASSERTION( page_count == 1 || (ergo(i == 0, poff + pg->count == PAGE_SIZE) && ergo(i > 0 && i < page_count - 1, poff == 0 && pg->count == PAGE_SIZE) && ergo(i == page_count - 1, poff == 0)) ) failed: i: 0/2 pg: 000000005a02f487 off: 0, count: 3595",
    "[  154.268801] LustreError: 298:0:(osc_request.c:1819:osc_brw_prep_request()) LBUG",
    "[  154.269714] Kernel panic - not syncing: LBUG",
    "[  154.275445]  osc_brw_prep_request+0x5214/0x6d20 [osc]",
]


def test_lustre_lbug_excludes_the_node(scanner):
    assert "fs.lustre_lbug" in rules_of(scanner, LUSTRE_LBUG[1:3])
    verdict = verdict_of(scanner, LUSTRE_LBUG)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


# -- the shared filesystem stopped answering: retry, on any node -------------------

# find_string id 7930749718: a Lustre client's dmesg while an OSS was down.
LUSTRE_OSS_DOWN = [
    "  [87885.624991] Lustre: DIAS-OST0001-osc-ffff9d6153c91000: Connection to DIAS-OST0001 (at 192.168.14.178@tcp) was lost; in progress operations using this service will wait for recovery to complete",
    "  [87904.056939] Lustre: 3389:0:(client.c:2295:ptlrpc_expire_one_request()) @@@ Request sent has timed out for slow reply: [sent 1696590759/real 1696590759]  req@0000000044314f25 x1778912219544448/t0(0) o400->DIAS-OST0002-osc-ffff9d6153c91000@192.168.14.178@tcp:28/4 lens 224/224 e 0 to 1 dl 1696590766 ref 1 fl Rpc:XNQr/0/ffffffff rc 0/-1 job:''",
]


def test_lustre_server_down_is_a_retry_not_an_exclusion(scanner):
    assert rules_of(scanner, LUSTRE_OSS_DOWN[1:]) == {"fs.lustre_rpc_timeout"}
    verdict = verdict_of(scanner, LUSTRE_OSS_DOWN)
    assert verdict.category == "system_software"
    assert verdict.action == "requeue"


# find_string id 57008369875: an NFSv4 client whose server went away.
NFS_SERVER_GONE = [
    "[ 1909.360631] nfs: server 192.168.1.5 not responding, timed out",
    "[ 2281.746570] NFS: state manager failed on NFSv4 server 192.168.1.5 with error 5",
]


def test_nfs_server_gone_is_a_retry_not_an_exclusion(scanner):
    assert rules_of(scanner, NFS_SERVER_GONE[1:]) == {"fs.nfs_state_recovery_failed"}
    verdict = verdict_of(scanner, NFS_SERVER_GONE)
    assert (verdict.category, verdict.action) == ("system_software", "requeue")


# find_string id 14725091473: sysrq-w of a task stuck in an NFSv4 stat().
NFS_STUCK_STACK = [
    "[26099350.815209] Call Trace:",
    "[26099350.815213]  [<ffffffff81619dd5>] schedule+0x35/0x80",
    "[26099350.815223]  [<ffffffffa03d1e0e>] rpc_wait_bit_killable+0x1e/0xa0 [sunrpc]",
    "[26099350.815242]  [<ffffffffa03d2e7e>] __rpc_execute+0x14e/0x450 [sunrpc]",
    "[26099350.815296]  [<ffffffffa06a3d7e>] nfs_getattr+0x7e/0x250 [nfs]",
]


def test_a_stack_waiting_on_nfs_is_context_that_excludes_nothing(scanner):
    assert rules_of(scanner, NFS_STUCK_STACK) == {"fs.shared_fs_stack"}
    verdict = verdict_of(scanner, NFS_STUCK_STACK)
    assert verdict.action != "requeue_exclude"


def test_beegfs_communication_error_as_python_reports_it_is_a_retry(scanner):
    # find_string id 55548603877: a DALI job reading from a BeeGFS mount
    line = "OSError: [Errno 70] Communication error on send: '/mnt/beegfs/test_dir/train'"
    assert "fs.comm_error" in rules_of(scanner, [line])
    verdict = verdict_of(scanner, [line])
    assert (verdict.category, verdict.action) == ("system_software", "requeue")


def test_a_nic_transmit_queue_timeout_excludes_the_node(scanner):
    # find_string id 3289997771: a ConnectX whose TX queue stalled
    line = "[ 6755.836716] NETDEV WATCHDOG: eth1 (mlx5_core): transmit queue 19 timed out"
    assert rules_of(scanner, [line]) == {"node.netdev_tx_timeout"}
    verdict = verdict_of(scanner, [line])
    assert (verdict.category, verdict.action) == ("interconnect", "requeue_exclude")


def test_xfs_internal_error_and_repair_notice_read_as_the_local_disk(scanner):
    # find_string id 268098766, after the shutdown above
    lines = [
        " XFS (dm-0): Internal error dqp->q_ino.reserved < dqp->q_ino.count at line 869 of file fs/xfs/xfs_trans_dquot.c.  Caller xfs_trans_dqresv+0x236/0x440 [xfs]",
        " XFS (dm-0): Corruption detected. Unmount and run xfs_repair",
    ]
    for line in lines:
        assert rules_of(scanner, [line]) == {"fs.local_disk_error"}, line

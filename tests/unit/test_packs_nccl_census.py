"""NCCL formats the census of NCCL's WARN()s added to nccl.toml (issue 15,
round 3b): the /dev/shm setup failures of every NCCL version, NVLink P2P
disabled on a node, no NET plugin initialised, NCCL 2.4-2.5's mismatched
collective check, the OFI plugin's libfabric set-up failures, read alone and
through attribution.

Every line is a real one, quoted in the public source the rule's comment in
etc/patterns/nccl.toml names (an issue thread or a public write-up quoting
the log, found with find_string); none is built from a format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")

# a public log of NVIDIA/nccl#290's failure (NCCL 2.7, include/shm.h)
SHM_FALLOCATE = "4e9a7654171e:8639:8745 [0] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device"
SHM_FALLOCATE_RET = "4e9a7654171e:8639:8745 [0] NCCL INFO include/shm.h:41 -> 2"
# a public deployment write-up (misc/shmutils.cc, 2.8+)
SHM_EXTEND = "3d3e22c3066f:168:168 [0] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-UbzKZ9 to 9637892 bytes"
# NCCL's troubleshooting guide
SHM_EXTEND_DOC = "NCCL WARN Error: failed to extend /dev/shm/nccl-03v824 to 4194660 bytes"
# public write-ups quoting graph/paths.cc
P2P_DISABLED = "NCCL WARN P2P is disabled between NVLINK connected GPUs 1 and 0."
P2P_INFO = "4e9a7654171e:8639:8745 [0] NCCL INFO Could not enable P2P between dev 0(=1a000) and dev 1(=3d000)"
# a public write-up quoting plugin/net.cc
NO_NET_PLUGIN = "NCCL WARN Failed to initialize any NET plugin"
# aws/aws-ofi-nccl#801 (the title: nccl_ofi_ofiutils/rdma set-up failures)
OFI_DOMAIN = "NCCL WARN NET/OFI Couldn't open a fabric access domain. RC: -38, ERROR: Function not implemented"
OFI_INFO = "algo-1:462:462 [0] NCCL INFO NET/OFI Selected Provider is efa"
# NVIDIA/nccl#214 and #296 (NCCL 2.4)
MISMATCH_214 = ("node-8x-v100-nvlink-1:39719:39719 [3] init.cu:1197 NCCL WARN Mismatched collective "
                "detected, please check your collective calls at and around rank 11. You can use "
                "NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=COLL to see the collective logs")
MISMATCH_296 = ("init.cc:1247 NCCL WARN Mismatched collective detected, please check your collective "
                "calls at and around rank 39. You can use NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=COLL "
                "to see the collective logs")


def _dets(lines):
    return SCANNER.scan_lines(lines)


@pytest.mark.parametrize("line, rule", [
    (SHM_FALLOCATE, "nccl.shm_failure"),
    (SHM_EXTEND, "nccl.shm_failure"),
    (SHM_EXTEND_DOC, "nccl.shm_failure"),
    (P2P_DISABLED, "nccl.p2p_disabled_nvlink"),
    (NO_NET_PLUGIN, "nccl.net_plugin_init_failed"),
    (MISMATCH_214, "nccl.collective_mismatch_detected"),
    (MISMATCH_296, "nccl.collective_mismatch_detected"),
    (OFI_DOMAIN, "nccl.ofi_error"),
])
def test_one_line_one_rule(line, rule):
    assert [d.rule for d in _dets([line])] == [rule]


@pytest.mark.parametrize("line", [SHM_FALLOCATE_RET, P2P_INFO, OFI_INFO])
def test_benign_neighbours_stay_quiet(line):
    assert _dets([line]) == []


def test_posix_fallocate_is_dev_shm_not_a_full_disk():
    # SYSCHECK's errno text would also read as a full disk (fs.no_space); shm.h
    # is its only caller, so the shm reading outranks it on this line
    (det,) = _dets([SHM_FALLOCATE])
    assert det.rule == "nccl.shm_failure"
    assert det.category == "system_software"
    assert det.action_hint == "stop"
    assert det.host is None   # the printer is a Docker container: its id names no node


def test_shm_failure_verdict_stops_and_names_no_container_as_a_node():
    lines = [SHM_FALLOCATE, SHM_FALLOCATE_RET]
    verdict = attribute(_dets(lines), context_from_lines(lines))
    assert verdict.category == "system_software"
    assert verdict.action == "stop"
    assert verdict.where == () and verdict.nodes == ()


def test_p2p_disabled_is_the_node_that_printed_it():
    (det,) = _dets([P2P_DISABLED])
    assert det.category == "gpu_hardware"
    assert det.action_hint == "requeue_exclude"
    assert det.role == "cause"
    rule = next(r for r in SCANNER.rules if r.id == "nccl.p2p_disabled_nvlink")
    assert rule.host_from_prefix
    verdict = attribute([det])
    assert verdict.category == "gpu_hardware"
    assert verdict.action == "requeue_exclude"


def test_no_net_plugin_is_a_launch_environment_error():
    verdict = attribute(_dets([NO_NET_PLUGIN]))
    assert verdict.category == "system_software"
    assert verdict.action == "stop"


def test_mismatched_collective_names_the_rank_not_a_node():
    (det,) = _dets([MISMATCH_214])
    assert det.rank == 11
    verdict = attribute([det])
    assert verdict.category == "application"
    assert verdict.action == "stop"
    assert verdict.nodes == ()

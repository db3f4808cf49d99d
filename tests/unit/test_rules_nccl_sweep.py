"""NCCL formats found by sweeping NCCL's WARN()s family by family against the
packs (issue 15, build item 1): the socket address checks (NCCL_SOCKET_IFNAME
naming no interface, a malformed NCCL_COMM_ID), topology detection that finds
no PCI path in sysfs or a topology XML missing an attribute, NCCL 2.3-2.4's
CUDA IPC open between ranks wrongly taken for one node, and NCCL 2.13-2.18's
libcuda.so probe, which is noise NCCL carries on after, and NVML not seeing
a GPU another rank of the same node uses (per-rank GPU isolation).

Every line is a real one, quoted in the public source named above it (the
rule's comment in etc/patterns/nccl.toml names it too); none is built from a
format string.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")


def dets(lines):
    return SCANNER.scan_lines(lines, source="t")


def verdict(lines):
    return attribute(dets(lines), context_from_lines(lines))


def fired(lines):
    return {d.rule for d in dets(lines) if d.severity != "info"}


# NVIDIA/nccl#1837 (NCCL 2.27.7, NCCL_SOCKET_IFNAME=eth2 on nodes without eth2;
# the reporter's launcher prefixes every line with the trainer's name)
IFNAME_INFO = "[trainer3]:twshared1016:1958:1958 [3] NCCL INFO NCCL_SOCKET_IFNAME set to eth2"
ADDR_INTERNAL = "[trainer0|0]:ncclInternalError: Internal check failed."
ADDR_LAST = "[trainer0|0]:Last error:"
ADDR_FAMILY = ("[trainer0|0]:ncclSocketInit: connecting to address  with family 59936 is neither "
               "AF_INET(2) nor AF_INET6(10)")

# NVIDIA/nccl#573 (WSL2: the GPU has no PCI device in sysfs)
REALPATH = ("SHJS-PF4ZKYLL:92777:92889 [0] graph/xml.cc:332 NCCL WARN Could not find real path of "
            "/sys/class/pci_bus/0000:01/../../0000:01:00.0")
REALPATH_TRACE = ["SHJS-PF4ZKYLL:92777:92889 [0] NCCL INFO graph/xml.cc:469 -> 2",
                  "SHJS-PF4ZKYLL:92777:92889 [0] NCCL INFO group.cc:73 -> 2 [Async thread]"]
# a public write-up quoting the NVLink peer form NCCL carries on after
# (an NVSwitch's unknown bus id): not a failure
REALPATH_NVSWITCH = "Could not find real path of /sys/class/pci_bus/fffffff/../../fffffff:ff:f"
# NVIDIA/nccl#379 (NCCL_TOPO_FILE without the CPU's arch)
TOPO_ATTR = "graph/xml.h:77 NCCL WARN Attribute arch of node cpu not found"
TOPO_ATTR_TRACE = ["NCCL INFO graph/topo.cc:380 -> 3", "NCCL INFO init.cc:840 -> 3",
                   "NCCL INFO group.cc:73 -> 3 [Async thread]"]
# NVIDIA/nccl#584: the same words at INFO level, for an optional attribute
TOPO_ATTR_INFO = "ubuntu:199574:201479 [1] NCCL INFO Attribute coll of node net not found"

# horovod/horovod docs/troubleshooting.rst (two servers sharing one hostname)
IPC_OPEN = "node1:22671:22795 [1] transport/p2p.cu:431 WARN failed to open CUDA IPC handle : 30 unknown error"
# horovod/horovod#610, the same run's plugin probe
IBVERBS_PROBE = "localhost:27896:27933 [1] misc/ibvwrap.cu:61 WARN Failed to open libibverbs.so[.1]"

# NVIDIA/nccl#1066 (2.12, each rank sees only its own GPU) and #1529 (two
# containers on one node, the WARN then graph/xml.cc's -> 2)
NVML_NOT_FOUND = ("gcn6:1080061:1080359 [0] misc/nvmlwrap.cc:181 NCCL WARN "
                  "nvmlDeviceGetHandleByPciBusId() failed: Not Found")
NVML_NOT_FOUND_1529 = ("ucpe-resource033018034100:6896:7103 [1] misc/nvmlwrap.cc:187 NCCL WARN "
                       "nvmlDeviceGetHandleByPciBusId() failed: Not Found")
NVML_TRACE_1529 = "ucpe-resource033018034100:6896:7103 [1] NCCL INFO graph/xml.cc:850 -> 2"
# flexflow/flexflow-serve#71: NCCL skipping NVLink detection and going on
NVML_SKIP = "nid002080:86174:87702 [2] graph/xml.cc:634 NCCL WARN No NVML device handle. Skipping nvlink detection."
NVML_SKIP_TRACE = "nid002080:86174:87702 [2] NCCL INFO misc/nvmlwrap.cc:181 -> 2"

# vllm-project/vllm#4411 (NCCL 2.18.1 on WSL2: the probe, then the real failure)
CUDA_PROBE = ("00127-desktop:212030:212030 [0] misc/cudawrap.cc:179 NCCL WARN Failed to find CUDA "
              "library libcuda.so (NCCL_CUDA_PATH='') : libcuda.so: cannot open shared object file: "
              "No such file or directory")
CUDA_PROBE_VERSION = "NCCL version 2.18.1+cuda12.0"
CUDA_FAILURE = "00127-desktop:212030:212030 [0] transport.cc:154 NCCL WARN Cuda failure 'invalid argument'"
# hiyouga/LlamaFactory#1169 (2.18.5) and zai-org/VisualGLM-6B#270 (2.13-2.17 wording)
CUDA_PROBE_LF = ("DESKTOP-VMBL43V:4163:4163 [0] misc/cudawrap.cc:179 NCCL WARN Failed to find CUDA "
                 "library libcuda.so (NCCL_CUDA_PATH='') : libcuda.so: cannot open shared object file: "
                 "No such file or directory")
CUDA_PROBE_OLD = "misc/cudawrap.cc:90 NCCL WARN Failed to find CUDA library in NULL (NCCL_CUDA_PATH=NULL )"


@pytest.mark.parametrize("line, rule, category, action", [
    (ADDR_FAMILY, "nccl.socket_address_invalid", "interconnect", "stop"),
    (REALPATH, "nccl.topology_detection_failed", "system_software", "stop"),
    (TOPO_ATTR, "nccl.topology_detection_failed", "system_software", "stop"),
    (IPC_OPEN, "nccl.p2p_ipc_open_failed", "system_software", "stop"),
    (NVML_NOT_FOUND, "nccl.nvml_peer_gpu_not_visible", "system_software", "stop"),
    (NVML_NOT_FOUND_1529, "nccl.nvml_peer_gpu_not_visible", "system_software", "stop"),
])
def test_each_new_rule_reads_its_real_line(line, rule, category, action):
    (det,) = dets([line])
    assert (det.rule, det.category, det.action_hint) == (rule, category, action)
    assert det.severity != "info"


@pytest.mark.parametrize("line", [IFNAME_INFO, REALPATH_NVSWITCH, TOPO_ATTR_INFO, IBVERBS_PROBE,
                                  *REALPATH_TRACE, NVML_SKIP, NVML_SKIP_TRACE, NVML_TRACE_1529])
def test_benign_neighbours_fire_nothing(line):
    assert fired([line]) == set()


def test_a_missing_interface_stops_rather_than_retrying_the_internal_error():
    # ncclInternalError alone is a requeue; the address check under "Last
    # error:" says which setting it was, and every retry repeats it
    lines = [ADDR_INTERNAL, ADDR_LAST, ADDR_FAMILY]
    assert fired(lines) == {"nccl.internal_error", "nccl.socket_address_invalid"}
    v = verdict(lines)
    assert (v.category, v.action) == ("interconnect", "stop")
    assert v.nodes == ()


@pytest.mark.parametrize("lines", [[REALPATH, *REALPATH_TRACE], [TOPO_ATTR, *TOPO_ATTR_TRACE]])
def test_topology_that_cannot_be_built_stops(lines):
    v = verdict(lines)
    assert (v.category, v.action) == ("system_software", "stop")


def test_an_nvswitch_peer_path_is_not_a_topology_failure():
    assert verdict([REALPATH_NVSWITCH]).action == "none"


def test_an_ipc_handle_from_a_wrongly_local_rank_stops_and_blames_no_gpu():
    v = verdict([IPC_OPEN])
    assert (v.category, v.action) == ("system_software", "stop")
    assert v.gpus == ()


@pytest.mark.parametrize("line", [CUDA_PROBE, CUDA_PROBE_LF, CUDA_PROBE_OLD])
def test_the_libcuda_probe_is_info_and_outranks_the_missing_driver_reading(line):
    (det,) = dets([line])
    assert det.rule == "nccl.cuda_library_probe"
    assert (det.severity, det.action_hint) == ("info", "none")
    # before this rule, the dlerror text read as a node without its driver
    assert "python.missing_library" not in fired([line])


def test_the_libcuda_probe_alone_excludes_no_node():
    v = verdict([CUDA_PROBE, CUDA_PROBE_VERSION])
    assert v.action == "none"
    assert v.nodes == ()


def test_after_the_probe_the_real_failure_decides():
    v = verdict([CUDA_PROBE, CUDA_PROBE_VERSION, CUDA_FAILURE])
    assert fired([CUDA_PROBE, CUDA_PROBE_VERSION, CUDA_FAILURE]) == {"nccl.cuda_failure"}
    assert v.category == "cuda_error"
    assert v.action != "requeue_exclude"


def test_a_gpu_hidden_from_the_other_local_rank_stops_and_excludes_no_node():
    # the printer's node is healthy: the launch layout hides the GPUs from
    # each other, so excluding the node would only move the failure
    v = verdict([NVML_NOT_FOUND_1529, NVML_TRACE_1529])
    assert (v.category, v.action) == ("system_software", "stop")
    assert v.nodes == () and v.gpus == ()

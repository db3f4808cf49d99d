"""The NVIDIA driver's own messages outside the Xid lines (issue 15, the census
of NVIDIA/open-gpu-kernel-modules, nvidia-persistenced and nv-fabricmanager in
/tmp/team/i15/census-nvrm.md): the rules of kernel_gpu.toml for them, run end
to end through the shipped packs and attribution.

Every log line is a real one, copied from the public log the rule's comment in
kernel_gpu.toml cites (a thread, or a find_string id for a quoted kernel log).
"""
from __future__ import annotations

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.patterns import load_rules
from tests.unit.packs import rules_of, scanner  # noqa: F401 (scanner: a fixture)


def assert_node_excluded(dets, category: str, pci: str) -> None:
    """The verdict on these detections excludes the node, for ``category``,
    and says which GPU (``pci``) it happened on."""
    verdict = attribute(dets)
    assert (verdict.category, verdict.action) == (category, "requeue_exclude")
    assert pci in set(verdict.where)


# find_string id 54384820923: a GPU whose BAR0 the driver could not map.
RMINIT_STEPS = [
    "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  595.58.03",
    "NVRM: osInitNvMapping: *** Cannot attach gpu",
    "NVRM: RmInitAdapter: osInitNvMapping failed, bailing out of RmInitAdapter",
    "NVRM: GPU 0000:62:00.0: RmInitAdapter failed! (0x22:0x56:894)",
    "NVRM: GPU 0000:62:00.0: rm_init_adapter failed, device minor number 0",
    "No devices were found",
]


def test_rminitadapter_steps_exclude_the_node_and_name_the_gpu(scanner):
    dets = scanner.scan_lines(RMINIT_STEPS)
    assert {d.rule for d in dets} >= {"kernel.gpu_init_failed", "kernel.no_gpus_found"}
    assert {d.rule for d in scanner.scan_lines(RMINIT_STEPS[1:3])} == {"kernel.gpu_init_failed"}
    assert_node_excluded(dets, "system_software", "0000:62:00")


# find_string id 71336769081
POWER_CABLES = [
    "NVRM: GPU 0000:01:00.0: GPU does not have the necessary power cables connected.",
    "NVRM: GPU 0000:01:00.0: RmInitAdapter failed! (0x24:0x1c:1603)",
    "NVRM: GPU 0000:01:00.0: rm_init_adapter failed, device minor number 0",
]


def test_missing_power_cables_are_the_gpus_hardware(scanner):
    dets = scanner.scan_lines(POWER_CABLES)
    assert "kernel.gpu_power_cables" in {d.rule for d in dets}
    assert_node_excluded(dets, "gpu_hardware", "0000:01:00")


# find_string id 17011055941 (two physical lines of one kernel message)
BAR_INVALID = [
    "[   37.010658] NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:",
    "               NVRM: BAR1 is 0M @ 0x0 (PCI:0000:56:00.0)",
]


def test_invalid_bar_excludes_the_node(scanner):
    dets = scanner.scan_lines(BAR_INVALID)
    assert {d.rule for d in dets} == {"kernel.gpu_bar_invalid"}
    assert_node_excluded(dets, "system_software", "0000:56:00")


# find_string id 68289717761
UNSUPPORTED = [
    "NVRM: The NVIDIA GPU 0000:00:04.0 (PCI ID: 10de:1db1)",
    "NVRM: installed in this system is not supported by open",
    "NVRM: nvidia.ko because it does not include the required GPU",
    "NVRM: System Processor (GSP).",
    "NVRM: The NVIDIA probe routine failed for 1 device(s).",
]


def test_gpu_the_open_module_cannot_drive_excludes_the_node(scanner):
    dets = scanner.scan_lines(UNSUPPORTED)
    assert {"kernel.gpu_unsupported_by_driver", "kernel.gpu_probe_failed"} <= {d.rule for d in dets}
    assert_node_excluded(dets, "system_software", "0000:00:04")


# find_string id 24264139719
def test_no_gpu_initialised(scanner):
    lines = [
        "[  +0.000074] NVRM: The NVIDIA probe routine failed for 1 device(s).",
        "[  +0.000005] NVRM: None of the NVIDIA devices were initialized.",
        "[  +0.000539] nvidia-nvlink: Unregistered Nvlink Core, major device number 237",
    ]
    assert rules_of(scanner, lines[1:2]) == {"kernel.no_gpu_initialized"}
    assert attribute(scanner.scan_lines(lines)).action == "requeue_exclude"


def test_a_scripts_own_no_gpu_message_is_not_the_driver(scanner):
    # find_string id 12022764734: a setup script's echo
    assert rules_of(scanner, ["No NVIDIA GPU found."]) == set()


# find_string id 62404185180: the watchdog, then the Xid 8 it leads to.
def test_rc_watchdog_is_a_hang_to_retry_not_a_node_to_exclude(scanner):
    lines = [
        "  NVRM: krcWatchdog_IMPL: RC watchdog: GPU is probably locked!  Notify Timeout Seconds: 7",
        "  NVRM: GPU at PCI:0000:02:00: GPU-7d40ba2b-2f9a-107e-e8d9-a671b8da8089",
        "  NVRM: Xid (PCI:0000:02:00): 8, pid=3280448, name=python, channel 0x00000013",
    ]
    assert rules_of(scanner, lines[:1]) == {"kernel.rc_watchdog_locked"}
    verdict = attribute(scanner.scan_lines(lines))
    assert verdict.category == "gpu_hardware"
    assert verdict.action == "requeue"


def test_fabric_manager_driver_mismatch_excludes_the_node(scanner):
    # find_string id 17651387542
    lines = [
        "Nov 05 13:55:26 node1 systemd[1]: Starting NVIDIA fabric manager service...",
        "Nov 05 13:55:26 node1 nv-fabricmanager[104230]: fabric manager NVIDIA GPU driver interface version 550.127.05 don't match with driver version 550.120. Please update with matching NVIDIA driver package.",
    ]
    dets = scanner.scan_lines(lines)
    assert {d.rule for d in dets} == {"kernel.fabricmanager_driver_mismatch"}
    assert attribute(dets).action == "requeue_exclude"


def test_fabric_manager_without_nvswitch_is_context_only(scanner):
    # NVIDIA/gpu-operator#610
    line = ("11月 15 14:15:47 leon-NF5468M6 nv-fabricmanager[4177]: request to query NVSwitch "
            "device information from NVSwitch driver failed with error:WARNING Nothing to do "
            "[NV_WARN_NOTHING_TO_DO]")
    dets = scanner.scan_lines([line])
    assert {d.rule for d in dets} == {"kernel.fabricmanager_no_nvswitch"}
    assert attribute(dets).action == "none"


def test_persistence_daemon_without_devices(scanner):
    # find_string id 68409741095
    lines = [
        "Sep 11 04:47:05 hami-workshop nvidia-persistenced[887]: Started (887)",
        "Sep 11 04:47:05 hami-workshop nvidia-persistenced[887]: Failed to query NVIDIA devices. Please ensure that the NVIDIA device files (/dev/nvidia*) exist, and that user 991 has read and write permissions for those files.",
        "Sep 11 04:47:05 hami-workshop nvidia-persistenced[887]: Shutdown (887)",
    ]
    assert rules_of(scanner, lines) == {"kernel.persistenced_no_devices"}


def test_new_rules_are_system_evidence(scanner):
    ids = {"kernel.gpu_power_cables", "kernel.gpu_bar_invalid", "kernel.gpu_unsupported_by_driver",
           "kernel.no_gpu_initialized", "kernel.rc_watchdog_locked",
           "kernel.fabricmanager_driver_mismatch", "kernel.fabricmanager_no_nvswitch",
           "kernel.persistenced_no_devices"}
    rules = {r.id: r for r in load_rules() if r.id in ids}
    assert set(rules) == ids
    assert all(r.emitter == "system" for r in rules.values())


def test_gsp_rpc_sanity_failure_is_a_gsp_timeout(scanner):
    # find_string id 53150767369
    assert rules_of(scanner, ["NVRM: _kgspLogRpcSanityCheckFailure: GPU0 sanity check failed 0xf"]) == {"kernel.gsp_timeout"}

"""GPU hardware faults read by message format: the Xid codes that ask for a GPU
reset in their text, DCGM's health messages, the fabric manager's NVSwitch
errors, and the node named by the prefix of the line that carries a GPU's bus id.

Every log line here is a real line from a public log or source file (the comment
above the rule in etc/patterns/kernel_gpu.toml names where), or, for the "monitor"
messages that must not fire, the emitter's own format string. Each test checks what
the line means for the job through the scanner and attribution.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import XID_ACTIONS, XID_BUCKETS, load_rules, xid_action
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")
CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "xid_catalog.jsonl"


def _verdict(lines):
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines))


def _rules(lines):
    return [d.rule for d in SCANNER.scan_lines(lines)]


# -- Xid 63: a row or page marked for retirement, waiting for a reset -------------

REMAP_ON_HOST = ("Xid errors on instance: ip-26-0-146-100, Error: May 19 07:08:57 "
                 "ip-26-0-146-100 kernel: [680111.646286] NVRM: Xid (PCI:0000:10:1c): 63, "
                 "pid=1850, Row Remapper: New row marked for remapping, reset gpu to activate")
REMAP_BARE = ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for "
              "remapping, reset gpu to activate.")


def test_a_row_remap_waiting_for_a_reset_excludes_the_node_and_names_it():
    verdict = _verdict([REMAP_ON_HOST])
    assert _rules([REMAP_ON_HOST]) == ["kernel.xid_row_remap_pending"]
    assert (verdict.category, verdict.action) == ("gpu_hardware", "requeue_exclude")
    assert verdict.nodes == ("ip-26-0-146-100",)
    assert "0000:10:1c" in verdict.gpus


def test_the_row_remap_rule_replaces_the_catalog_reading_on_its_line_only():
    # the bucket table still reads a bare Xid 63 as NVIDIA's IGNORE
    assert XID_BUCKETS[63] == "IGNORE" and XID_ACTIONS[63] == "none" == xid_action(63)
    verdict = _verdict([REMAP_BARE])
    assert (verdict.category, verdict.action) == ("gpu_hardware", "requeue_exclude")
    assert verdict.gpus == ("0000:10:1c",)


# -- DCGM's health and diagnostic messages ----------------------------------------

@pytest.mark.parametrize("line", [
    '                        "error_message": "Detected 333 volatile double-bit ECC error(s) '
    'in GPU 0.",',
    'Reason: "Detected 1 volatile double-bit ECC error(s) in GPU 7. Drain the GPU and reset it '
    'or reboot the node",',
    'Message: "GPU 123456 had uncorrectable memory errors and row remapping failed. Run a field '
    'diagnostic on the GPU",',
])
def test_dcgms_isolate_and_reset_messages_are_gpu_faults(line):
    verdict = _verdict([line])
    assert _rules([line]) == ["kernel.dcgm_gpu_fault"]
    assert (verdict.category, verdict.action) == ("gpu_hardware", "requeue_exclude")


@pytest.mark.parametrize("line", [
    # dcgm_errors.h format strings of "monitor" messages: the GPU can still work
    "More than %u single-bit ECC error(s) detected in GPU %u Volatile SBEs: %lld",
    "Detected clock throttling due to thermal violation in GPU %u.",
    "Detected more than %u PCIe replays per minute for GPU %u : %d",
])
def test_dcgms_monitor_messages_do_not_fire(line):
    assert _rules([line]) == []


def test_dcgm_3s_row_remap_message_wrapped_in_dcgmis_table_is_a_gpu_fault():
    # dcgmi diag's table wraps the message over its cell's lines (DCGM 3.x
    # wording, stas00/ml-engineering debug.md): the first line carries its start
    table = ["| Error                     | GPU 3 has uncorrectable memory errors and row  |",
             "|                           |  remappings are pending                        |"]
    verdict = _verdict(table)
    assert _rules(table) == ["kernel.dcgm_gpu_fault"]
    assert (verdict.category, verdict.action) == ("gpu_hardware", "requeue_exclude")


# NVIDIA/NVSentinel#1357: a DCGM memory diagnostic's health event, as the node agent logs it
DCGM_XID = ('{"time":"2026-06-02T19:47:38.025768133Z","level":"INFO","msg":"Health events '
            'received","module":"platform-connectors","version":"v1.8.0","events":{"version":1,'
            '"events":[{"version":1,"agent":"preflight-dcgm-diag","componentClass":"GPU",'
            '"checkName":"DcgmDiagnosticMemory","isFatal":true,"message":"Detected XID 145 for '
            'GPU 0 Please consult the documentation for details of this XID.","errorCode":'
            '["DCGM_FR_XID_ERROR"],"entitiesImpacted":[{"entityType":"GPU_UUID","entityValue":'
            '"GPU-95d4eaef-812a-5157-fec0-7d64667313dc"}],"generatedTimestamp":{"seconds":'
            '1780429658,"nanos":24072000},"nodeName":"ip-....internal","processingStrategy":1}]}} ')


def test_dcgms_xid_report_is_read_by_the_xid_catalog_not_by_dcgms_fatal_flag():
    (found,) = SCANNER.scan_lines([DCGM_XID])
    assert (found.rule, found.xid, found.gpu) == ("kernel.xid_dcgm", 145, "0")
    verdict = _verdict([DCGM_XID])
    # 145 (NVLink RLW error): the catalog's bucket excludes the node
    assert (verdict.category, verdict.action) == ("gpu_hardware", xid_action(145))
    # the same report for a code whose catalog cause is the program (31, a GPU
    # memory page fault) stops, whatever the agent called it (a health
    # monitor's condition message in NVIDIA/NVSentinel's tests); as for the
    # other daemons' re-prints, the category stays the rule's
    program = ("ErrorCode:DCGM_FR_XID_ERROR GPU:4 PCI:0000:c4:00.0 Detected XID 31 for GPU 4 "
               ".Recommended Action=NONE;")
    assert xid_action(31) == "stop"
    assert _verdict([program]).action == "stop"


def test_dcgms_nvlink_down_alone_is_information():
    # DCGM's "triage" finding, shown on every link of PCIe A100s without NVLink
    # (NVIDIA/DCGM#49): read, and neither a failure nor a node's proof by itself
    line = "| Warning                   | GPU 0GPU 0's NvLink link 0 is currently down   |"
    assert _rules([line]) == ["kernel.dcgm_nvlink_down"]
    verdict = _verdict([line])
    assert verdict.action == "none" and verdict.nodes == ()


# -- the fabric manager's NVSwitch errors -------------------------------------------

def test_a_fatal_nvswitch_error_in_the_fabric_managers_log_excludes_the_node():
    line = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on "
            "fid 0 on NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 33")
    verdict = _verdict([line])
    assert (verdict.category, verdict.action) == ("gpu_hardware", "requeue_exclude")
    assert verdict.gpus == ()     # the bus id is the switch's: no GPU is named


@pytest.mark.parametrize("line", [
    "Detected 0 volatile double-bit ECC error(s) in GPU 7.",
    "Found 0 faulty memory elements on GPU 2.",
])
def test_dcgm_counts_of_zero_are_no_fault(line):
    assert _rules([line]) == []


def test_a_non_fatal_nvswitch_error_is_no_failure():
    line = ("[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 "
            "on fid 0 on NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 61")
    assert _rules([line]) == []


# -- grouped codes and the catalog's buckets ------------------------------------------

def test_every_catalog_code_has_a_decision():
    rows = [json.loads(x) for x in CATALOG.read_text().splitlines() if x.strip()]
    assert {r["xid"] for r in rows} == set(XID_ACTIONS) == set(range(1, 173))
    assert all(xid_action(code) in ("requeue_exclude", "requeue", "stop", "none")
               for code in XID_ACTIONS)


@pytest.mark.parametrize("lines, action", [
    # Xid 45 is read as the NVLink5 Xid it names
    (["kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused "
      "by previous Xid 149"], "requeue_exclude"),
    # Xid 154 asks for what its new recovery action says
    (["[171167.621162] NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed from 0x0 "
      "(None) to 0x4 (Drain and Reset)"], "requeue_exclude"),
    # an NVLink5 code whose text says Nonfatal is no failure on its own
    (["NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 "
      "0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"], "none"),
])
def test_grouped_codes_are_read_together(lines, action):
    assert _verdict(lines).action == action


# -- the node: the prefix of the line that carries the GPU's bus id -----------------

@pytest.mark.parametrize("line, host, pci", [
    ("Apr 19 13:16:41 Kyrios kernel: NVRM: Xid (PCI:0000:02:00): 120, GSP task exception: "
     "load access page fault (cause:0xd) @ pc:0x140ca4a, partition:4#0, task:3",
     "Kyrios", "0000:02:00"),
    ("192.168.11.119: kern: warning: [2026-04-22T21:25:20.505406921Z]: NVRM: Xid "
     "(PCI:0000:48:00): 62, 00002740 00002b08 00001126 0000117a 0000279f 0002a91a 00000011 "
     "00000000", "192.168.11.119", "0000:48:00"),
    ("Dec 23 23:30:56 rescue kernel: [ 179.437933] NVRM: Xid (PCI:0000:01:00): 32, Channel ID "
     "00000005 intr 00008000", "rescue", "0000:01:00"),
])
def test_the_xid_lines_prefix_names_the_node_and_its_bus_id_the_gpu(line, host, pci):
    detection = SCANNER.scan_lines([line])[0]
    assert (detection.host, detection.pci) == (host, pci)
    verdict = _verdict([line])
    if verdict.action == "requeue_exclude":
        assert verdict.nodes == (host,) and verdict.gpus == (pci,)


# -- a GPU node daemon that would not start -----------------------------------------

# NVIDIA/gpu-operator#356 (a GeForce VM: no NVSwitch, nothing for the fabric manager to do)
FM_JOB_FAILED = "Job for nvidia-fabricmanager.service failed because the control process exited with error code."
# the CUDA runtime's 802 on a node whose fabric manager is down (cuda.toml's example)
CUDA_802 = "Cuda failure 802 'system not yet initialized'"


def test_a_gpu_daemon_that_would_not_start_is_information_until_cuda_fails():
    assert _rules([FM_JOB_FAILED]) == ["kernel.nvidia_daemon_failed"]
    assert _verdict([FM_JOB_FAILED]).action == "none"
    # where it mattered, CUDA's own error is the failure: the node's software
    verdict = _verdict([FM_JOB_FAILED, CUDA_802])
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")

"""Every XID code of NVIDIA's catalog maps to a decision, and the decision follows
the catalog's immediate-action bucket; codes that come in groups are read together.

The catalog is ``tests/fixtures/corpus/xid_catalog.jsonl`` (all 172 codes). The
kernel lines below are real: they are quoted from the public reports the corpus
rows cite (the row id is given with each).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from recovery_agent.detect.patterns import (APPLICATION_XIDS, BUCKET_ACTIONS, XID_ACTIONS,
                                            XID_BUCKETS, load_rules, xid_action)
from recovery_agent.detect.scanner import Scanner
from slurm_hooks import kmsg

CATALOG = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "xid_catalog.jsonl"
ROWS = [json.loads(line) for line in CATALOG.read_text().splitlines() if line.strip()]
ACTIONS = {"requeue_exclude_node": "requeue_exclude", "requeue": "requeue", "stop": "stop",
           "none": "none"}
# The buckets whose fault stays with the GPU (a reset, a reboot, a hardware,
# firmware or NVLink workflow), and those that are informational on their own.
NODE_BUCKETS = {"RESET_GPU", "RESTART_BM", "RESTART_VM", "CHECK_MECHANICALS", "UPDATE_SWFW",
                "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR", "WORKFLOW_NVLINK5_ERR"}
QUIET_BUCKETS = {"IGNORE", "CHECK_UVM", "XID_154", "WORKFLOW_XID_45"}
SCANNER = Scanner(load_rules(), engine="re")


def test_the_catalog_has_every_code_once():
    assert sorted(r["xid"] for r in ROWS) == list(range(1, 173))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"xid{r['xid']}")
def test_every_code_has_the_catalogs_bucket(row):
    assert XID_BUCKETS[row["xid"]] == (row["nvidia_immediate_action"] or "")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"xid{r['xid']}")
def test_every_code_maps_to_the_decision_its_bucket_asks(row):
    code, bucket = row["xid"], row["nvidia_immediate_action"] or ""
    action = xid_action(code)
    if row["likely_cause"] == "app":
        expected = "stop"                      # the program's own fault, whatever the bucket
    elif bucket in NODE_BUCKETS:
        expected = "requeue_exclude"
    elif bucket in ("RESTART_APP", "CONTACT_SUPPORT"):
        expected = "requeue"
    elif bucket in QUIET_BUCKETS:
        expected = "none"
    else:                                      # no bucket (162-172): the catalog's reading
        expected = ACTIONS[row["job_recovery_action"]]
    assert action == expected == XID_ACTIONS[code]


@pytest.mark.parametrize("row", [r for r in ROWS if r["job_recovery_action"]],
                         ids=lambda r: f"xid{r['xid']}")
def test_the_decision_agrees_with_the_catalogs_job_recovery_action(row):
    assert xid_action(row["xid"]) == ACTIONS[row["job_recovery_action"]]


def test_the_hooks_fatal_set_is_the_catalogs_exclude_set():
    assert kmsg.FATAL_XIDS == {c for c, a in XID_ACTIONS.items() if a == "requeue_exclude"}
    assert APPLICATION_XIDS == {r["xid"] for r in ROWS if r["likely_cause"] == "app"}
    assert set(BUCKET_ACTIONS) | {""} == set(XID_BUCKETS.values())


def test_codes_beyond_the_catalog_are_unexplained():
    assert xid_action(173) == xid_action(999) == "requeue"


# -- groups, read together: real lines ---------------------------------------------

# ho-ogkm1150-xid45-caused-by-previous-149-145 (NVIDIA/open-gpu-kernel-modules#1150)
XID45_AFTER_149 = ("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, "
                   "Ch 00000001 caused by previous Xid 149")
XID45_AFTER_145 = ("kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, "
                   "Ch 0000000c caused by previous Xid 145")
# ho-vllm40652 (vllm-project/vllm#40652): a bare Xid 45 after an Xid 62 on the same GPU
XID45_BARE = ("192.168.11.119: kern: warning: [2026-04-22T21:25:20.560106789Z]: NVRM: Xid "
              "(PCI:0000:48:00): 45, pid=22884, name=VLLM::Worker, channel 0x0000000a")
XID62 = ("192.168.11.119: kern: warning: [2026-04-22T21:25:20.505406921Z]: NVRM: Xid "
         "(PCI:0000:48:00): 62, 00002740 00002b08 00001126 0000117a 0000279f 0002a91a "
         "00000011 00000000")
# gpud-gb200-xid149-154-drain-reset (leptonai/gpud kmsg test data)
XID149 = ("[171167.620236] NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 "
          "Link 01 (0x021425c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)")
XID154_DRAIN = ("[171167.621162] NVRM: Xid (PCI:0009:01:00): 154, GPU recovery action changed "
                "from 0x0 (None) to 0x4 (Drain and Reset)")
XID154_RESET = ("[171167.897562] NVRM: Xid (PCI:0019:01:00): 154, GPU recovery action changed "
                "from 0x4 (Drain and Reset) to 0x1 (GPU Reset Required)")
# gpud-xid145-rlw-rxpipe-nonfatal
XID145_NONFATAL = ("NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 "
                   "(0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)")
# kohsuke-gist-xid32-69
XID69 = ("Dec 23 23:30:56 rescue kernel: [ 179.438803] NVRM: Xid (PCI:0000:01:00): 69, Class "
         "Error: ChId 0005, Class 0000a097, Offset 00000d9c, Data ffffffff, ErrorCode 0000000c")
XID32 = ("Dec 23 23:30:56 rescue kernel: [ 179.437933] NVRM: Xid (PCI:0000:01:00): 32, Channel "
         "ID 00000005 intr 00008000")
# extra-xid63-row-remap-event
XID63 = ("[401233.55] NVRM: Xid (PCI:0000:3b:00): 63, pid='<unknown>', name=<unknown>, Row "
         "Remapper: New row (0x00000000000a2f13) Marked for Remapping, reset gpu to activate.")


@pytest.mark.parametrize("line, action", [
    (XID45_AFTER_149, "requeue_exclude"),   # the echo of the NVLink5 fault it names
    (XID45_AFTER_145, "requeue_exclude"),
    (XID45_BARE, "none"),                   # alone: a sympathetic channel teardown
    (XID62, "requeue_exclude"),
    (XID149, "requeue_exclude"),
    (XID154_DRAIN, "requeue_exclude"),      # the driver now wants drain and reset
    (XID154_RESET, "requeue_exclude"),
    (XID145_NONFATAL, "none"),              # an NVLink5 code that says it is non-fatal
    (XID69, "stop"),
    (XID32, "requeue"),
    (XID63, "none"),
])
def test_real_xid_lines_get_their_decision(line, action):
    event = kmsg.parse_xid(line)
    assert xid_action(event["xid"], event["message"], event["kind"]) == action
    found = [d for d in SCANNER.scan_lines([line]) if d.rule == "kernel.xid"]
    assert [(d.xid, d.action_hint) for d in found] == [(event["xid"], action)]


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



def test_a_harmless_xid_on_a_named_node_excludes_and_drains_nothing():
    """A bare Xid 45 (a channel torn down after something else went wrong: the
    catalog's "none") in the job's node log, on a node the log names: the
    verdict asks for no action, so the failed job is requeued once as a
    failure without evidence, the node neither excluded nor drained (before,
    the named node alone made it a hardware exclusion and a drain)."""
    from recovery_agent.decide.policy import decide
    from recovery_agent.detect.context import context_from_lines
    context = context_from_lines([XID45_BARE], nodes=("gpu1", "gpu2"),
                                 addresses={"192.168.11.119": "gpu2"})
    verdict = attribute(SCANNER.scan_lines([XID45_BARE]), context)
    assert (verdict.action, verdict.nodes) == ("none", ("gpu2",))
    decision = decide(verdict, state="FAILED")
    assert (decision.action, decision.rule) == ("requeue", "unknown")
    assert decision.exclude == () and decision.drain == () and decision.blamed == ()
    assert "kernel.xid" in decision.reason
    # the Xid 62 before it on the same GPU is the fault: that one excludes and drains
    both = [XID62, XID45_BARE]
    verdict = attribute(SCANNER.scan_lines(both), context_from_lines(
        both, nodes=("gpu1", "gpu2"), addresses={"192.168.11.119": "gpu2"}))
    decision = decide(verdict, state="FAILED")
    assert decision.action == "requeue_exclude" and decision.exclude == ("gpu2",)


# -- node-level software faults, read end to end (issue 15) ------------------------
# Every line below is a real one; the public thread it was copied from is named
# above it (as in the packs' comments).
from recovery_agent.detect.attribution import attribute  # noqa: E402


def _verdict(lines):
    return attribute(SCANNER.scan_lines(lines))


@pytest.mark.parametrize("lines", [
    # NVIDIA/open-gpu-kernel-modules#1230: a GPU left in a bad state, the GSP will not boot
    ["[  127.849897] NVRM: GPU6 _kgspBootGspRm: unexpected WPR2 already up, cannot proceed "
     "with booting GSP",
     "[  127.850566] NVRM: GPU 0000:a1:00.0: RmInitAdapter failed! (0x62:0x40:2168)"],
    # older drivers, no "GPU <BDF>: " prefix (a forum page's dmesg, find_string id 57030497596)
    ["[   32.920601] NVRM: RmInitAdapter failed! (0x23:0x56:451)",
     "[   32.920612] NVRM: rm_init_adapter failed for device bearing minor number 0"],
    # labdao/plex#18: the container runtime's NVML says the driver differs from its libraries
    ["nvidia-container-cli: initialization error: nvml error: driver/library version "
     "mismatch: unknown."],
    # mattshma/bigdata#133: another driver holds the GPUs
    ["[188549.976351] NVRM: The NVIDIA probe routine was not called for 3 device(s)."],
    # NVIDIA/open-gpu-kernel-modules#265: the kernel faulted inside the driver's load
    ["[  463.506574] BUG: kernel NULL pointer dereference, address: 0000000000000040",
     "[  463.506581] Oops: 0000 [#1] PREEMPT SMP NOPTI"],
    # divelab/GraphBP#2: code built by a newer toolkit than this node's driver
    ["RuntimeError: CUDA error: the provided PTX was compiled with an unsupported toolchain."],
    # mknoxnv/ubuntu-slurm#4: the node's prolog failed
    ["srun: error: Task launch for 23.0 failed on node hpc: Job prolog failed"],
])
def test_node_level_software_faults_exclude_the_node(lines):
    verdict = _verdict(lines)
    assert verdict.action == "requeue_exclude"
    assert verdict.category == "system_software"


@pytest.mark.parametrize("lines, category", [
    # LSSI-ETH/plmfit#40: slurmstepd's NVML plugin cannot reach the GPU any more
    (["slurmstepd: error: NVML: Failed to get usage(15): GPU is lost"], "gpu_hardware"),
    # system76/firmware-open#259: the GPU's config space is gone, then Xid 79
    (["kernel: nvidia 0000:01:00.0: can't change power state from D3cold to D0 (config "
      "space inaccessible)",
      "kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=7992, GPU has fallen off the bus."],
     "gpu_hardware"),
    # NVIDIA/open-gpu-kernel-modules#659: GSP RPCs time out, the driver wants a reset
    (["2025-07-23T20:08:23.729932+02:00 ThreadripperIntern kernel: [612947.633642] NVRM: "
      "_issueRpcAndWait: rpcRecvPoll timedout for fn 76!"], "gpu_hardware"),
])
def test_a_gpu_that_stopped_answering_excludes_the_node(lines, category):
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == (category, "requeue_exclude")


def test_the_power_state_line_names_the_gpu():
    # system76/firmware-open#259
    found = SCANNER.scan_lines(["kernel: nvidia 0000:01:00.0: can't change power state from "
                                "D3cold to D0 (config space inaccessible)"])
    assert [(d.rule, d.pci) for d in found] == [("kernel.gpu_power_state_lost", "0000:01:00")]


def test_slurm_memory_enforcement_is_the_jobs_own_oom():
    # openbabel/openbabel#2658
    verdict = _verdict([
        "slurmstepd-falkor7: error: Step 1141810.0 exceeded memory limit (52917772 > "
        "20971520), being killed",
        "srun: Exceeded job memory limit",
        "slurmstepd-falkor7: error: *** STEP 1141810.0 ON falkor7 CANCELLED AT "
        "2023-12-13T08:58:22 ***",
        "srun: error: falkor7: task 0: Killed"])
    assert (verdict.category, verdict.action) == ("oom", "stop")


def test_a_memory_peak_notice_alone_is_no_failure():
    # chaos/slurm#54: printed after a job that succeeded
    verdict = _verdict(["slurmstepd: Exceeded step memory limit at some point."])
    assert verdict.action == "none"


@pytest.mark.parametrize("line", [
    # whamcloud/integrated-manager-for-lustre#230 (ESHUTDOWN after an eviction)
    "mount.lustre: mount /dev/sdb at /mnt/testfs-OST0001 failed: Cannot send after transport "
    "endpoint shutdown",
    # pytorch/pytorch#45826 (the file was replaced under the open handle)
    "RuntimeError: read(): fd 33 failed with Stale file handle",
])
def test_a_write_or_read_that_failed_on_the_way_is_retried(line):
    verdict = _verdict([line])
    assert (verdict.category, verdict.action) == ("system_software", "requeue")


def test_a_bus_error_on_unbacked_shared_memory_is_not_a_code_bug():
    # triton-inference-server/hugectr_backend#42
    verdict = _verdict(["[qgpuvb813-cvision:1    :0:381] Caught signal 7 (Bus error: "
                        "nonexistent physical address)"])
    assert verdict.category == "system_software"
    assert verdict.action != "stop"


def test_a_health_daemons_xid_is_read_like_the_kernels():
    # leptonai/gpud#604: gpud's own wording of an Xid 79
    found = SCANNER.scan_lines(["XID 79(GPU has fallen off the bus) detected on PCI:0000:ae:00"])
    assert [(d.rule, d.xid, d.action_hint, d.pci) for d in found] == [
        ("kernel.xid_monitor", 79, "requeue_exclude", "0000:ae:00")]


@pytest.mark.parametrize("line", [
    # NVIDIA/nccl#1838: no P2P between these GPUs, whatever node of the type
    "[2025-09-09 23:51:24] 9b405963aa12:774:854 [0] transport/shm.cc:590 NCCL WARN Cuda "
    "failure 217 'peer access is not supported between these two devices'",
    # Dao-AILab/causal-conv1d#48: a launch with a bad grid
    "RuntimeError: CUDA error: invalid configuration argument",
    # kyutai-labs/delayed-streams-modeling#179: CUDA graph capture misuse
    "CUDA error: operation not permitted when stream is capturing",
])
def test_cuda_errors_of_the_code_or_its_configuration_stop(line):
    assert _verdict([line]).action == "stop"

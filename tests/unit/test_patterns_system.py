"""System-software and GPU-hardware families, read by message format.

Every line here is a real line from a public log (the comment above the rule
in etc/patterns/*.toml names where); each test checks what the line means
for the job, through the scanner and attribution, not only that a regex
matches (the packs' own examples are checked by test_patterns.py).
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner

SCANNER = Scanner(load_rules(), engine="re")


def _verdict(lines):
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines))


@pytest.mark.parametrize("line, rule, category, action", [
    # the NVIDIA driver: a GPU it lost or never brought up
    ("[  239.061389] NVRM: GPU at 0000:06:00.0 has fallen off the bus.",
     "kernel.gpu_fallen_off_bus", "gpu_hardware", "requeue_exclude"),
    ("[  239.061398] NVRM: A GPU crash dump has been created. If possible, please run",
     "kernel.gpu_crash_dump", "gpu_hardware", "requeue_exclude"),
    ("[   19.545903] nvidia: probe of 0000:82:00.0 failed with error -1",
     "kernel.gpu_probe_failed", "gpu_hardware", "requeue_exclude"),
    ("nvidia 0000:01:00.0: probe with driver nvidia failed with error -1",
     "kernel.gpu_probe_failed", "gpu_hardware", "requeue_exclude"),
    ("[   19.546491] NVRM: None of the NVIDIA graphics adapters were initialized!",
     "kernel.no_gpu_initialized", "system_software", "requeue_exclude"),
    ("NVRM: request_mem_region failed for 16M @ 0xfd000000. This can",
     "kernel.gpu_bar_invalid", "system_software", "requeue_exclude"),
    ("[   60.840582] NVRM: Can't find an IRQ for your NVIDIA card!",
     "kernel.gpu_bar_invalid", "system_software", "requeue_exclude"),
    ("NVRM: nvCheckOkFailedNoLog: Check failed: Reset required [NV_ERR_RESET_REQUIRED] "
     "(0x00000062)", "kernel.rm_reset_required", "gpu_hardware", "requeue_exclude"),
    # nvidia-smi and NVML callers: every form of "this GPU does not answer"
    ("Unable to determine the device handle for GPU3: 0000:5F:00.0: Unknown Error",
     "kernel.gpu_lost", "gpu_hardware", "requeue_exclude"),
    ("Unable to determine the device handle for GPU2: Unknown Error",
     "kernel.gpu_lost", "gpu_hardware", "requeue_exclude"),
    ("Unable to determine the device handle for GPU 0000:01:00.0: Not Found",
     "kernel.gpu_lost", "gpu_hardware", "requeue_exclude"),
    ("Unable to determine the device handle for GPU 0000:02:00.0: Unable to communicate with "
     "GPU because it is insufficiently powered.", "kernel.gpu_lost", "gpu_hardware",
     "requeue_exclude"),
    ("Error: nvmlDeviceGetHandleByIndex(): Unknown Error", "kernel.gpu_lost", "gpu_hardware",
     "requeue_exclude"),
    # the kernel refusing the driver module
    ("modprobe: ERROR: could not insert 'nvidia': Required key not available",
     "kernel.driver_unavailable", "system_software", "requeue_exclude"),
    # the node's kernel
    ("> [  111.090329] Kernel panic - not syncing: Fatal exception in interrupt",
     "node.kernel_panic", "system_software", "requeue_exclude"),
    ("[250336.887598] BUG: workqueue lockup - pool cpus=2 node=0 flags=0x0 nice=0 stuck for 72s!",
     "kernel.soft_lockup", "system_software", "requeue_exclude"),
    ("[  370.080532] pcieport 0000:00:1c.0: DPC: containment event, status:0x1f05 "
     "source:0x0200", "kernel.pcie_aer_fatal", "gpu_hardware", "requeue_exclude"),
    # filesystems: Go's lower-case errno texts, a corrupted filesystem, lockd
    ("FATAL:   While making image from oci registry: error copying image out of cache: could "
     "not copy file: write ./tmp-copy-3780389766: no space left on device",
     "fs.no_space", "system_software", "stop"),
    ("ctr: failed to extract layer sha256:be4eae0b2583281e2cd171c52a0b283a5e6f84e6b86066a18e205a"
     "10cb507fcd: failed to mount /var/lib/containerd/tmpmounts/containerd-mount788433525: "
     "input/output error: unknown", "fs.io_error", "system_software", "requeue"),
    ("OSError: [Errno 117] Structure needs cleaning: '/build/tmp/hosttools'",
     "fs.filesystem_corrupted", "system_software", "requeue_exclude"),
    ("mydesk kernel: [ 6041.424026] lockd: server dlink not responding, still trying",
     "fs.nfs_not_responding", "system_software", "requeue"),
    # containers and Slurm
    ("Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=all",
     "container.nvidia_toolkit_missing", "system_software", "stop"),
    ("srun: error: Application launch failed: Job prolog failed", "slurm.task_launch_failed",
     "system_software", "requeue_exclude"),
    # CUDA's bare strings in other wrappers
    ("F1122 13:34:37.337718  2869 syncedmem.hpp:18] Check failed: error == cudaSuccess (30 vs. "
     "0)  unknown error", "cuda.unknown_error", "cuda_error", "requeue"),
])
def test_emitter_formats_classify(line, rule, category, action):
    found = SCANNER.scan_lines([line])
    assert [(d.rule, d.category, d.action_hint) for d in found] == [(rule, category, action)]


@pytest.mark.parametrize("line", [
    # nvidia-smi's infoROM warning: the GPU computes fine
    "WARNING: infoROM is corrupted at gpu 0000:67:00.0",
    # apptainer --nv on a node without the driver's libraries: harmless on CPU work
    "INFO:    Could not find any nv files on this host!",
    # TensorFlow probing for a GPU on a CPU-only host
    "2021-06-09 10:25:20.595244: W tensorflow/stream_executor/cuda/cuda_driver.cc:326] failed "
    "call to cuInit: UNKNOWN ERROR (303)",
    # the NFS lock client recovering, the driver's informational lines
    "[Tue Mar 10 08:43:52 2026] lockd: server 10.0.7.8 OK",
    # slurmstepd falls back to /tmp and the job goes on
    "slurmstepd: error: couldn't chdir to `/home/testuser': No such file or directory: going to "
    "/tmp instead",
    "[14387.511008] nvidia_uvm: module uses symbols from proprietary module nvidia, inheriting "
    "taint.",
    "Dec  6 17:49:03 eduardo-desktop kernel: [ 8659.726078] NVRM: nvidia-bug-report.sh as root "
    "to collect this data before",
])
def test_benign_chatter_stays_quiet(line):
    assert SCANNER.scan_lines([line]) == []


def test_a_lost_gpu_names_the_node_and_the_gpu():
    # journald prefix names the host, the old one-line form names the bus id
    verdict = _verdict(["Dec  6 17:49:03 eduardo-desktop kernel: [ 8659.726067] NVRM: GPU at "
                        "0000:01:00.0 has fallen off the bus."])
    assert (verdict.action, verdict.blame) == ("requeue_exclude", "node")
    assert verdict.nodes == ("eduardo-desktop",)
    assert verdict.gpus == ("0000:01:00",)


def test_a_kernel_panic_outranks_the_task_exits_it_leaves():
    # the node went down; srun's exit line (another public log) is what it leaves
    lines = ["> [  111.090329] Kernel panic - not syncing: Fatal exception in interrupt",
             "srun: error: hpc-novel-gpu01: task 0: Exited with exit code 1"]
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")
    assert not verdict.unexplained


def test_a_full_disk_in_go_wording_stops_with_its_reason():
    verdict = _verdict(["FATAL:   while extracting /home/ubuntu/pvol/trinotate.v4.0.0.simg: root "
                        "filesystem extraction failed: failed to copy content in staging file: "
                        "write /tmp/rootfs-1058395309/archive-424269722: no space left on device"])
    assert (verdict.category, verdict.action) == ("system_software", "stop")


def test_a_hook_failure_is_a_symptom_the_runtime_error_before_it_decides():
    # pyxis replays enroot's log: the NVIDIA hook failed because the node's
    # driver is not loaded; the node is excluded, not the job stopped
    lines = ["slurmstepd: error: pyxis: container start failed with error code: 1",
             "slurmstepd: error: pyxis: printing contents of log file ...",
             "slurmstepd: error: pyxis:     nvidia-container-cli: initialization error: nvml "
             "error: driver not loaded",
             "slurmstepd: error: pyxis:     [ERROR] /etc/enroot/hooks.d/98-nvidia.sh exited "
             "with return code 1",
             "slurmstepd: error: pyxis: couldn't start container"]
    found = {d.rule: d.role for d in SCANNER.scan_lines(lines)}
    assert found["container.enroot_hook_failed"] == "symptom"
    assert _verdict(lines).action == "requeue_exclude"
    # alone, the hook line is an unexplained failure: requeue, no blame
    alone = _verdict([lines[3]])
    assert (alone.action, alone.unexplained) == ("requeue", True)


def test_a_failed_prolog_in_the_launch_summary_excludes_the_node():
    # mknoxnv/ubuntu-slurm#4: the per-node line names the node, srun's summary does not
    lines = ["srun: error: Task launch for 23.0 failed on node hpc: Job prolog failed",
             "srun: error: Application launch failed: Job prolog failed",
             "srun: Job step aborted: Waiting up to 32 seconds for job step to finish."]
    verdict = _verdict(lines)
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("hpc",))


def test_a_gres_count_drop_is_the_nodes_software_view():
    verdict = _verdict(["Reason=gres/gpu count reported lower than configured (0 < 8)"])
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")

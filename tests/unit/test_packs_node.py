"""Node-level faults, MPI runtimes losing a node, and SIGILL/SIGKILL exits
(issue 15): the rules of kernel_gpu.toml, interconnect.toml (its MPI section),
signals.toml and oom.toml for these families, run end to end through the
shipped packs and attribution.

Every log line is a real one: copied from the row of the public tune split named
above it (``tests/fixtures/corpus/public_tune.jsonl``; the row's ``source`` is
the public thread), or from the public log the rule's comment in its pack cites.
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from tests.unit.packs import rules_of, scanner  # noqa: F401 (scanner: a fixture)


# r3-mpioperator152-orte-lost-remote-daemon-worker19
ORTE_LOST = [
    "ORTE has lost communication with a remote daemon.",
    "",
    "  HNP daemon   : [[43015,0],0] on node tf-bert-libnlp-token-lr-5e-6-fp32-1572827779-launcher-gdqv7",
    "  Remote daemon: [[43015,0],20] on node tf-bert-libnlp-token-lr-5e-6-fp32-1572827779-worker-19",
    "",
    "This is usually due to either a failure of the TCP network",
    "connection to the node, or possibly an internal failure of",
    "the daemon itself. We cannot recover from this failure, and",
    "therefore will terminate the job.",
]


def test_lost_remote_daemon_names_the_lost_node_not_the_launcher(scanner):
    verdict = attribute(scanner.scan_lines(ORTE_LOST))
    assert verdict.category == "system_software"
    assert verdict.action == "requeue"
    named = set(verdict.nodes) | set(verdict.suspects) | set(verdict.where)
    assert "tf-bert-libnlp-token-lr-5e-6-fp32-1572827779-worker-19" in named
    assert "tf-bert-libnlp-token-lr-5e-6-fp32-1572827779-launcher-gdqv7" not in named


def test_prte_wording_and_a_redacted_node_name_no_host(scanner):
    # NVIDIA/nccl-tests#299
    dets = scanner.scan_lines([
        "PRTE has lost communication with a remote daemon.",
        "  Remote daemon: [prterun-yj-videogen-multinode-job-master-0-34@0,1] on node (worker_ip)",
    ])
    assert {d.rule for d in dets} == {"mpi.lost_remote_daemon", "mpi.remote_daemon_node"}
    assert all(not d.host for d in dets)


def test_hydra_banner_is_an_exit_and_names_no_node(scanner):
    # MPICH log (find_string id 54828010725): the banner after a CUDA error
    dets = scanner.scan_lines([
        "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
        "=   RANK 0 PID 5490 RUNNING AT gn59",
        "=   KILLED BY SIGNAL: 9 (Killed)",
    ])
    roles = {d.rule: d.role for d in dets}
    assert roles == {"mpi.hydra_bad_termination": "exit", "signal.exit_137": "exit"}
    assert all(not d.host for d in dets)
    verdict = attribute(dets)
    assert verdict.action == "requeue" and not verdict.nodes


# r3-horovod926-mpirun-illegal-instruction-avx
def test_launcher_sigill_stops_as_a_cpu_mismatch(scanner):
    line = ("mpirun noticed that process rank 0 with PID 0 on node exited on signal 4 "
            "(Illegal instruction).")
    # the specific rule outranks the generic exit report on its line
    assert rules_of(scanner, [line]) == {"signal.launcher_illegal_instruction"}
    verdict = attribute(scanner.scan_lines([line]))
    assert (verdict.category, verdict.action) == ("system_software", "stop")


def test_launcher_other_signals_stay_exits(scanner):
    # ho-deepspeed6896-prterun-rank7-signal6-gpu0304
    line = "prterun noticed that process rank 7 with PID 0 on node gpu0304 exited on signal 6 (Aborted)."
    assert rules_of(scanner, [line]) == {"signal.mpi_rank_signal"}


# r3-arjuna52-interactive-bare-killed-prompt
def test_bare_killed_after_training_reads_as_oom(scanner):
    verdict = attribute(scanner.scan_lines([
        "Epoch: [0][511/1736]\t Loss 0.5117 MAE 0.6075 RMSE 0.7153",
        "Killed",
        "(abnn) mingzeya@c002:~/CGCNN_project/AbNN_benchmark/hform/case1    $ ",
    ]))
    assert (verdict.category, verdict.action) == ("oom", "stop")
    assert not verdict.nodes


# r3-ffdl127-learner-killed-exit-137
def test_shell_killed_and_exit_137_read_as_oom(scanner):
    lines = [
        "135 | 1534166953117 | /usr/local/bin/train.sh: line 18:    36 Killed                  python3 convolutional_network.py --trainImagesFile ${DATA_DIR}/train-images-idx3-ubyte.gz --trainLabelsFile ${DATA_DIR}/train-labels-idx1-ubyte.gz --testImagesFile ${DATA_DIR}/t10k-images-idx3-ubyte.gz --testLabelsFile ${DATA_DIR}/t10k-labels-idx1-ubyte.gz --learningRate 0.001 --trainingIters 2000 2>&1",
        "136 | 1534166953118 | Training process finished. Exit code: 137",
        "137 | 1534166953119 | Job exited with error code 137",
        "138 | 1534166953120 | Failed: learner_exit_code: 137`",
    ]
    dets = scanner.scan_lines(lines)
    assert [d.rule for d in dets] == ["signal.shell_killed"] + ["signal.exit_137"] * 3
    verdict = attribute(dets)
    assert (verdict.category, verdict.action) == ("oom", "stop")


def test_exit_137_alone_is_an_unexplained_exit(scanner):
    verdict = attribute(scanner.scan_lines(["      Exit Code:    137"]))
    assert verdict.category == "oom" and verdict.action == "requeue"


def test_killed_look_alikes_do_not_fire_the_shell_rule(scanner):
    assert "signal.shell_killed" not in rules_of(scanner, [
        "RuntimeError: DataLoader worker (pid 629) is killed by signal: Killed.",
        "[35881895.792304] Killed process 21518 (python2) total-vm:13345928kB, anon-rss:12721928kB, file-rss:4kB",
        "srun: error: taurusi2031: tasks 10-11: Exited with exit code 1",
    ])


def test_time_limit_explains_a_later_killed(scanner):
    # slurmstepd's time-limit line (ho- corpus wording) before the shell's report
    verdict = attribute(scanner.scan_lines([
        "slurmstepd: error: *** JOB 2466290 ON nid004069 CANCELLED AT 2024-02-18T20:51:12 DUE TO TIME LIMIT ***",
        "Killed",
    ]))
    assert verdict.category != "oom"


def test_kubernetes_oomkilled_and_docker_inspect_false(scanner):
    # kubectl describe output (find_string id 53402677996); docker inspect (id 21643330011)
    assert "oom.container_oomkilled" in rules_of(scanner, ["        Reason:       OOMKilled"])
    assert rules_of(scanner, ['            "OOMKilled": false,']) == set()


# r3-osm278-spike01-uncorrectable-mce-ilo-log
def test_bmc_uncorrectable_machine_check_excludes_the_node(scanner):
    verdict = attribute(scanner.scan_lines([
        "1346 Critical       04:07  11/05/2018 04:07  11/05/2018 0001",
        "LOG: Uncorrectable Machine Check Exception (Board 0, Processor 1, APIC ID 0x00000010, Bank 0x00000005, Status 0xBA000000'00400405, Address 0x00000000'00000000, Misc 0x00000000'00004280)",
    ]))
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


def test_poisoned_page_consumed_is_uncorrectable(scanner):
    # kernel mailing-list report (find_string id 12620575765)
    assert "kernel.memory_uncorrectable" in rules_of(
        scanner, ["mce: Uncorrected hardware memory error in user-access at edbe201400"])
    # a corrected event logged is context only
    assert "kernel.memory_uncorrectable" not in rules_of(
        scanner, ["Sep 16 19:51:15 kernel: [    0.064261] mce: [Hardware Error]: Machine check events logged"])


@pytest.mark.parametrize("lines", [
    # r3-nvct32-ctr-no-devices-after-host-reboot
    ["# ctr run -t --rm --gpus 0 nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda10.2 sample nvidia-smi",
     "No devices were found"],
    # r3-k8sdp414-no-devices-found-after-node-reboot
    ["2023/06/12 09:21:24 Loading NVML", "2023/06/12 09:21:25 Retreiving plugins.",
     "2023/06/12 09:21:25 No devices found. Waiting indefinitely."],
])
def test_no_gpus_after_reboot_excludes_the_node(scanner, lines):
    verdict = attribute(scanner.scan_lines(lines))
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


def test_gpu_reset_refused_names_the_held_gpu(scanner):
    # nvidia-smi -r output quoted in public GPU docs (find_string id 62154917342)
    dets = scanner.scan_lines([
        "The following GPUs could not be reset:",
        "  GPU 00000000:8B:00.0: In use by another client",
        "  GPU 00000000:8C:00.0: In use by another client",
    ])
    assert [d.rule for d in dets] == ["kernel.gpu_held_by_other_process"] * 2
    assert [d.pci for d in dets] == ["0000:8b:00", "0000:8c:00"]
    assert attribute(dets).action == "requeue_exclude"

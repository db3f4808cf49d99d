"""Launch and placement failures: Slurm's client errors (slurm.toml) and the
container launchers (containers.toml), read together with attribution.

Every line below is a rule's real example or a corpus row's line (the packs'
comments name the threads); the tests pin how the rules of one line outrank
each other (priority) and what the verdict of a whole launch log is."""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from recovery_agent.detect.context import context_from_lines
from recovery_agent.detect.patterns import load_pack, load_rules, shipped_dir
from recovery_agent.detect.scanner import Scanner

RULES = load_rules()
SCANNER = Scanner(RULES, engine="re")


def _rules(line: str) -> list[str]:
    return [d.rule for d in SCANNER.scan_lines([line])]


def _verdict(lines: list[str]):
    return attribute(SCANNER.scan_lines(lines), context_from_lines(lines))


# -- one line, one reading ----------------------------------------------------------

@pytest.mark.parametrize("line, rule", [
    # the request as written: the generic format
    (">   srun: error: Unable to create step for job 238051: More", "slurm.request_rejected"),
    ("srun: error: Unable to allocate resources: Invalid account or account/partition "
     "combination specified", "slurm.request_rejected"),
    ("salloc: error: Job submit/allocate failed: Job violates accounting/QOS policy (job submit "
     "limit, user's size and/or time limits)", "slurm.request_rejected"),
    # the same prefixes, read otherwise by a rule of higher priority
    ("`srun: error: Unable to allocate resources: Socket timed out on send/recv operation`",
     "slurm.rpc_failed"),
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect "
     "failure)", "slurm.rpc_failed"),
    ("salloc: error: Unable to allocate resources: Connection timed out",
     "slurm.resources_unavailable"),
    ("sbatch: error: Batch job submission failed: Protocol authentication error",
     "slurm.munge_failure"),
    ("srun: error: Unable to create step for job 63094233: Job/step already completing or "
     "completed", "slurm.step_job_ending"),
    # the task-launch line names its node and outranks the errno readings
    ("srun: error: Task launch for StepId=10301666.2 failed on node gpu016: Socket timed out on "
     "send/recv operation", "slurm.task_launch_failed"),
    # containers: the specific reading wins its line
    ('FATAL:   container creation failed: exec: "/usr/bin/nvidia-container-cli": stat '
     '/usr/bin/nvidia-container-cli: no such file or directory',
     "container.nvidia_toolkit_missing"),
    ("`FATAL:    container creation failed: unable to /home/jstover/nvidia-smi to mount list: "
     "destination must be an absolue path`", "container.apptainer_creation_failed"),
])
def test_a_launch_line_has_one_reading(line, rule):
    assert _rules(line) == [rule]


def test_a_mount_error_over_files_the_image_has_is_the_image():
    line = ("docker: Error response from daemon: OCI runtime create failed: container_linux.go:349: "
            "starting container process caused \"process_linux.go:449: container init caused "
            "\\\"process_linux.go:432: running prestart hook 1 caused \\\\\\\"error running hook: "
            "exit status 1, stdout: , stderr: exec command: [/usr/bin/nvidia-container-cli "
            "--load-kmods configure --ldconfig=@/sbin/ldconfig.real --device=all --compute "
            "--compat32 --graphics --utility --video --display --pid=9165 /var/lib/docker/overlay2/"
            "2a1a1c3555109e20c5ba2e386cc3ce69cbb80c3850663c1909db8c46ed565c0c/merged]\\\\\\\\n"
            "nvidia-container-cli: mount error: file creation failed: /var/lib/docker/overlay2/"
            "2a1a1c3555109e20c5ba2e386cc3ce69cbb80c3850663c1909db8c46ed565c0c/merged/usr/lib/"
            "aarch64-linux-gnu/libnvidia-fatbinaryloader.so.440.18: file exists\\\\\\\\n\\\\\\\""
            "\\\"\": unknown")
    assert _rules(line) == ["container.image_has_driver_files"]
    other = ("nvidia-container-cli: mount error: mount operation failed: /tmp/enroot/"
             "pccl+containertest+0.1/usr/lib/firmware/nvidia/470.57.02: operation not permitted")
    assert _rules(other) == ["container.nvidia_runtime_failed"]


@pytest.mark.parametrize("line", [
    "pyxis: importing docker image: docker://master:5000#custom-pytorch-3-1:latest",
    "slurmstepd: error: pyxis: printing enroot log file:",
    "slurmstepd: error: pyxis:     [INFO] Querying registry for permission grant",
    "srun: Job 29986033 step creation temporarily disabled, retrying (Requested nodes are busy)",
    "salloc: job 2016286 queued and waiting for resources",
    "INFO:    Setting --writable-tmpfs (required by nvidia-container-cli)",
    "sbatch: error: If munged is up, restart with --num-threads=10",
])
def test_launch_chatter_fires_nothing(line):
    assert _rules(line) == []


# -- whole logs -----------------------------------------------------------------------

PYXIS_61 = [   # NVIDIA/pyxis#61 (corpus row r3-pyxis61-...)
    "pyxis: importing docker image ...",
    "slurmstepd: error: pyxis: container start failed with error code: 1",
    "slurmstepd: error: pyxis: printing contents of log file ...",
    "slurmstepd: error: pyxis:     enroot-switchroot: failed to execute: /bin/bash: No such file "
    "or directory",
    "slurmstepd: error: pyxis: couldn't start container",
    "slurmstepd: error: pyxis: if the image has an unusual entrypoint, try using "
    "--no-container-entrypoint",
    "slurmstepd: error: spank: required plugin spank_pyxis.so: task_init() failed with rc=-1",
    "slurmstepd: error: Failed to invoke spank plugin stack",
    "srun: error: hpc-pg0-2: task 1: Exited with exit code 1",
]


def test_an_image_without_a_shell_stops_and_blames_no_node():
    verdict = _verdict(PYXIS_61)
    assert (verdict.category, verdict.action) == ("system_software", "stop")
    assert verdict.nodes == ()


def test_the_pyxis_summary_alone_still_stops():
    # NVIDIA/pyxis#22: the entrypoint swallowed pyxis's wrapper; nothing but pyxis's summary
    lines = ["slurmstepd: pyxis: starting container ...",
             "slurmstepd: error: pyxis: container start failed with error code: 1",
             "slurmstepd: error: pyxis:     sh: Invalid argument",
             "slurmstepd: error: spank: required plugin spank_pyxis.so: task_init_privileged() "
             "failed with rc=-1"]
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == ("system_software", "stop")


def test_a_registry_refusal_stops():
    # NVIDIA/pyxis#118
    lines = ["slurmstepd: error: pyxis: child 30165 failed with error code: 1",
             "slurmstepd: error: pyxis: failed to import docker image",
             "slurmstepd: error: pyxis: printing enroot log file:",
             "slurmstepd: error: pyxis:     [INFO] Querying registry for permission grant",
             "slurmstepd: error: pyxis:     [ERROR] URL http://master:5000/v2/custom-pytorch-3-1/"
             "manifests/latest returned error code: 400 Bad Request",
             "slurmstepd: error: pyxis: couldn't start container",
             "srun: error: cnode001: task 0: Exited with exit code 1"]
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == ("system_software", "stop")


def test_a_broken_node_runtime_behind_pyxis_moves_the_job():
    # pyxis's summary comes first; the enroot log it prints names the node's driver
    lines = ["slurmstepd: error: pyxis: container start failed with error code: 1",
             "slurmstepd: error: pyxis: printing enroot log file:",
             "slurmstepd: error: pyxis:     nvidia-container-cli: detection error: nvml error: "
             "unknown error",
             "slurmstepd: error: pyxis: couldn't start container"]
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


@pytest.mark.parametrize("lines, category, action", [
    # BLAST-WarpX/warpx#3601: the request no node can meet
    ([">   srun: error: Unable to create step for job 238051: More",
      ">   processors requested than permitted."], "application", "stop"),
    (["sbatch: error: Batch job submission failed: Requested node configuration is not "
      "available"], "application", "stop"),
    # aws/aws-parallelcluster#4179: many slurmds timing out at once
    (["srun: error: slurm_receive_msgs: [[ip-172-31-230-255.ec2.internal]:6818] failed: Socket "
      "timed out on send/recv operation",
      "srun: error: slurm_receive_msgs: [[ip-172-31-238-197.ec2.internal]:6818] failed: Socket "
      "timed out on send/recv operation"], "system_software", "requeue"),
    # gglyptodon/helixer-docker#5 and apptainer/singularity#2244
    (["INFO:    Setting --writable-tmpfs (required by nvidia-container-cli)",
      'FATAL:   container creation failed: exec: "/usr/bin/nvidia-container-cli": stat '
      '/usr/bin/nvidia-container-cli: no such file or directory'], "system_software", "stop"),
    (["FATAL:   exec /.singularity.d/actions/shell failed: no such file or directory"],
     "system_software", "stop"),
    (["/.singularity.d/actions/exec: line 21: exec: myPimpleFoam: not found"],
     "application", "stop"),
    (['`FATAL:   "force": executable file not found in $PATH`'], "application", "stop"),
    (["unbound      | standard_init_linux.go:228: exec user process caused: exec format error"],
     "system_software", "stop"),
    (["nvidia-container-cli: requirement error: unsatisfied condition: cuda>=12.8, please "
      "update your driver to a newer version, or use an earlier cuda container"],
     "system_software", "requeue_exclude"),
])
def test_launch_logs(lines, category, action):
    verdict = _verdict(lines)
    assert (verdict.category, verdict.action) == (category, action)


def test_container_rules_are_the_jobs_own_output():
    # pyxis writes through slurmstepd into the job's output, the launchers to its stderr
    rules = load_pack(shipped_dir() / "containers.toml")
    assert rules and all(rule.emitter == "job" for rule in rules)

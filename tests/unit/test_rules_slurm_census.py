"""Slurm's own step setup and launch messages (issue 15, round 4: the census of
SchedMD/slurm's slurmstepd, srun, task/cgroup, cgroup, job_container, mpi/pmix,
switch and slurmctld sources in /tmp/team/r4/census-slurm.md): the rules
slurm.toml adds for them, run end to end through the shipped packs and
attribution.

The decisions each test pins: a step the node could not set up (task plugins,
cgroups, the job container, the plugin stack) excludes that node; a switch
plugin that could not configure the interconnect is retried; a cgroup's
ENOSPC is no full disk (never a stop); PMIx wire-up failures are symptoms
(the peer a suspect, a node failure beside them the answer); srun's teardown
lines are exits, so a failure made of them alone is unexplained (requeue,
never stop); a task layout the request cannot have is the job's (stop).

Every log line is a real one, copied from the public log the rule's comment
cites (a thread, or a find_string id for a quoted log).
"""
from __future__ import annotations

import pytest

from recovery_agent.detect.attribution import attribute
from tests.unit.packs import rules_of, scanner, verdict_of  # noqa: F401 (scanner: a fixture)


# -- the node could not set the step up: exclude it -----------------------------

# Azure/cyclecloud-slurm#388: dynamic nodes whose cpuset cgroup had no CPUs; the
# batch step died before the script ran.
CPUSET_ENOSPC = [
    "  slurmstepd: error: common_file_write_uints: write value '39981' to '/sys/fs/cgroup/cpuset/slurm/uid_20006/job_6457/step_batch/cgroup.procs' failed: No space left on device",
    "  slurmstepd: error: unable to add pids to '/sys/fs/cgroup/cpuset/slurm/uid_20006/job_6457/step_batch'",
    "  slurmstepd: error: task_g_set_affinity: File exists",
    "  slurmstepd: error: _exec_wait_child_wait_for_parent: failed: Interrupted system call",
    "  slurmstepd: error: job_manager: exiting abnormally: Slurmd could not execve job",
]


def test_a_step_the_node_could_not_set_up_excludes_the_node(scanner):
    detections = scanner.scan_lines(CPUSET_ENOSPC)
    assert [d.rule for d in detections] == [
        "slurm.cgroup_setup_error", "slurm.cgroup_setup_error", "slurm.step_setup_failed"]
    verdict = attribute(detections)
    # the cgroup's ENOSPC is not read as a full disk: no stop
    assert (verdict.category, verdict.action, verdict.blame) == (
        "system_software", "requeue_exclude", "node")
    assert "never ran" in verdict.reason


def test_the_task_plugins_line_names_the_node_from_its_prefix(scanner):
    # a cluster admin's notes quoting the line (find_string id 10083241814)
    line = "slurmstepd-master: error: Failed to invoke task plugins: task_p_pre_launch error"
    (detection,) = scanner.scan_lines([line])
    assert (detection.rule, detection.host) == ("slurm.step_setup_failed", "master")
    verdict = attribute([detection])
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("master",))


# ArjunaCluster/ArjunaUsers#123 (the admins took the nodes down to fix them) and
# a Cray job log quoted in a public repository (find_string id 55217529278).
@pytest.mark.parametrize("lines", [
    ["slurmstepd: error: container_p_join: open failed /scratch/119383/.active: No such file or directory",
     "slurmstepd: error: container_g_join failed: 119383"],
    ["slurmstepd: error: container_p_join: setns failed for /cray/tmp/job_container/286704/.ns: Invalid argument",
     "slurmstepd: error: container_g_join failed: 286704",
     "slurmstepd: error: exec_wait_signal_child: write(fd:21) to unblock task 0 failed"],
])
def test_a_job_container_the_step_cannot_join_excludes_the_node(scanner, lines):
    assert rules_of(scanner, lines) == {"slurm.job_container_failed"}
    verdict = verdict_of(scanner, lines)
    assert (verdict.category, verdict.action) == ("system_software", "requeue_exclude")


def test_a_plugin_stack_that_does_not_load_excludes_the_node(scanner):
    # NVIDIA/pyxis#4: srun's line, and the node's slurmd log for the same step
    (detection,) = scanner.scan_lines(["srun: error: task 0 launch failed: Plugin initialization failed"])
    assert (detection.rule, detection.action_hint) == ("slurm.task_launch_failed", "requeue_exclude")
    # the slurmd log of a public setup guide (find_string id 14105182975)
    line = "[2024-02-20T16:06:16.273] [50.batch] error: job_manager: exiting abnormally: Plugin initialization failed"
    assert rules_of(scanner, [line]) == {"slurm.step_setup_failed"}


@pytest.mark.parametrize("line, host", [
    # find_string ids 14105182975 (slurmctld.log) and 54990054890 (journald)
    ("[2024-02-20T16:06:16.263] error: slurmd error running JobId=50 on node(s)=runner01: Plugin initialization failed",
     "runner01"),
    ("Jun 13 06:57:25 master slurmctld[483]: slurmctld: error: slurmd error running JobId=6 on node(s)=worker1: Plugin initialization failed",
     "worker1"),
])
def test_the_controller_draining_a_node_for_a_launch_failure_names_it(scanner, line, host):
    (detection,) = scanner.scan_lines([line])
    assert (detection.rule, detection.host, detection.role) == ("slurm.ctld_launch_failed", host, "root")
    verdict = attribute([detection])
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", (host,))


# -- the interconnect could not be configured: retry ------------------------------

def test_a_switch_plugin_failure_is_retried_not_stopped(scanner):
    # a LUMI user's report quoted in a public repository (find_string id 5978505452)
    verdict = verdict_of(scanner, ["srun: error: task 256 launch failed: Error configuring interconnect"])
    assert (verdict.category, verdict.action) == ("interconnect", "requeue")


# -- cgroup trouble the step survives: a symptom, never a stop --------------------

@pytest.mark.parametrize("line", [
    # Niflheim's Slurm notes (find_string id 14973615904), galaxyproject/galaxy#7766
    "  slurmstepd: error: xcgroup_instantiate: unable to create cgroup '/sys/fs/cgroup/memory/slurm/uid_207887' : No space left on device",
    "slurmstepd: error: xcgroup_instantiate: unable to create cgroup ‘/sys/fs/cgroup/memory/slurm/uid_819800’ : Cannot allocate memory",
    # user notes quoting the line (find_string id 26283294871)
    "slurmstepd: error: task/cgroup: unable to add task[pid=32424] to memory cg '(null)'",
])
def test_a_cgroup_the_step_runs_on_without_is_a_symptom(scanner, line):
    (detection,) = scanner.scan_lines([line])
    assert (detection.rule, detection.role) == ("slurm.cgroup_setup_error", "symptom")
    verdict = attribute([detection])
    assert verdict.unexplained and verdict.action == "requeue"


def test_a_cgroup_warning_does_not_outweigh_the_jobs_own_error(scanner):
    # find_string id 26586933384: the '(null)' warnings, then the job's own traceback
    lines = [
        "slurmstepd: error: task/cgroup: unable to add task[pid=26220] to memory cg '(null)'",
        "slurmstepd: error: task/cgroup: unable to add task[pid=26247] to memory cg '(null)'",
        "Traceback (most recent call last):",
        '  File "python_for_loops.py", line 80, in <module>',
    ]
    verdict = verdict_of(scanner, lines)
    assert verdict.action != "requeue_exclude" and not verdict.nodes


def test_benign_cgroup_and_container_debug_lines_fire_nothing(scanner):
    # ovis-hpc/ldms#778 (slurmd log at debug2)
    lines = [
        "[2021-08-25T09:09:02.858] [15.0] debug2: xcgroup_load: unable to get cgroup '/sys/fs/cgroup/memory' entry '/sys/fs/cgroup/memory/slurm/system' properties: No such file or directory",
        "[2021-08-25T09:09:02.858] [15.0] debug:  job_container/tmpfs: _read_slurm_jc_conf: Reading job_container.conf file /etc/slurm/job_container.conf",
    ]
    assert rules_of(scanner, lines) == set()


# -- srun's teardown: exits, whatever the cause ------------------------------------

def test_a_step_torn_down_with_nothing_else_is_unexplained(scanner):
    # a job log quoted in a public repository (find_string id 60369758097)
    lines = [
        "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
        "slurmstepd-gpu-h128: error: *** STEP 12769.0 ON gpu-h128 CANCELLED AT 2026-07-12T07:51:35 ***",
        "srun: error: Timed out waiting for job step to complete",
    ]
    assert rules_of(scanner, lines) == {"slurm.step_aborted", "slurm.cancelled"}
    verdict = verdict_of(scanner, lines)
    assert verdict.unexplained and verdict.action == "requeue" and verdict.blame == "unknown"


def test_the_teardown_follows_the_launch_failure_that_caused_it(scanner):
    # c3nl-neuraldynamics/c3nl_cluster#61
    lines = [
        "srun: error: Task launch for 1443722.0 failed on node compute-0-1: Job credential expired",
        "srun: error: Application launch failed: Job credential expired",
        "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
    ]
    verdict = verdict_of(scanner, lines)
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("compute-0-1",))


def test_a_task_layout_the_request_cannot_have_is_the_jobs(scanner):
    # snakemake/snakemake-executor-plugin-slurm#225 (the poster elided the node)
    lines = [
        "srun: error: JobId=125452 failed to distribute tasks (bind_type:threads,mask_cpu,one_thread) - this should never happen",
        "srun: error: Task launch for StepId=125452.4 failed on node [NODENAME]: Unable to layout tasks on given cpus",
        "srun: error: Application launch failed: Unable to layout tasks on given cpus",
        "srun: Job step aborted",
    ]
    verdict = verdict_of(scanner, lines)
    assert (verdict.category, verdict.action) == ("application", "stop")


# -- PMIx wire-up between the step's nodes: a symptom, the node failure explains it --

def test_pmix_send_failures_before_a_node_failure_blame_that_node(scanner):
    # openpmix/openpmix#3559
    lines = [
        "slurmstepd: error:  mpi/pmix_v5: pmixp_p2p_send: ccexe0094 [4]: pmixp_utils.c:469: send failed, rc=1001, exceeded the retry limit",
        "slurmstepd: error:  mpi/pmix_v5: _slurm_send: ccexe0094 [4]: pmixp_server.c:1581: Cannot send message to /var/spool/slurmd/stepd.slurm.pmix.656.0, size = 46979, hostlist:",
        "(null)",
        "srun: error: Node failure on ccexe0091",
    ]
    detections = scanner.scan_lines(lines)
    assert [d.rule for d in detections] == [
        "slurm.pmix_wireup_failed", "slurm.pmix_wireup_failed", "slurm.node_failure"]
    verdict = attribute(detections)
    assert (verdict.action, verdict.nodes) == ("requeue_exclude", ("ccexe0091",))


def test_pmix_connections_failing_alone_are_unexplained_with_the_peer_a_suspect(scanner):
    # openpmix/openpmix#3098 (sporadic: the same nodes work on a retry)
    lines = [
        "slurmstepd: error:  mpi/pmix_v2: _tcp_connect: lxbk1177 [0]: pmixp_dconn_tcp.c:139: Cannot establish the connection",
        "slurmstepd: error:  mpi/pmix_v2: pmixp_dconn_connect: lxbk1177 [0]: pmixp_dconn.h:246: Cannot establish direct connection to lxbk1177 (0)",
    ]
    verdict = verdict_of(scanner, lines)
    assert verdict.unexplained and verdict.action == "requeue" and not verdict.nodes
    assert verdict.suspects == ("lxbk1177",)

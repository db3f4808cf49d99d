"""A node of the job drained while it ran, with a reason the packs read: the
site's health check (NHC's "NHC: check_...: ..." drain, helpers/
node-mark-offline) or slurmctld's own reasons. Only an admin or Slurm sets a
node's reason, never a job, so the verdict takes it as that node's own
evidence (issue 15: naming the node). What it must not take: a reason older
than the attempt or with no time, and anything when Slurm cannot list the
nodes. Each reason below is one Slurm printed (``Reason=``, without the
``[user@time]`` scontrol adds) in a public page: an scontrol show node in a
public repository (find_string id 24738526160) and a health-check plugin's
docs (find_string id 70784017582)."""
from __future__ import annotations

import pytest

from recovery_agent.errors import SchedulerError
from recovery_agent.scheduler.base import Node
from tests.unit.test_watch import Ended, hook_report

SERVICE = "NHC: check_ps_service:  Service sshd (process sshd) owned by root not running"
GPU_FAULT = ("NHC: Health check failed:  check_pantheon:  PANTHEON FAULT: GPU 0 FAULT "
             "(march_test failed: memory errors detected or the workload aborted)")


def drained(name, reason, when):
    return Node(name, "MIXED", frozenset({"DRAIN"}), reason=reason, reason_user="root",
                reason_time=when)


def test_a_health_check_drain_during_the_attempt_names_that_node(tmp_path):
    for i, reason in enumerate((SERVICE, GPU_FAULT)):
        (tmp_path / str(i)).mkdir()
        ended = Ended(tmp_path / str(i))
        ended.sched.nodes = [Node("node1", "MIXED"), drained("node2", reason, 1500)]
        ended.until(94)
        (verdict,) = ended.verdicts()
        assert (verdict["blame"], verdict["action"], verdict["nodes"]) == \
            ("node", "requeue_exclude", ["node2"]), reason
        assert verdict["category"] == "system_software"
        assert verdict["reason"].startswith("nhc.check_failed")


def test_a_reason_older_than_the_attempt_or_without_a_time_is_not_evidence(tmp_path):
    for i, node2 in enumerate((drained("node2", SERVICE, 100),       # the attempt began at 1001
                               drained("node2", SERVICE, None),
                               Node("node2", "MIXED", reason=SERVICE, reason_time=1500))):
        (tmp_path / str(i)).mkdir()
        ended = Ended(tmp_path / str(i))
        ended.sched.nodes = [Node("node1", "MIXED"), node2]
        ended.until(94)
        (verdict,) = ended.verdicts()
        assert verdict["blame"] != "node" and verdict["nodes"] == [], node2


def test_nodes_slurm_cannot_list_add_nothing(tmp_path):
    ended = Ended(tmp_path)
    ended.sched.nodes = [Node("node1", "MIXED"), drained("node2", SERVICE, 1500)]

    def down(names=None):
        raise SchedulerError("sinfo: Unable to contact slurm controller", argv=["sinfo"])
    ended.sched.list_nodes = down
    ended.until(94)
    (verdict,) = ended.verdicts()
    assert verdict["blame"] != "node" and verdict["nodes"] == []


def test_a_job_that_completed_lists_no_nodes_for_reasons(tmp_path):
    ended = Ended(tmp_path, state="COMPLETED")
    listed = ended.sched.node_listings
    ended.until(18)
    assert len(ended.verdicts()) == 1
    # the node state poll may list; the verdict itself asked for nothing more
    assert ended.sched.node_listings - listed <= 1


# NHC quotes what it found (a process, a file, a user): a job's user can choose
# those words. Neither a kernel line spelled into them nor another check's name
# is read: the check at the start decides.
@pytest.mark.parametrize("hostile", [
    "NHC: check_ps_unauth_users:  process NVRM: Xid (PCI:0000:3b:00): 79, pid=1, "
    "GPU has fallen off the bus. owned by mallory is unauthorized",
    "NHC: check_ps_unauth_users:  process NHC: check_gpu_ecc: x owned by mallory is unauthorized",
])
def test_only_nhcs_own_check_at_the_start_is_read_from_an_nhc_reason(tmp_path, hostile):
    ended = Ended(tmp_path)
    ended.sched.nodes = [Node("node1", "MIXED"), drained("node2", hostile, 1500)]
    ended.until(94)
    (verdict,) = ended.verdicts()
    assert (verdict["category"], verdict["nodes"]) == ("system_software", ["node2"])
    assert verdict["reason"].startswith("nhc.check_failed")


def test_a_listing_from_before_the_end_is_not_the_nodes_state_after_it(tmp_path):
    # the node state poll listed the nodes while the attempt waited for its
    # epilog reports; node2's health check (in its epilog) drained it after
    # that listing; its epilog report then ends the wait at once: the verdict
    # lists the nodes again rather than take the older listing
    ended = Ended(tmp_path)
    ended.sched.nodes = [Node("node1", "MIXED"), Node("node2", "MIXED")]
    ended.until(30)                              # the poll lists both, undrained
    polled = ended.sched.node_listings
    ended.sched.nodes = [Node("node1", "MIXED"), drained("node2", SERVICE, 2031)]
    ended.ingest.store_report("epilog", hook_report("epilog", "node2", 12))
    ended.until(2)
    (verdict,) = ended.verdicts()
    assert ended.sched.node_listings == polled + 1
    assert (verdict["action"], verdict["nodes"]) == ("requeue_exclude", ["node2"])

"""Drain reasons fit sinfo -R's 20-character REASON column (``rcv:xid79 #12``);
the full reason stays in our store; drains with the older wording, made before
the upgrade, are still known as ours."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from recovery_agent.act.drains import (DRAIN_TAG, REASON_WIDTH, drain_detail, drain_reason,
                                       ours, slurm_reason)
from recovery_agent.detect.model import CATEGORIES
from tests.unit.test_actuator import (FakeSlurm, add_node_rec, clock, drive,  # noqa: F401
                                      make_actuator, migrated, store)

EVERY_CATEGORY = [*CATEGORIES, "lemon", "straggler", "", "recovered",
                  "a_category_nobody_shortened_yet"]


@pytest.mark.parametrize("category", EVERY_CATEGORY)
@pytest.mark.parametrize("rec_id", [1, 12, 99_999, 10**7, 10**13])
@pytest.mark.parametrize("xid", [None, 13, 79, 119, 9999])
def test_every_reason_fits_the_column_and_keeps_tag_and_id(category, rec_id, xid):
    reason = drain_reason(rec_id, category, xid)
    assert len(reason) <= REASON_WIDTH, reason
    assert reason.startswith(DRAIN_TAG) and reason.endswith(f" #{rec_id}") and ours(reason)
    assert " " not in reason[:-len(f" #{rec_id}")]   # one word, then the id


def test_the_label_is_the_xid_or_a_short_category():
    assert drain_reason(12, "gpu_hardware", 79) == "rcv:xid79 #12"
    assert drain_reason(40, "interconnect") == "rcv:net #40"
    assert drain_reason(7, "nccl_timeout_hang") == "rcv:hang #7"
    assert drain_reason(3, "lemon") == "rcv:lemon #3"
    assert drain_reason(5, "") == "rcv:fault #5"


def rec(**over):
    values = dict(id=12, reason_category="gpu_hardware", reason="gpu_hardware on node2",
                  job_id="4410", evidence=[
                      {"pattern": "nccl.x", "node": "node1", "xid": None},
                      {"pattern": "node.xid", "node": "node1", "xid": 48},
                      {"pattern": "node.xid", "node": "node2", "xid": 79}])
    values.update(over)
    return SimpleNamespace(**values)


def test_the_xid_is_the_drained_nodes_own():
    assert slurm_reason(rec(), "node2") == "rcv:xid79 #12"
    assert slurm_reason(rec(), "node3") == "rcv:xid48 #12"   # none on it: the verdict's first
    assert slurm_reason(rec(evidence={}), "node2") == "rcv:gpu #12"
    # a lemon drain rests on the node's history, not on this job's XID
    assert slurm_reason(rec(reason_category="lemon"), "node2") == "rcv:lemon #12"


def test_the_full_reason_names_the_recommendation_why_xid_and_job():
    assert drain_detail(rec(), "node2") == ("recovery #12 gpu_hardware: gpu_hardware on node2 "
                                            "(xid 79), job 4410")
    assert drain_detail(rec(reason="XID 79 on node2", job_id=None), "node2") == \
        "recovery #12 gpu_hardware: XID 79 on node2"


def test_slurm_gets_the_short_reason_and_the_store_the_full_one(store, clock):  # noqa: F811
    slurm = FakeSlurm()
    rec_id = add_node_rec(store, "drain_node", node="gpu3", reason_category="gpu_hardware",
                          reason="gpu_hardware on gpu3", job_id="4410",
                          evidence=[{"pattern": "node.xid", "node": "gpu3", "xid": 79}])
    drive(make_actuator(store, slurm, clock), store, rec_id, clock)
    node = slurm.get_node("gpu3")
    assert node.reason == f"rcv:xid79 #{rec_id}"
    row = store.node("gpu3")
    assert row["drain_slurm_reason"] == node.reason
    assert row["drain_reason"] == f"recovery #{rec_id} gpu_hardware: gpu_hardware on gpu3 " \
                                  "(xid 79), job 4410"
    # and it is still ours to resume
    resume = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, resume, clock)
    assert store.rec(resume).status == "done" and slurm.calls["resume_node"] == 1


def test_a_drain_made_before_the_upgrade_is_still_ours(store, clock):  # noqa: F811
    slurm = FakeSlurm()
    slurm.drain_by_someone_else("gpu3", "recovery: 7 gpu_hardware", user="root")
    shown = slurm.get_node("gpu3")
    store.set_node("gpu3", drained_by_us=1, drain_reason="recovery: 7 gpu_hardware",
                   drain_slurm_reason=shown.reason, drain_slurm_user=shown.reason_user,
                   drain_slurm_time=shown.reason_time)
    assert ours(shown.reason)
    resume = add_node_rec(store, "resume_node", node="gpu3")
    drive(make_actuator(store, slurm, clock), store, resume, clock)
    assert store.rec(resume).status == "done"
    assert slurm.calls == Counter(resume_node=1)

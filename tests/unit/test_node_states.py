"""The node state history (issue 22, item 8): the watch loop records each change
of a node's availability as it sees it, and ``recovery-ctl report`` scores
monitor mode against that history, so a human drain lifted before the report
ran still counts, and a drain of ours still is ours after it was resumed."""
from __future__ import annotations

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.detect.scanner import Scanner
from recovery_agent.detect.patterns import load_rules
from recovery_agent.errors import SchedulerError
from recovery_agent.inputs.tail import Tailer
from recovery_agent.interfaces.report import build, human_drains
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from recovery_agent.watch.nodestates import NodeStates, availability, changed, seen
from tests.unit.scripted import Script

T0 = 1_800_000_000.0


def node(name, state="IDLE", flags=(), reason="", user="", when=None) -> Node:
    return Node(name, state, frozenset(flags), reason=reason, reason_user=user,
                reason_time=when)


class Sinfo:
    """A node listing the test sets, or that fails."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.fail = False
        self.listings = 0

    def list_nodes(self, names=None):
        self.listings += 1
        if self.fail:
            raise SchedulerError("sinfo: Unable to contact slurm controller", argv=["sinfo"])
        return list(self.nodes)


@pytest.fixture
def rig(tmp_path):
    cfg = from_mapping({"agent": {"cluster": "c1", "node_poll_interval": "30s"}})
    store = Store(tmp_path / "r.db")
    sinfo = Sinfo()
    return cfg, store, sinfo, NodeStates(cfg, store, sinfo)


def history(store) -> list[tuple]:
    return [(r["node"], r["state"], r["reason"], bool(r["ours"]))
            for r in store.db["node_states"].rows_where(order_by="id")]


def test_availability_leaves_allocation_out():
    assert {availability(node("n", s)) for s in ("IDLE", "MIXED", "ALLOCATED")} == {"UP"}
    assert availability(node("n", "MIXED", {"DRAINING"})) == "UP+DRAIN"
    assert availability(node("n", "IDLE", {"DRAINED", "COMPLETING"})) == "UP+DRAIN"
    assert availability(node("n", "DOWN", {"NOT_RESPONDING"})) == "DOWN+NOT_RESPONDING"
    row = seen(node("n", "IDLE", {"DRAIN"}, "GPU 0 dead", "ops", 5), ours=True)
    assert changed({"n": row}, [dict(row)]) == []
    assert changed({"n": {**row, "drained": 1, "ours": 1}}, [row]) == []   # as stored
    assert changed({"n": row}, [{**row, "reason_time": 6}]) == [{**row, "reason_time": 6}]


def test_each_change_is_recorded_once_as_the_poller_sees_it(rig):
    cfg, store, sinfo, states = rig
    sinfo.nodes = [node("node1"), node("node2")]
    assert states.poll(T0) == 2                       # the first sight of each
    sinfo.nodes = [node("node1", "MIXED"), node("node2", "ALLOCATED")]
    assert states.poll(T0 + 10) == 0 and sinfo.listings == 1   # not due yet
    assert states.poll(T0 + 30) == 0                  # allocation is not availability
    sinfo.nodes = [node("node1", "MIXED"),
                   node("node2", "IDLE", {"DRAIN"}, "bad PSU", "ops", int(T0 + 50))]
    assert states.poll(T0 + 60) == 1
    sinfo.fail = True                                 # Slurm does not answer: nothing
    assert states.poll(T0 + 90) == 0
    sinfo.fail, sinfo.nodes = False, []               # an empty listing: nothing either
    assert states.poll(T0 + 120) == 0
    sinfo.nodes = [node("node1"), node("node2")]      # the human lifted the drain
    assert states.poll(T0 + 150) == 1
    assert history(store) == [("node1", "UP", None, False), ("node2", "UP", None, False),
                              ("node2", "UP+DRAIN", "bad PSU", False),
                              ("node2", "UP", None, False)]
    # a restarted agent goes on from the store: nothing unchanged is written again
    again = NodeStates(cfg, store, sinfo)
    assert again.poll(T0 + 200) == 0
    assert from_mapping({"agent": {"node_poll_interval": 0}}).agent.node_poll_interval == 0
    off = NodeStates(from_mapping({"agent": {"node_poll_interval": 0}}), store, sinfo)
    assert off.poll(T0 + 300) == 0 and sinfo.listings == 7   # off: not even listed


def test_the_report_counts_a_human_drain_lifted_before_it_ran(rig):
    cfg, store, sinfo, states = rig
    pk = _job(store)
    with store.lock:
        rec = store.add_recommendation({
            "job": pk, "attempt": 0, "job_id": "4410", "scope": "node", "action": "drain_node",
            "rule": "x", "reason": "xid 79", "target_nodes": ["node2"], "exclude": [],
            "mode": "monitor", "status": "would_have"})
        store.update_rec(rec, created=T0 + 10)
    ours = "rcv:xid79 #3"
    sinfo.nodes = [node("node1"), node("node2"), node("node3")]
    states.poll(T0)
    # a human drains node2; the agent drains node3 (its record says so)
    sinfo.nodes = [node("node1"), node("node2", "IDLE", {"DRAIN"}, "GPU 0 dead", "ops",
                                         int(T0 + 20)),
                   node("node3", "IDLE", {"DRAIN"}, ours, "root", int(T0 + 25))]
    store.set_node("node3", drained_by_us=1, drain_reason=ours, drain_slurm_reason=ours,
                   drain_slurm_user="root", drain_slurm_time=int(T0 + 25))
    states.poll(T0 + 30)
    # both lifted (ours resumed by the agent, its record let go) before the report
    sinfo.nodes = [node("node1"), node("node2"), node("node3")]
    store.set_node("node3", drained_by_us=0)
    states.poll(T0 + 60)
    report = build(store, sinfo.nodes, T0 - 60, T0 + 120, "c1")
    assert report.human_nodes == {"node2": "GPU 0 dead (ops), lifted since"}
    assert report.our_nodes == {"node2"} and report.recall == 1.0 and report.precision == 1.0
    # a drain before the window, or another cluster's, is not the window's
    assert build(store, sinfo.nodes, T0 + 21, T0 + 120, "c1").human_nodes == {}
    assert build(store, sinfo.nodes, T0 - 60, T0 + 120, "c2").human_nodes == {}


def test_a_drain_still_in_place_reads_as_before(rig):
    _, store, sinfo, states = rig
    drained = node("node2", "IDLE", {"DRAIN"}, "GPU 0 dead", "ops", int(T0))
    sinfo.nodes = [drained]
    states.poll(T0)
    assert build(store, [drained], T0 - 1, T0 + 1, "c1").human_nodes == {
        "node2": "GPU 0 dead (ops)"}
    # seen first unowned, a moment later as ours (the agent's record landed after
    # the poll): the drain is ours
    rows = [{"node": "node4", "drained": 1, "reason": "rcv:net #4", "reason_time": 7,
             "ours": 0}, {"node": "node4", "drained": 1, "reason": "rcv:net #4",
                          "reason_time": 7, "ours": 1}]
    assert human_drains(rows, [], 0, 10, {}) == {}


def test_the_watch_loop_records_node_states_each_interval(tmp_path):
    from tests.unit.test_watch import MemoryCursorStore
    clock = [T0]
    cfg = from_mapping({"agent": {"cluster": "c1", "node_poll_interval": "30s"}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    sched.nodes = [node("node1"), node("node2", "DOWN", {"NOT_RESPONDING"})]
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0])
    watcher.cycle()
    sched.nodes = [node("node1"), node("node2")]
    clock[0] += 2
    watcher.cycle()                                   # within the interval: not listed
    clock[0] += 30
    watcher.cycle()
    assert history(store) == [("node1", "UP", None, False),
                              ("node2", "DOWN+NOT_RESPONDING", None, False),
                              ("node2", "UP", None, False)]


def _job(store) -> int:
    job = Job(job_id="4410", numeric_id=4410, submit_time=1000, restart_count=0, user="ana",
              name="t", state="FAILED")
    with store.lock:
        pk = store.record_job(job, "c1", env="prod", mode="", spec="prod")
        store.record_attempt(pk, job)
    return pk

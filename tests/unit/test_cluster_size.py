"""The decider's cluster size (the exclusion check's node count) comes from a
listing under SIZE_TTL seconds old: its own, or the node state poll's when
that is newer, so one parse of a big listing serves both (issue 21)."""
from __future__ import annotations

from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import SIZE_TTL, Decider
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.base import Node
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script
from tests.unit.test_policy import FakeScheduler, rig


class Counting(FakeScheduler):
    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.listings = 0

    def list_nodes(self, names=None):
        self.listings += 1
        return super().list_nodes(names)


def nodes(count: int) -> list[Node]:
    return [Node(f"p{i}", "IDLE") for i in range(count)]


def test_a_recent_poll_listing_serves_without_a_listing_of_its_own(tmp_path):
    sched = Counting(20)
    r = rig(tmp_path, scheduler=sched)
    r.decider.polled_nodes = lambda: (r.now - 10, nodes(7))
    assert r.decider.node_facts(("n1",), r.now).cluster_nodes == 7
    assert sched.listings == 0


def test_an_old_or_future_poll_listing_is_not_taken(tmp_path):
    sched = Counting(20)
    r = rig(tmp_path, scheduler=sched)
    r.decider.polled_nodes = lambda: (r.now - SIZE_TTL - 1, nodes(7))
    assert r.decider.node_facts(("n1",), r.now).cluster_nodes == 20
    assert sched.listings == 1
    r2 = rig(tmp_path / "b", scheduler=Counting(20))
    r2.decider.polled_nodes = lambda: (r2.now + 30, nodes(7))   # another clock's time
    assert r2.decider.node_facts(("n1",), r2.now).cluster_nodes == 20


def test_its_own_newer_listing_wins_over_an_older_poll(tmp_path):
    sched = Counting(20)
    r = rig(tmp_path, scheduler=sched)
    polled = [None]
    r.decider.polled_nodes = lambda: polled[0]
    assert r.decider.node_facts(("n1",), r.now).cluster_nodes == 20   # listed here, at now
    polled[0] = (r.now - 5, nodes(7))                                   # older than that
    assert r.decider.node_facts(("n1",), r.now).cluster_nodes == 20
    assert sched.listings == 1


def test_the_watch_loop_hands_the_decider_its_poll_listing(tmp_path):
    from recovery_agent.store import Store
    from tests.unit.test_watch import MemoryCursorStore
    clock = [1_800_000_000.0]
    cfg = from_mapping({"agent": {"cluster": "c1", "node_poll_interval": "30s"}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    sched.nodes = nodes(3)
    decider = Decider(cfg, store, sched, clock=lambda: clock[0])
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0], decider=decider)
    assert decider.polled_nodes() is None
    watcher.cycle()
    listed, polled = decider.polled_nodes()
    assert listed == clock[0] and [n.name for n in polled] == ["p0", "p1", "p2"]
    sched.nodes = nodes(5)                  # the decider takes the poll's, not a new one
    clock[0] += 10
    assert decider.node_facts(("p0",), clock[0]).cluster_nodes == 3

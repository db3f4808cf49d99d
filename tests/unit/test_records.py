"""The typed recommendation: its statuses, its lifecycle moves, and its way
through the store and out to the API."""
from __future__ import annotations

import json

import pytest

from recovery_agent.store import FINAL_STATUSES, OPEN_STATUSES, Store
from recovery_agent.store.records import MOVES, IllegalMove, Recommendation, Status


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "s.db")


def make(status: str = "proposed", **kw) -> Recommendation:
    return Recommendation.from_row({"id": 3, "job": 1, "attempt": 0, "action": "requeue",
                                    "mode": "action", "status": status, "created": 1.0, **kw})


# -- statuses -------------------------------------------------------------------------
def test_open_and_final_are_the_lists_the_code_had():
    assert OPEN_STATUSES == ("proposed", "executing")
    assert FINAL_STATUSES == ("done", "failed", "expired", "would_have", "blocked_by_budget",
                              "released_by_watchdog", "cancelled")
    assert set(OPEN_STATUSES) | set(FINAL_STATUSES) == set(Status)
    assert not set(OPEN_STATUSES) & set(FINAL_STATUSES)
    assert all(s.is_open and not s.is_final for s in OPEN_STATUSES)
    assert all(s.is_final and not s.is_open for s in FINAL_STATUSES)


def test_a_status_reads_prints_and_serialises_as_its_word():
    done = Status.DONE
    assert done == "done" and done in ("done", "failed") and {"done": 1}[done] == 1
    assert str(done) == f"{done}" == "%s" % done == "done"
    assert json.dumps({"s": done}) == '{"s": "done"}'
    assert Status("would_have") is Status.WOULD_HAVE


# -- the lifecycle --------------------------------------------------------------------
LEGAL = {
    ("proposed", "executing"), ("proposed", "failed"), ("proposed", "expired"),
    ("proposed", "released_by_watchdog"), ("proposed", "cancelled"),
    ("executing", "done"), ("executing", "failed"), ("executing", "expired"),
    ("executing", "released_by_watchdog"), ("executing", "cancelled"),
    ("executing", "proposed"),
}


def move(rec: Recommendation, to: Status) -> Recommendation:
    """The method that makes the move to ``to``."""
    if to == Status.EXECUTING:
        return rec.executing()
    if to == Status.PROPOSED:
        return rec.claim_expired()
    return rec.finished(to)


def test_the_moves_are_exactly_those_that_happen():
    assert {(a.value, b.value) for a, targets in MOVES.items() for b in targets} == LEGAL


@pytest.mark.parametrize("pair", sorted(LEGAL))
def test_every_legal_move(pair):
    before = make(pair[0])
    after = move(before, Status(pair[1]))
    assert after.status == pair[1] and isinstance(after.status, Status)
    assert before.status == pair[0]                       # frozen: the old one stays
    assert (after.id, after.action, after.job) == (before.id, before.action, before.job)


@pytest.mark.parametrize("pair", sorted((a.value, b.value) for a in Status for b in Status
                                        if (a.value, b.value) not in LEGAL))
def test_every_illegal_move_is_refused(pair):
    with pytest.raises(IllegalMove):
        move(make(pair[0]), Status(pair[1]))


def test_the_moves_carry_their_columns():
    claimed = make().executing("uid:0", 50.0)
    assert (claimed.status, claimed.claimed_by, claimed.claim_expires) == \
        ("executing", "uid:0", 50.0)
    again = claimed.claim_expired()
    assert (again.status, again.claimed_by, again.claim_expires) == ("proposed", None, None)
    done = make("executing", next_try=9.0, held_at=4.0).finished(
        Status.DONE, done_at=7.0, next_try=None, held_at=None)
    assert (done.done_at, done.error, done.next_try, done.held_at) == (7.0, None, None, None)
    failed = make("executing").finished(Status.FAILED, error="no")
    assert (failed.status, failed.error, failed.done_at) == ("failed", "no", None)
    tried = make("executing").retrying(2, 30.0)
    assert (tried.tries, tried.next_try, tried.status) == (2, 30.0, "executing")
    held = make("executing").held(12.0)
    assert held.held_at == 12.0 and held.hold_lifted().held_at is None


def test_bookkeeping_on_an_ended_one_is_refused_but_a_late_release_is_not():
    ended = make("failed", held_at=3.0)
    with pytest.raises(IllegalMove):
        ended.retrying(1)
    with pytest.raises(IllegalMove):
        ended.held(5.0)
    assert ended.hold_lifted().held_at is None and ended.hold_lifted().status == "failed"


def test_a_record_is_frozen():
    with pytest.raises(AttributeError):
        make().status = Status.DONE


# -- through the store and out --------------------------------------------------------
FULL = {"job": None, "attempt": 2, "action": "requeue_exclude", "target_nodes": ["n1"],
        "reason_category": "gpu_hardware", "mode": "action", "status": "proposed",
        "error": None, "actor": "agent", "job_id": "42", "cluster": "c1", "env": "prod",
        "scope": "job", "rule": "hardware", "reason": "XID 79", "trigger": "ended",
        "attribution": {"blame": "node", "nodes": ["n1"]}, "pattern_ids": ["xid.79"],
        "exclude": ["n1", "n2"], "restart_at": 2, "submit_time": 1700, "parent": None,
        "evidence": [{"pattern": "xid.79", "lines": [{"text": "Xid 79"}]}],
        "failure_at": 5.0, "detected_at": 6.0, "workload": "train", "user": "ana"}


def legacy(store: Store, pk: int) -> dict:
    """The dict the store gave before the type: the row, JSON columns decoded."""
    row = store.db["recommendations"].get(pk)
    for key in ("target_nodes", "evidence", "attribution", "pattern_ids", "exclude"):
        row[key] = json.loads(row[key]) if row.get(key) else (
            {} if key in ("attribution", "evidence") else [])
    return row


def test_round_trip_through_the_store(store):
    pk = store.add_recommendation(FULL)
    rec = store.rec(pk)
    assert isinstance(rec, Recommendation) and rec.id == pk
    assert rec.status is Status.PROPOSED
    assert rec.target_nodes == ("n1",) and rec.exclude == ("n1", "n2")
    assert rec.pattern_ids == ("xid.79",) and rec.attribution["nodes"] == ["n1"]
    assert rec.evidence == FULL["evidence"] and rec.tries == 0 and rec.scope == "job"
    assert store.recommendations(OPEN_STATUSES) == [rec]
    assert store.recommendations(Status.PROPOSED) == [rec] == store.recommendations("proposed")
    assert store.recommendations(FINAL_STATUSES) == []


def test_to_dict_is_the_old_dict_key_for_key(store):
    full = store.add_recommendation(FULL)
    bare = store.add_recommendation({"action": "drain_node", "mode": "monitor",
                                     "status": "would_have", "scope": "node"})
    for pk in (full, bare):
        old, new = legacy(store, pk), store.rec(pk).to_dict()
        assert list(new) == list(old) and new == old
        assert json.dumps(new) == json.dumps(old)                 # the API's bytes
        assert type(new["status"]) is str and type(new["target_nodes"]) is list
    assert store.rec(bare).evidence == {} and store.rec(bare).target_nodes == ()


def test_save_writes_the_named_columns_of_a_move(store):
    pk = store.add_recommendation(FULL)
    rec = store.rec(pk)
    with store.transaction():
        store.save_rec(rec.executing(), "status")
    assert store.rec(pk).status == "executing"
    ended = store.rec(pk).finished(Status.FAILED, error="timed out", next_try=None)
    with store.transaction():
        store.save_rec(ended, "status", "error", "next_try")
    stored = store.rec(pk)
    assert (stored.status, stored.error) == ("failed", "timed out")
    assert store.db["recommendations"].get(pk)["status"] == "failed"   # a plain word
    assert stored.exclude == ("n1", "n2")                              # untouched

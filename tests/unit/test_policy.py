"""The policy table (recovery_agent.decide.policy, pure functions) and the Decider that
feeds it from the store and writes its outcome (recovery_agent.decide.decider), on a
temp SQLite store with a fake scheduler. No Slurm, no network."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from recovery_agent.config import from_mapping
from recovery_agent.decide.decider import Decider
from recovery_agent.detect.model import Detection, Evidence, Verdict
from recovery_agent.errors import SchedulerError
from recovery_agent.decide.policy import (BudgetState, Decision, History, Limits, NodeFacts,
                                          Strike, decide, drain_budget, effective_mode,
                                          lemon_score, voiced)
from recovery_agent.scheduler.base import Job, Node
from recovery_agent.store import Store
from slurm_hooks import spec as specs


def node_verdict(category: str | None, *nodes: str, action: str = "requeue_exclude",
                 reason: str = "evidence") -> Verdict:
    return Verdict("node", category, action, 0.9, nodes=nodes, reason=reason)


UNKNOWN = Verdict("unknown", None, "none", 0.0, reason="no failure evidence")
APP = Verdict("application", "application", "stop", 0.8, reason="ValueError: bad config")
HANG = Verdict("unknown", "nccl_timeout_hang", "kill_requeue", 0.5, reason="no progress")


# -- policy.decide: the table, row by row ----------------------------------------

@pytest.mark.parametrize("state", ["COMPLETED", "CANCELLED", "PREEMPTED"])
@pytest.mark.parametrize("verdict", [UNKNOWN, APP, node_verdict("gpu_hardware", "n1"), HANG],
                         ids=["none", "stop", "node", "hang"])
def test_completed_cancelled_or_preempted_gets_nothing(state, verdict):
    d = decide(verdict, state=state)
    assert d.action == "none" and d.rule == state.lower()
    assert not d.acts and d.exclude == () and d.drain == ()


def test_application_blame_stops():
    d = decide(APP, history=History(restarts=0))
    assert (d.action, d.rule, d.category) == ("stop", "application", "application")
    assert d.reason.endswith("ValueError: bad config")
    assert d.acts and d.exclude == ()


def test_verdict_action_stop_stops_even_without_application_blame():
    v = Verdict("unknown", "oom", "stop", 0.7, reason="")
    d = decide(v)
    assert (d.action, d.rule) == ("stop", "application")
    assert not d.reason.endswith(":") and not d.reason.endswith(" ")


def test_retry_budget_spent_stops():
    v = node_verdict("gpu_hardware", "n1")
    d = decide(v, history=History(restarts=3), limits=Limits(max_restarts=3))
    assert (d.action, d.rule) == ("stop", "retry_budget")
    assert "3 of 3" in d.reason and d.drain == () and d.blamed == ()
    assert decide(v, history=History(restarts=2), limits=Limits(max_restarts=3)).action \
        == "requeue_exclude"


def test_no_new_checkpoint_over_k_attempts_stops_only_when_tracking_checkpoints():
    tracked = History(attempts_without_ckpt=3, tracks_checkpoints=True)
    d = decide(UNKNOWN, history=tracked, limits=Limits(no_progress_attempts=3))
    assert (d.action, d.rule) == ("stop", "no_progress")
    assert "3 attempts" in d.reason
    # below K, not tracked, or the rule disabled: no stop for lack of progress
    for history, k in [(replace(tracked, attempts_without_ckpt=2), 3),
                       (replace(tracked, tracks_checkpoints=False), 3),
                       (tracked, 0)]:
        d = decide(UNKNOWN, history=history, limits=Limits(no_progress_attempts=k))
        assert d.rule != "no_progress" and d.action == "requeue"


def test_gpu_hardware_requeues_without_the_node_and_drains_it():
    d = decide(node_verdict("gpu_hardware", "n1", reason="xid 79"))
    assert (d.action, d.rule, d.category) == ("requeue_exclude", "hardware", "gpu_hardware")
    assert d.exclude == ("n1",) and d.drain == ("n1",) and d.blamed == ("n1",)
    assert "n1" in d.reason and "xid 79" in d.reason


def test_gpu_hardware_without_drain_hardware_only_excludes():
    d = decide(node_verdict("gpu_hardware", "n1"), limits=Limits(drain_hardware=False))
    assert (d.action, d.rule) == ("requeue_exclude", "hardware")
    assert d.exclude == ("n1",) and d.drain == ()


@pytest.mark.parametrize("strikes,k,drained", [
    ({}, 2, ()), ({"n1": 1}, 2, ()), ({"n1": 2}, 2, ("n1",)), ({"n1": 5}, 2, ("n1",)),
    ({"n1": 9}, 0, ()),   # 0 never drains
])
def test_interconnect_excludes_and_drains_only_after_k_strikes(strikes, k, drained):
    d = decide(node_verdict("interconnect", "n1", "n2"),
               limits=Limits(interconnect_strikes=k),
               facts=NodeFacts(interconnect_strikes={**strikes, "n2": 0}))
    assert (d.action, d.rule) == ("requeue_exclude", "interconnect")
    assert d.exclude == ("n1", "n2") and d.drain == drained


def test_other_failure_naming_a_node_excludes_without_drain():
    d = decide(node_verdict("system_software", "n4"))
    assert (d.action, d.rule) == ("requeue_exclude", "node")
    assert d.exclude == ("n4",) and d.drain == () and d.blamed == ("n4",)


def test_hang_naming_no_node_kills_while_running_and_requeues_once_ended():
    running = decide(HANG, trigger="hang", state="RUNNING")
    assert (running.action, running.rule) == ("kill_requeue", "hang")
    assert running.exclude == () and running.blamed == ()
    ended = decide(HANG, trigger="ended", state="FAILED")
    assert (ended.action, ended.rule) == ("requeue", "hang")
    # an NCCL timeout category alone is enough, whatever the verdict's action
    timeout = Verdict("unknown", "nccl_timeout_hang", "requeue", 0.5)
    assert decide(timeout).rule == "hang"


def test_straggler_is_only_recorded_unless_the_environment_allows_a_kill():
    v = Verdict("node", "straggler", "kill_requeue", 0.6, nodes=("slow1",))
    d = decide(v, trigger="straggler", state="RUNNING")
    assert (d.action, d.rule) == ("none", "straggler_recorded")
    assert not d.acts and d.blamed == ("slow1",) and d.exclude == ()
    d = decide(v, trigger="straggler", state="RUNNING",
               limits=Limits(straggler_action="kill_requeue"),
               history=History(excluded=("old1",)))
    assert (d.action, d.rule) == ("kill_requeue", "straggler")
    assert d.exclude == ("slow1", "old1") and d.blamed == ("slow1",) and d.drain == ()


@pytest.mark.parametrize("history", [History(restarts=3),
                                     History(attempts_without_ckpt=3, tracks_checkpoints=True)],
                         ids=["retry_budget", "no_progress"])
def test_straggler_without_retries_left_is_left_running(history):
    # a "stop" on a running job cancels it: a slow job that still advances
    # must not be cancelled because no requeue is left for it
    v = Verdict("node", "straggler", "kill_requeue", 0.6, nodes=("slow1",))
    d = decide(v, trigger="straggler", state="RUNNING", history=history,
               limits=Limits(max_restarts=3, straggler_action="kill_requeue"))
    assert d.action == "none" and not d.acts
    assert d.blamed == ("slow1",) and d.exclude == ()
    # a hang with nothing left to try is still stopped (its nodes are freed)
    assert decide(HANG, trigger="hang", state="RUNNING", history=history).action == "stop"


def test_unknown_failure_requeues_until_unknown_max_restarts_then_stops():
    d = decide(UNKNOWN, history=History(unknown_requeues=0),
               limits=Limits(unknown_max_restarts=1))
    assert (d.action, d.rule) == ("requeue", "unknown") and d.blamed == ()
    d = decide(UNKNOWN, history=History(unknown_requeues=1),
               limits=Limits(unknown_max_restarts=1))
    assert (d.action, d.rule) == ("stop", "unknown_budget")
    assert "unknown_max_restarts=1" in d.reason
    d = decide(UNKNOWN, history=History(unknown_requeues=1),
               limits=Limits(unknown_max_restarts=2))
    assert d.action == "requeue"
    # while the job runs, no evidence means nothing to act on
    d = decide(UNKNOWN, trigger="hang", state="RUNNING")
    assert (d.action, d.rule) == ("none", "no_evidence")


def test_timeout_stops():
    d = decide(UNKNOWN, state="TIMEOUT")
    assert (d.action, d.rule, d.category) == ("stop", "time_limit", "timeout")
    # a timeout with evidence of a hang is not just a time limit
    assert decide(HANG, state="TIMEOUT").rule == "hang"


def test_slurms_out_of_memory_state_stops_a_failure_the_log_does_not_explain():
    d = decide(UNKNOWN, state="OUT_OF_MEMORY")
    assert (d.action, d.rule, d.category) == ("stop", "out_of_memory", "oom")
    # exit reports and symptoms alone are what the OOM kill left behind
    exits = Verdict(blame="unknown", category=None, action="requeue", confidence=0.5,
                    unexplained=True, reason="slurm.task_exit at line 1: task 0: Killed")
    d = decide(exits, state="OUT_OF_MEMORY")
    assert (d.action, d.rule) == ("stop", "out_of_memory") and "task 0: Killed" in d.reason
    # the same failure in another state is still an unexplained requeue
    assert decide(exits, state="FAILED").action == "requeue"
    # a cause the log names keeps its own decision (a lost GPU before the kill)
    assert decide(node_verdict("gpu_hardware", "b1"), state="OUT_OF_MEMORY").action \
        == "requeue_exclude"


def test_decision_acts():
    assert Decision("requeue", "r", "x").acts
    assert Decision("stop", "r", "x").acts
    assert not Decision("none", "r", "x").acts


# -- exclusions -------------------------------------------------------------------

def test_exclusions_are_blamed_then_history_then_lemons_then_operator_deduplicated():
    d = decide(node_verdict("system_software", "b1"),
               history=History(excluded=("e1", "b1", "e2")),
               facts=NodeFacts(lemons=("l1", "e2"), drained_by_us=("l1",),
                               operator_excluded=("o1", "l1")))
    assert d.exclude == ("b1", "e1", "e2", "l1", "o1") and d.dropped == ()


def test_exclusions_are_dropped_from_the_end_so_the_job_still_fits():
    facts = NodeFacts(lemons=("l1",), operator_excluded=("o1",), cluster_nodes=5)
    history = History(excluded=("e1",), nodes_needed=2)
    d = decide(node_verdict("system_software", "b1"), history=history, facts=facts)
    assert d.exclude == ("b1", "e1", "l1") and d.dropped == ("o1",)
    assert facts.cluster_nodes - len(d.exclude) >= history.nodes_needed
    d = decide(node_verdict("system_software", "b1"), history=history,
               facts=replace(facts, cluster_nodes=4))
    assert d.exclude == ("b1", "e1") and d.dropped == ("l1", "o1")
    # unknown cluster size: nothing dropped
    d = decide(node_verdict("system_software", "b1"), history=history,
               facts=replace(facts, cluster_nodes=None))
    assert d.exclude == ("b1", "e1", "l1", "o1") and d.dropped == ()


def test_blamed_nodes_are_never_dropped():
    d = decide(node_verdict("gpu_hardware", "b1", "b2"),
               history=History(excluded=("e1",), nodes_needed=3),
               facts=NodeFacts(operator_excluded=("o1",), cluster_nodes=3))
    assert d.exclude == ("b1", "b2") and d.dropped == ("e1", "o1")
    assert d.drain == ("b1", "b2")
    # unexplained failures blame nobody: everything may go
    d = decide(UNKNOWN, history=History(excluded=("e1",), nodes_needed=3),
               facts=NodeFacts(lemons=("l1",), cluster_nodes=3))
    assert d.exclude == () and d.dropped == ("e1", "l1")


def test_lemons_are_drained_unless_we_drained_them_already():
    d = decide(node_verdict("gpu_hardware", "b1"),
               facts=NodeFacts(lemons=("l1", "l2", "b1"), drained_by_us=("l2",)))
    assert d.exclude == ("b1", "l1", "l2")
    assert d.drain == ("b1", "l1")
    d = decide(UNKNOWN, facts=NodeFacts(lemons=("l1",)))
    assert d.action == "requeue" and d.exclude == ("l1",) and d.drain == ("l1",)
    # a stop drains nothing
    assert decide(APP, facts=NodeFacts(lemons=("l1",))).drain == ()


# -- effective_mode -----------------------------------------------------------------

@pytest.mark.parametrize("env,job,expected", [
    ("action", None, "action"), ("action", "monitor", "monitor"),
    ("action", "external", "external"), ("action", "action", "action"),
    ("external", "monitor", "monitor"), ("external", "action", "external"),
    ("monitor", "action", "monitor"), ("monitor", "external", "monitor"),
    ("action", "", "action"), ("external", "bogus", "external"),
])
def test_a_job_can_lower_its_mode_but_never_raise_it(env, job, expected):
    assert effective_mode(env, job) == expected


# -- lemon_score ----------------------------------------------------------------------

def test_lemon_score_halves_per_half_life():
    now, h = 1_000_000.0, 3600.0
    assert lemon_score([], now, h) == 0.0
    assert lemon_score([(now, 1.0)], now, h) == 1.0
    assert lemon_score([(now - h, 1.0)], now, h) == 0.5
    assert lemon_score([(now - 2 * h, 2.0)], now, h) == 0.5
    assert lemon_score([(now, 1.0), (now - h, 1.0), (now - 3 * h, 0.5)], now, h) \
        == pytest.approx(1.5625)


def test_lemon_score_counts_future_strikes_as_now():
    now, h = 1_000_000.0, 3600.0
    assert lemon_score([(now + 10 * h, 1.0)], now, h) == 1.0
    assert lemon_score([(now + 5, 0.5), (now - h, 1.0)], now, h) == 1.0


# -- drain_budget ------------------------------------------------------------------------

def test_drain_budget_per_hour_cap():
    assert drain_budget((), BudgetState(drains_last_hour=3), 4, 10.0) == ""
    why = drain_budget((), BudgetState(drains_last_hour=4), 4, 10.0)
    assert "policy.max_drains_per_hour=4" in why and "4 drain(s)" in why
    assert "policy.max_drains_per_hour=0" in drain_budget((), BudgetState(), 0, 100.0)


def test_drain_budget_per_partition_percent_cap():
    state = BudgetState(partition_sizes={"gpu": 20, "debug": 2},
                        drained_by_us={"gpu": 1})
    assert drain_budget(("gpu",), state, 10, 10.0) == ""        # 2 of 20 = 10%
    full = replace(state, drained_by_us={"gpu": 2})
    why = drain_budget(("gpu",), full, 10, 10.0)                   # 3 of 20 = 15%
    assert "partition gpu" in why and "3 of 20" in why
    assert "policy.max_drained_percent=10" in why
    # every partition of the node counts; the small one blocks
    why = drain_budget(("gpu", "debug"), state, 10, 10.0)
    assert "partition debug" in why and "policy.max_drained_percent" in why
    # partitions of unknown size are not held against the node
    assert drain_budget(("other",), state, 10, 10.0) == ""
    assert drain_budget(("debug",), state, 10, 50.0) == ""       # 1 of 2 = 50%


# -- Decider: from a verdict to stored recommendations -------------------------------------

class FakeScheduler:
    name = "fake"

    def __init__(self, count: int = 20, error: Exception | None = None) -> None:
        self.nodes = [Node(f"n{i}", "IDLE", partitions=("gpu",)) for i in range(1, count + 1)]
        self.error = error

    def list_nodes(self, names=None):
        if self.error is not None:
            raise self.error
        return list(self.nodes)


_TEMPLATE: list[bytes] = []


def fresh_store(path) -> Store:
    """A migrated store at ``path``: the migrations run once per module, then
    each test starts from a copy of that empty store."""
    if not _TEMPLATE:
        template = path.parent / "template.db"
        Store(template).close()
        _TEMPLATE.append(template.read_bytes())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_TEMPLATE[0])
    return Store(path)


def rig(tmp_path, mode: str = "action", count: int = 20, env: dict | None = None,
        scheduler=None, **policy):
    now = time.time()
    cfg = from_mapping({"agent": {"cluster": "c1"}, "policy": policy,
                        "environments": {"prod": {"mode": mode, **(env or {})}}})
    store = fresh_store(tmp_path / "r.db")
    assert store.migrations_run == []
    sched = scheduler or FakeScheduler(count)
    decider = Decider(cfg, store, sched, clock=lambda: now)
    woken: list[int] = []
    decider.on_new_work.append(lambda: woken.append(1))
    return SimpleNamespace(store=store, decider=decider, now=now, woken=woken)


def slurm_job(job_id: str = "77", restarts: int = 0, state: str = "FAILED",
              nodes: tuple[str, ...] = ("n1", "n2"), **kw) -> Job:
    base = dict(job_id=job_id, numeric_id=int(job_id), name="train", user="alice",
                state=state, submit_time=1000, start_time=1001, nodes=nodes,
                restart_count=restarts, comment="recovery=prod")
    base.update(kw)
    return Job(**base)


def register(r, job: Job, spec: str = "prod") -> int:
    pk = r.store.record_job(job, "c1", env="prod", mode="action", spec=spec)
    for attempt in range(job.restart_count + 1):
        r.store.record_attempt(pk, replace(job, restart_count=attempt))
    return pk


def run(r, pk: int, job: Job, verdict: Verdict, spec: str = "prod", trigger: str = "ended",
        detections=(), **kw):
    kw.setdefault("started", r.now - 600)
    return r.decider.decide_attempt(pk, job.restart_count, specs.parse(spec), verdict,
                                    trigger=trigger, job=job, nodes=job.nodes,
                                    detections=list(detections), **kw)


XID = Detection(rule="xid.79", category="gpu_hardware", severity="critical",
                action_hint="requeue_exclude",
                evidence=(Evidence("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus",
                                   source="hook:n1/epilog", line=3),),
                host="n1", gpu="0000:3b:00", xid=79, role="root")
HW = Verdict("node", "gpu_hardware", "requeue_exclude", 0.95, nodes=("n1",),
             gpus=("0000:3b:00",), rests_on=(0,), reason="xid.79: GPU has fallen off the bus")


def events(r, pk: int, kind: str) -> list[dict]:
    return [e for e in r.store.timeline(pk) if e["kind"] == kind]


def test_action_mode_stores_a_proposed_recommendation_with_its_audit(tmp_path):
    r = rig(tmp_path)
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    assert out.mode == "action" and out.decision.action == "requeue_exclude"
    rec = r.store.job_rec(pk, 0)
    assert out.recs[0] == rec.id and len(out.recs) == 2
    assert rec.status == "proposed" and rec.mode == "action"
    assert (rec.scope, rec.action, rec.rule) == ("job", "requeue_exclude", "hardware")
    assert rec.target_nodes == ("n1",) and rec.exclude == ("n1",)
    assert rec.evidence == [{
        "pattern": "xid.79", "category": "gpu_hardware", "node": "n1", "gpu": "0000:3b:00",
        "xid": 79, "lines": [{"text": XID.evidence[0].text, "source": "hook:n1/epilog",
                              "line": 3, "time": None}]}]
    assert rec.pattern_ids == ("xid.79",)
    assert rec.attribution == {"blame": "node", "category": "gpu_hardware",
                                  "confidence": 0.95, "nodes": ["n1"],
                                  "gpus": ["0000:3b:00"], "reason": HW.reason,
                                  "action": "requeue_exclude", "signature": "",
                                  "suspects": [], "unexplained": False, "where": [],
                                  "ran_on": ["n1", "n2"]}
    assert rec.restart_at == 0 and rec.attempt == 0
    assert (rec.job_id, rec.cluster, rec.env, rec.trigger) == \
        ("77", "c1", "prod", "ended")
    assert (rec.user, rec.workload, rec.actor) == ("alice", "train", "agent")
    assert rec.detected_at == r.now and rec.submit_time == 1000
    (event,) = events(r, pk, "recommendation")
    assert event["data"]["rec"] == rec.id and event["data"]["action"] == "requeue_exclude"
    assert event["data"]["mode"] == "action" and event["attempt"] == 0
    assert "drain n1" in event["message"]
    assert r.woken == [1]


def test_monitor_mode_stores_what_would_have_been_done(tmp_path):
    r = rig(tmp_path, mode="monitor")
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    assert out.mode == "monitor"
    recs = r.store.recommendations(job_pk=pk)
    assert [x.status for x in recs] == ["would_have", "would_have"]
    assert [x.action for x in recs] == ["requeue_exclude", "drain_node"]
    assert recs[0].mode == "monitor"
    assert r.store.recommendations(("proposed", "executing")) == []
    assert r.woken == []   # nothing for the actuator
    (event,) = events(r, pk, "recommendation")
    assert "would_have" in event["message"]


def test_an_attempt_is_decided_once_but_its_verdict_event_is_still_written(tmp_path):
    r = rig(tmp_path)
    job = slurm_job()
    pk = register(r, job)
    verdict_event = {"kind": "verdict", "message": "node: gpu_hardware -> requeue_exclude",
                     "attempt": 0, "source": "attribution", "data": {"blame": "node"}}
    assert run(r, pk, job, HW, detections=[XID], verdict_event=dict(verdict_event))
    recs = r.store.recommendations()
    strikes = r.store.strikes()
    assert len(recs) == 2 and len(strikes) == 1
    again = run(r, pk, job, HW, detections=[XID], verdict_event=dict(verdict_event))
    assert again is None
    assert [x.id for x in r.store.recommendations()] == [x.id for x in recs]
    assert len(r.store.strikes()) == 1
    assert len(events(r, pk, "verdict")) == 2
    assert len(events(r, pk, "recommendation")) == 1
    assert r.woken == [1]


def test_a_job_spec_lowers_the_mode_but_cannot_raise_it(tmp_path):
    r = rig(tmp_path, mode="action")
    job = slurm_job()
    pk = register(r, job, spec="prod:monitor")
    out = run(r, pk, job, UNKNOWN, spec="prod:monitor")
    assert out.mode == "monitor" and r.store.job_rec(pk, 0).status == "would_have"
    assert r.store.job_rec(pk, 0).mode == "monitor"

    r = rig(tmp_path / "b", mode="monitor")
    pk = register(r, job, spec="prod:action")
    out = run(r, pk, job, UNKNOWN, spec="prod:action")
    assert out.mode == "monitor" and r.store.job_rec(pk, 0).status == "would_have"


def test_hardware_verdict_makes_a_drain_rec_under_the_job_rec(tmp_path):
    r = rig(tmp_path)
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    job_rec, drain = (r.store.rec(i) for i in out.recs)
    assert drain.scope == "node" and drain.parent == job_rec.id
    assert drain.action == "drain_node" and drain.target_nodes == ("n1",)
    assert drain.status == "proposed" and drain.error is None
    assert drain.rule == "hardware" and drain.reason_category == "gpu_hardware"
    assert drain.exclude == ()
    assert events(r, pk, "blocked_by_budget") == []


def test_drain_over_the_hourly_budget_is_blocked_but_the_requeue_goes_ahead(tmp_path):
    r = rig(tmp_path, max_drains_per_hour=0)
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    job_rec, drain = (r.store.rec(i) for i in out.recs)
    assert job_rec.status == "proposed" and job_rec.action == "requeue_exclude"
    assert drain.status == "blocked_by_budget" and drain.parent == job_rec.id
    assert "policy.max_drains_per_hour=0" in drain.error
    assert drain.reason == drain.error
    (event,) = events(r, pk, "blocked_by_budget")
    assert f"#{drain.id}" in event["message"] and "n1" in event["message"]


def test_drain_over_the_partition_share_is_blocked(tmp_path):
    r = rig(tmp_path, count=4)   # one drain is 25% of the partition (default cap 10%)
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    drain = r.store.rec(out.recs[1])
    assert drain.status == "blocked_by_budget"
    assert "partition gpu" in drain.error and "policy.max_drained_percent" in drain.error


def test_drain_is_blocked_when_slurm_cannot_be_asked(tmp_path):
    r = rig(tmp_path, scheduler=FakeScheduler(error=SchedulerError("sinfo failed")))
    job = slurm_job()
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    assert r.store.rec(out.recs[0]).status == "proposed"
    drain = r.store.rec(out.recs[1])
    assert drain.status == "blocked_by_budget" and "unreachable" in drain.error


def test_no_new_checkpoint_over_three_attempts_stops(tmp_path):
    r = rig(tmp_path)
    job = slurm_job(restarts=2)
    pk = register(r, job, spec="prod,ckpt=/x")
    out = run(r, pk, job, UNKNOWN, spec="prod,ckpt=/x")
    assert (out.decision.action, out.decision.rule) == ("stop", "no_progress")
    rec = r.store.job_rec(pk, 2)
    assert rec.action == "stop" and rec.rule == "no_progress"
    assert rec.status == "proposed" and len(out.recs) == 1

    # a checkpoint in attempt 1: only one attempt without, no stop
    other = slurm_job(job_id="78", restarts=2)
    pk = register(r, other, spec="prod,ckpt=/x")
    r.store.set_attempt_checkpoint(pk, 1, "/x/step-100", 100, r.now - 100)
    assert run(r, pk, other, UNKNOWN, spec="prod,ckpt=/x").decision.rule == "unknown"

    # no ckpt= and no checkpoint ever seen: progress is not tracked
    third = slurm_job(job_id="79", restarts=2)
    pk = register(r, third)
    assert run(r, pk, third, UNKNOWN).decision.rule == "unknown"


def test_checkpoints_seen_before_count_as_tracking_without_ckpt_spec(tmp_path):
    r = rig(tmp_path, env={"no_progress_attempts": 2})
    job = slurm_job(restarts=2)
    pk = register(r, job)
    r.store.set_attempt_checkpoint(pk, 0, "/ckpt/a", 10, r.now - 500)
    out = run(r, pk, job, UNKNOWN)
    assert (out.decision.action, out.decision.rule) == ("stop", "no_progress")


def test_restart_count_at_max_restarts_stops(tmp_path):
    r = rig(tmp_path)   # max_restarts defaults to 3
    job = slurm_job(restarts=3)
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    assert (out.decision.action, out.decision.rule) == ("stop", "retry_budget")
    assert r.store.job_rec(pk, 3).rule == "retry_budget"
    assert len(out.recs) == 1 and r.store.strikes() == []   # no drain, no strike

    # the job's own max-restarts wins over the environment's
    other = slurm_job(job_id="78", restarts=1)
    pk = register(r, other, spec="prod,max-restarts=1")
    out = run(r, pk, other, UNKNOWN, spec="prod,max-restarts=1")
    assert out.decision.rule == "retry_budget" and "1 of 1" in out.decision.reason
    below = slurm_job(job_id="79", restarts=2)
    pk = register(r, below)
    assert run(r, pk, below, UNKNOWN).decision.rule == "unknown"


def test_unexplained_requeues_of_earlier_attempts_count_against_the_unknown_budget(tmp_path):
    r = rig(tmp_path)
    first = slurm_job()
    pk = register(r, first)
    assert run(r, pk, first, UNKNOWN).decision.rule == "unknown"
    second = slurm_job(restarts=1)
    r.store.record_attempt(pk, second)
    out = run(r, pk, second, UNKNOWN)
    assert (out.decision.action, out.decision.rule) == ("stop", "unknown_budget")

    # an unexplained requeue that failed did not happen: it does not count
    first = slurm_job(job_id="78")
    pk = register(r, first)
    out = run(r, pk, first, UNKNOWN)
    r.store.update_rec(out.recs[0], status="failed")
    second = slurm_job(job_id="78", restarts=1)
    r.store.record_attempt(pk, second)
    assert run(r, pk, second, UNKNOWN).decision.rule == "unknown"


def test_exclusions_of_done_recs_and_of_the_job_carry_over(tmp_path):
    r = rig(tmp_path)
    first = slurm_job()
    pk = register(r, first)
    out = run(r, pk, first, HW, detections=[XID])
    r.store.update_rec(out.recs[0], status="done")
    second = slurm_job(restarts=1, excluded_nodes=("n9",), submit_time=2000)
    r.store.record_attempt(pk, second)
    out = run(r, pk, second, UNKNOWN)
    assert out.decision.rule == "unknown"
    rec = r.store.job_rec(pk, 1)
    assert rec.exclude == ("n1", "n9")
    # Slurm renewed the submit time at the requeue: the rec keeps this attempt's
    assert rec.submit_time == 2000 and r.store.job(pk)["submit_time"] == 1000

    # a requeue that never happened (failed) excluded nothing
    first = slurm_job(job_id="78")
    pk = register(r, first)
    out = run(r, pk, first, HW, detections=[XID])
    r.store.update_rec(out.recs[0], status="failed")
    second = slurm_job(job_id="78", restarts=1)
    r.store.record_attempt(pk, second)
    assert run(r, pk, second, UNKNOWN).decision.exclude == ()


def test_exclusions_that_would_not_leave_room_are_given_up_on_the_timeline(tmp_path):
    r = rig(tmp_path, count=3)
    r.store.set_node("n3", excluded_by_operator=1)
    job = slurm_job()   # needs two of the three nodes
    pk = register(r, job)
    out = run(r, pk, job, HW, detections=[XID])
    assert out.decision.exclude == ("n1",) and out.decision.dropped == ("n3",)
    assert r.store.job_rec(pk, 0).exclude == ("n1",)
    (event,) = events(r, pk, "policy")
    assert "n3" in event["message"]


@pytest.mark.parametrize("times,seen,expected", [
    ((3600.0, None), [], 0.0),          # future evidence (skewed node clock), 0 = unknown
    ((-10 * 86400.0,), [], -600.0),     # far in the past: clamped to the attempt's start
    ((-300.0,), [], -300.0),            # within the attempt: the evidence's own time
    ((-300.0,), [-400.0], -400.0),      # the agent saw it earlier still
])
def test_failure_time_is_kept_between_the_attempt_start_and_now(tmp_path, times, seen,
                                                                 expected):
    r = rig(tmp_path)
    job = slurm_job()
    pk = register(r, job)
    started = r.now - 600
    lines = tuple(Evidence(f"line {i}", time=(r.now + t) if t is not None else 0)
                  for i, t in enumerate(times))
    det = Detection(rule="ib.link_down", category="interconnect", evidence=lines, host="n2")
    verdict = Verdict("node", "interconnect", "requeue_exclude", 0.8, nodes=("n2",),
                      rests_on=(0,))
    run(r, pk, job, verdict, detections=[det], started=started,
        seen_at=[r.now + s for s in seen] or None)
    failure_at = r.store.job_rec(pk, 0).failure_at
    assert started <= failure_at <= r.now
    assert failure_at == pytest.approx(r.now + expected)


def test_strikes_are_recorded_and_three_hardware_strikes_make_a_lemon(tmp_path):
    r = rig(tmp_path, lemon_threshold=3, max_drains_per_hour=50, max_drained_percent=100)
    bad = Verdict("node", "gpu_hardware", "requeue_exclude", 0.95, nodes=("n7",),
                  reason="xid 79")
    for i in range(3):
        assert r.decider.node_facts((), r.now).lemons == ()
        job = slurm_job(job_id=str(100 + i), nodes=("n7", "n8"), user=f"u{i}")
        pk = register(r, job)
        run(r, pk, job, bad)
    strikes = r.store.strikes("n7")
    assert [(s["category"], s["weight"], s["ts"]) for s in strikes] == \
        [("gpu_hardware", 1.0, r.now)] * 3
    assert [s["user"] for s in strikes] == ["u0", "u1", "u2"]
    assert r.store.strikes("n8") == []
    assert r.decider.node_facts((), r.now).lemons == ("n7",)

    other = slurm_job(job_id="200", nodes=("n1", "n2"))
    pk = register(r, other)
    out = run(r, pk, other, UNKNOWN)
    assert out.decision.rule == "unknown"
    assert out.decision.exclude == ("n7",) and out.decision.drain == ("n7",)
    job_rec = r.store.job_rec(pk, 0)
    assert job_rec.exclude == ("n7",) and job_rec.target_nodes == ()
    (drain,) = [r.store.rec(i) for i in out.recs[1:]]
    assert (drain.action, drain.rule, drain.reason_category) == \
        ("drain_node", "lemon", "lemon")
    assert drain.target_nodes == ("n7",) and drain.parent == job_rec.id
    assert drain.status == "proposed"

    # once we drained it, a lemon is still excluded but not drained again
    r.store.set_node("n7", drained_by_us=1)
    last = slurm_job(job_id="201", nodes=("n1", "n2"))
    pk = register(r, last)
    out = run(r, pk, last, UNKNOWN)
    assert out.decision.exclude == ("n7",) and out.decision.drain == ()
    assert len(out.recs) == 1


def test_hang_and_straggler_strikes(tmp_path):
    r = rig(tmp_path, env={"straggler_action": "kill_requeue"})
    job = slurm_job(state="RUNNING")
    pk = register(r, job)
    out = run(r, pk, job, HANG, trigger="hang")
    assert (out.decision.action, out.decision.rule) == ("kill_requeue", "hang")
    assert sorted((s["node"], s["category"], s["weight"]) for s in r.store.strikes()) == \
        [("n1", "hang_suspect", 0.25), ("n2", "hang_suspect", 0.25)]

    slow = slurm_job(job_id="78", state="RUNNING")
    pk = register(r, slow)
    verdict = Verdict("node", "straggler", "kill_requeue", 0.6, nodes=("n2",))
    out = run(r, pk, slow, verdict, trigger="straggler")
    assert (out.decision.action, out.decision.rule) == ("kill_requeue", "straggler")
    assert r.store.job_rec(pk, 0).exclude == ("n2",)
    assert [(s["category"], s["weight"]) for s in r.store.strikes("n2")][-1] == \
        ("straggler", 0.5)


def test_interconnect_strikes_in_the_window_drain(tmp_path):
    r = rig(tmp_path, strike_window="1h")   # interconnect_strikes defaults to 2
    r.store.add_strike("n4", "interconnect", 1.0, ts=r.now - 2 * 3600)   # outside
    r.store.add_strike("n4", "system_software", 0.5, ts=r.now - 30)    # not interconnect
    ic = Verdict("node", "interconnect", "requeue_exclude", 0.8, nodes=("n4",))
    job = slurm_job(nodes=("n4", "n5"))
    pk = register(r, job)
    assert run(r, pk, job, ic).decision.drain == ()   # the first in the window
    job = slurm_job(job_id="78", nodes=("n4", "n5"), user="bob")
    pk = register(r, job)
    out = run(r, pk, job, ic)   # the second in the window, another user's
    assert out.decision.drain == ("n4",)
    assert r.store.rec(out.recs[1]).rule == "interconnect"


def test_the_kth_interconnect_failure_on_a_node_drains_it(tmp_path):
    # the failure being decided counts: with interconnect_strikes = K the K-th
    # failure naming the node drains it, not the (K+1)-th
    r = rig(tmp_path, env={"interconnect_strikes": 3}, lemon_threshold=0)  # no lemons
    ic = Verdict("node", "interconnect", "requeue_exclude", 0.8, nodes=("n4",))
    drains = []
    for i in range(3):
        job = slurm_job(job_id=str(80 + i), nodes=("n4", "n5"), user=f"u{i}")
        drains.append(run(r, register(r, job), job, ic).decision.drain)
    assert len(r.store.strikes("n4")) == 3
    assert drains == [(), (), ("n4",)]
    # a failure of another category does not count as an interconnect strike
    hw = Verdict("node", "system_software", "requeue_exclude", 0.8, nodes=("n6",))
    r.store.add_strike("n6", "interconnect", 1.0, user="a", ts=r.now - 60)
    r.store.add_strike("n6", "interconnect", 1.0, user="b", ts=r.now - 50)
    assert r.decider.node_facts(("n6",), r.now, "system_software") \
        .interconnect_strikes == {"n6": 2}
    job = slurm_job(job_id="90", nodes=("n6", "n5"))
    assert run(r, register(r, job), job, hw).decision.drain == ()


def test_one_users_own_output_drains_no_node_however_often_it_says_so(tmp_path):
    """Interconnect failures resting on the job's output alone: five jobs of
    one user naming n4 exclude it from that user's retries every time, but
    count as one strike for draining and as one in the lemon score."""
    r = rig(tmp_path, lemon_threshold=3, max_drains_per_hour=50, max_drained_percent=100)
    ic = Verdict("node", "interconnect", "requeue_exclude", 0.8, nodes=("n4",))
    for i in range(5):
        job = slurm_job(job_id=str(300 + i), nodes=("n4", "n5"), user="mallory")
        out = run(r, register(r, job), job, ic)
        assert out.decision.exclude == ("n4",) and out.decision.drain == ()
    assert len(r.store.strikes("n4")) == 5                       # all on the record
    assert r.decider.scores(r.now)["n4"] == pytest.approx(1.0)   # one voice
    assert r.decider.node_facts(("n4",), r.now).lemons == ()
    # another user's job saying the same thing is a second voice: the drain
    job = slurm_job(job_id="310", nodes=("n4", "n5"), user="alice")
    assert run(r, register(r, job), job, ic).decision.drain == ("n4",)


def test_a_witnessed_strike_counts_each_time(tmp_path):
    """Evidence the job did not write (here an IB link-down line from the
    node's kernel log) is not the user's voice: two such failures of one
    user's jobs drain the node."""
    r = rig(tmp_path, max_drains_per_hour=50, max_drained_percent=100)
    ic = Verdict("node", "interconnect", "requeue_exclude", 0.8, nodes=("n4",), rests_on=(0,))
    link = Detection(rule="ib.link_down", category="interconnect", host="n4", origin="system",
                     severity="critical", evidence=(Evidence("mlx5_core: link down"),))
    drains = []
    for i in range(2):
        job = slurm_job(job_id=str(320 + i), nodes=("n4", "n5"), user="carol")
        drains.append(run(r, register(r, job), job, ic, detections=[link]).decision.drain)
    assert drains == [(), ("n4",)]
    assert [s["witnessed"] for s in r.store.strikes("n4")] == [1, 1]


def test_voiced_keeps_every_witnessed_strike_and_one_per_user():
    strikes = [Strike(1.0, 0.5, "a"), Strike(2.0, 1.0, "a"), Strike(3.0, 1.0, "a"),
               Strike(4.0, 0.25, "b"), Strike(5.0, 1.0, "a", witnessed=True),
               Strike(6.0, 1.0, "a", witnessed=True)]
    assert voiced(strikes) == [Strike(3.0, 1.0, "a"), Strike(4.0, 0.25, "b"),
                               Strike(5.0, 1.0, "a", True), Strike(6.0, 1.0, "a", True)]
    assert voiced([]) == []


def test_old_monitor_mode_drains_do_not_fill_the_partition_share(tmp_path):
    """would-have drains stand in for drains for a day only: months of monitor
    mode must not block every drain after the switch to action."""
    r = rig(tmp_path, mode="monitor", count=10, max_drains_per_hour=100,
            max_drained_percent=10)   # one node in ten may be drained
    job = slurm_job()
    pk = register(r, job)
    run(r, pk, job, HW, detections=[XID])
    (old,) = [x for x in r.store.recommendations(("would_have",))
              if x.action == "drain_node"]
    assert r.decider._over_budget("n2", r.now) != ""          # a day-fresh one counts
    r.store.db.execute("update recommendations set created = ? where id = ?",
                       [r.now - 2 * 86400, old.id])
    r.decider._drained_at.clear()                             # (the hourly ledger)
    assert r.decider._over_budget("n2", r.now) == ""          # a two-day-old one does not


# -- the job's earlier attempts, from the store (History.previous) ----------------------

# vllm6976-watchdog-illegal-memory-access (dev corpus): a CUDA error that may be the GPU
ILLEGAL = Verdict("unknown", "cuda_error", "requeue", 0.8, signature="cuda:illegal_address",
                  reason="cuda.illegal_address: Process group watchdog thread terminated with "
                         "exception: CUDA error: an illegal memory access was encountered")


def test_a_cuda_error_that_follows_the_job_onto_other_nodes_stops_on_its_second_time(tmp_path):
    r = rig(tmp_path)
    first = slurm_job(nodes=("n1", "n2"))
    pk = register(r, first)
    out = run(r, pk, first, ILLEGAL)
    assert (out.decision.action, out.decision.rule) == ("requeue", "requeue")
    assert r.store.job_rec(pk, 0).attribution["signature"] == "cuda:illegal_address"
    second = slurm_job(restarts=1, nodes=("n3", "n4"))
    r.store.record_attempt(pk, second)
    out = run(r, pk, second, ILLEGAL)
    assert (out.decision.action, out.decision.rule) == ("stop", "recurring")
    assert "attempt 0 on n1, n2" in out.decision.reason


def test_a_cuda_error_that_stays_with_a_node_excludes_it_with_a_strike(tmp_path):
    r = rig(tmp_path)
    first = slurm_job(nodes=("n1", "n2"))
    pk = register(r, first)
    run(r, pk, first, ILLEGAL)
    second = slurm_job(restarts=1, nodes=("n2", "n3"))
    r.store.record_attempt(pk, second)
    out = run(r, pk, second, ILLEGAL)
    assert (out.decision.action, out.decision.blamed) == ("requeue_exclude", ("n2",))
    assert [s["node"] for s in r.store.strikes()] == ["n2"]


def test_a_peer_named_by_two_attempts_is_excluded(tmp_path):
    r = rig(tmp_path)
    # ho-nccl1698-ib-status12-intermittent-retry-passes: the peer 192.168.3.5 is n5
    peer = Verdict("unknown", "interconnect", "requeue", 0.8, suspects=("n5",),
                   reason="nccl.ib_completion_from_peer: Got completion from peer "
                          "192.168.3.5<53908> with status=12")
    first = slurm_job(nodes=("n4", "n5"))
    pk = register(r, first)
    assert run(r, pk, first, peer).decision.action == "requeue"
    second = slurm_job(restarts=1, nodes=("n5", "n6"))
    r.store.record_attempt(pk, second)
    out = run(r, pk, second, peer)
    assert (out.decision.action, out.decision.blamed) == ("requeue_exclude", ("n5",))


def test_unexplained_failures_count_against_the_budget_until_a_checkpoint(tmp_path):
    r = rig(tmp_path)
    timeout = Verdict("unknown", "nccl_timeout_hang", "requeue", 0.6, unexplained=True,
                      reason="nccl.watchdog_timeout: Watchdog caught collective operation "
                             "timeout")
    first = slurm_job()
    pk = register(r, first)
    assert run(r, pk, first, timeout).decision.rule == "hang"
    second = slurm_job(restarts=1)
    r.store.record_attempt(pk, second)
    r.store.set_attempt_checkpoint(pk, 1, "/ckpt/step-900", 900, r.now - 60)
    assert run(r, pk, second, timeout).decision.action == "requeue"   # it advanced
    third = slurm_job(restarts=2)
    r.store.record_attempt(pk, third)
    out = run(r, pk, third, timeout)
    assert (out.decision.action, out.decision.rule) == ("stop", "unknown_budget")


def test_a_move_off_a_degraded_node_spends_no_restart(tmp_path):
    # restart count 3 = max_restarts, but one of the three was a move
    # (decide/moves.py), not a failure: the job still has a retry
    r = rig(tmp_path)
    job = slurm_job(restarts=3)
    pk = register(r, job)
    with r.store.lock, r.store.db.atomic():
        r.store.add_recommendation({
            "job": pk, "attempt": 1, "job_id": "77", "scope": "job", "action": "migrate",
            "mode": "action", "status": "done", "trigger": "degraded", "restart_at": 1,
            "exclude": ["n9"], "target_nodes": ["n9"], "rule": "degraded",
            "reason_category": "degraded", "attribution": {
                "blame": "node", "category": "degraded", "nodes": ["n9"],
                "action": "migrate", "ran_on": ["n9"]}})
    out = run(r, pk, job, HW, detections=[XID])
    assert out.decision.action == "requeue_exclude"
    assert "n9" in out.decision.exclude   # the degraded node stays excluded

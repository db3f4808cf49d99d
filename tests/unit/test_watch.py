"""The watch loop's bookkeeping, with a scheduler that replays a script of
listings (the live behaviour is in tests/integration/test_watch_live.py)."""
from __future__ import annotations

from recovery_agent.config import from_mapping
from recovery_agent.detect.patterns import load_rules
from recovery_agent.detect.scanner import Scanner
from recovery_agent.inputs.logline import MemoryCursorStore
from recovery_agent.inputs.tail import Tailer
from recovery_agent.scheduler.base import Job
from recovery_agent.store import Store
from recovery_agent.watch import Watcher
from tests.unit.scripted import Script


def job(state: str, out: str, restarts: int = 0, **kw) -> Job:
    base = dict(job_id="77", numeric_id=77, state=state, submit_time=1000, start_time=1001,
                nodes=("node1", "node2"), comment="recovery=prod", stdout=out, stderr=out,
                restart_count=restarts, user_id=0, group_id=0)
    base.update(kw)
    return Job(**base)


def make(tmp_path, clock):
    cfg = from_mapping({"agent": {"cluster": "c1"}})
    store = Store(tmp_path / "r.db")
    sched = Script()
    watcher = Watcher(cfg, store, sched, Scanner(load_rules(), engine="re"),
                      Tailer(MemoryCursorStore()), clock=lambda: clock[0])
    return watcher, store, sched


def events(store, kind):
    return [e for e in store.timeline(1) if e["kind"] == kind]


def fail_after(tmp_path, nodes, first, last, listed=()):
    """A job on ``nodes`` prints ``first``, runs a cycle, prints ``last`` and
    fails; its verdict's data, and the scheduler (sinfo lists ``listed``)."""
    out = tmp_path / "job-77.out"
    out.write_text("\n".join(first) + "\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.nodes = list(listed)
    sched.jobs = [job("RUNNING", str(out), nodes=nodes)]
    watcher.cycle()
    with open(out, "a") as fh:
        fh.write(last + "\n")
    clock[0] += 2
    watcher.cycle()
    sched.jobs = [job("FAILED", str(out), exit_code=1, nodes=nodes)]
    watcher.cycle()
    clock[0] += 20
    watcher.cycle()
    (verdict,) = events(store, "verdict")
    return verdict["data"], sched


def test_comment_job_is_registered_followed_and_judged(tmp_path):
    out = tmp_path / "train-77.out"
    out.write_text("step 1 loss 2.0\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    assert store.find_job("c1", "77")["env"] == "prod"
    with open(out, "a") as fh:
        fh.write("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    clock[0] += 2
    assert watcher.cycle() >= 1
    (det,) = [d for d in store.detections(1) if d["category"] == "oom"]
    assert det["evidence"]["lines"][0]["line"] == 2
    sched.jobs = [job("FAILED", str(out), exit_code=1)]
    watcher.cycle()
    assert events(store, "verdict") == []  # waiting for the nodes' epilog reports
    clock[0] += 20  # past the grace: no node reports will come here
    watcher.cycle()
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["category"] == "oom" and verdict["data"]["action"] == "stop"


def test_requeued_attempt_gets_its_own_watch_and_verdict(tmp_path):
    out = tmp_path / "o.out"
    out.write_text("")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    sched.jobs = [job("RUNNING", str(out), restarts=1, start_time=2005)]
    watcher.cycle()
    clock[0] += 30
    watcher.cycle()
    assert watcher.watches[1].attempt == 1
    assert [e["attempt"] for e in events(store, "verdict")] == [0]


def test_job_that_ran_between_polls_is_still_judged(tmp_path):
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("PENDING", "")]
    watcher.cycle()
    sched.jobs = [job("NODE_FAIL", "", exit_code=None)]
    watcher.cycle()
    watcher.cycle()
    clock[0] += 20
    watcher.cycle()
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["blame"] == "node"
    assert verdict["data"]["nodes"] == ["node1", "node2"]


def test_output_of_a_job_that_ran_between_polls_is_read(tmp_path):
    out = tmp_path / "quick-77.out"
    out.write_text("Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
                   "KeyError: 'missing'\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    sched.jobs = [job("PENDING", str(out))]
    watcher.cycle()
    sched.jobs = [job("FAILED", str(out), exit_code=1)]
    watcher.cycle()          # seen ended: its output is read
    clock[0] += 2
    watcher.cycle()          # the attempt closes
    clock[0] += 20
    watcher.cycle()          # no epilog reports here: the grace ends
    (verdict,) = events(store, "verdict")
    assert verdict["data"]["blame"] == "application"


def test_log_lines_inside_node_reports_are_scanned(tmp_path):
    from recovery_agent.inputs.ingest import Ingest
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    out = tmp_path / "o.out"
    out.write_text("")
    sched.jobs = [job("RUNNING", str(out))]
    watcher.cycle()
    ingest = Ingest(store, "c1")
    ingest.log_listeners.append(watcher.report_lines)
    ingest.store_report("epilog", {
        "version": 1, "hook": "epilog", "report_id": "a" * 32, "created": 2001.0,
        "cluster": "c1", "node": "node2", "job": {"job_id": "77", "attempt": 0,
                                                  "spec": "prod"},
        "gpus": {"ok": True, "gpus": []}, "xids": [], "exit": {"code": 1},
        "log_lines": [{"text": "slurmstepd: error: Detected 1 oom_kill event in "
                               "StepId=77.0. Some of the step tasks have been OOM Killed.",
                       "source": "slurmd"}]})
    clock[0] += 2
    watcher.cycle()
    (det,) = [d for d in store.detections(1) if d["category"] == "oom"]
    assert det["source"] == "hook:node2/epilog:slurmd"


# -- finding 11: the verdict waits, bounded, for late node evidence -----------------
# A node whose epilog could not reach the agent spools its report; the replay
# comes later (the epilog's replayer, the next health check). The verdict of its
# attempt waits for it when the node sent the attempt's prolog report.

XID79 = {"xid": 79, "kind": "xid", "pci": "0000:28:00", "time": 1500.0,
         "message": "GPU has fallen off the bus.",
         "raw": "2026-11-29T08:00:00+0000 node2 kernel: NVRM: Xid (PCI:0000:28:00): 79, "
                "pid=42, name=python, GPU has fallen off the bus."}


def hook_report(hook: str, node: str, n: int, xids=(), delivery=None) -> dict:
    body = {"version": 1, "hook": hook, "report_id": f"{n:032x}", "created": 1500.0,
            "cluster": "c1", "node": node,
            "job": {"job_id": "77", "attempt": 0, "spec": "prod"},
            "gpus": {"ok": True, "gpus": []}, "xids": [dict(x) for x in xids]}
    if hook == "epilog":
        body["exit"] = {"code": 1, "signal": None}
    if delivery is not None:
        body["delivery"] = delivery
    return body


class Ended:
    """A two-node job that ran (prologs from ``prologs``) and ended ``state``,
    with node1's epilog report in; ``until(clock)`` runs cycles up to then."""

    def __init__(self, tmp_path, state="FAILED", prologs=("node1", "node2"), decider=False,
                 node1_xids=()):
        from recovery_agent.inputs.ingest import Ingest
        self.clock = [2000.0]
        self.watcher, self.store, self.sched = make(tmp_path, self.clock)
        if decider:
            from recovery_agent.decide.decider import Decider
            self.watcher.decider = Decider(self.watcher.cfg, self.store,
                                           clock=lambda: self.clock[0])
        out = tmp_path / "o.out"
        out.write_text("")
        self.sched.jobs = [job("RUNNING", str(out))]
        self.watcher.cycle()
        self.ingest = Ingest(self.store, "c1")
        for n, node in enumerate(prologs, start=1):
            self.ingest.store_report("prolog", hook_report("prolog", node, n))
        self.sched.jobs = [job(state, str(out), exit_code=1)]
        self.watcher.cycle()
        self.ingest.store_report("epilog", hook_report("epilog", "node1", 11, node1_xids))

    def until(self, seconds: float, step: float = 2.0) -> None:
        end = self.clock[0] + seconds
        while self.clock[0] < end:
            self.clock[0] += step
            self.watcher.cycle()

    def verdicts(self) -> list[dict]:
        return [e["data"] for e in events(self.store, "verdict")]

    def messages(self, kind: str) -> list[str]:
        return [e["message"] for e in events(self.store, kind)]


def test_verdict_waits_for_the_spooled_epilog_report_of_a_node_that_reported(tmp_path):
    ended = Ended(tmp_path)
    ended.until(30)                       # past the 15 s grace
    assert ended.verdicts() == []         # node2 sent its prolog: its epilog is awaited
    (wait,) = ended.messages("node_report_wait")
    assert "node2" in wait and "90s" in wait
    late = {"spooled_at": 2001.0, "tries": 3, "by": "health"}
    ended.ingest.store_report("epilog", hook_report("epilog", "node2", 12, [XID79], late))
    ended.until(2)
    (verdict,) = ended.verdicts()
    assert (verdict["blame"], verdict["category"], verdict["action"], verdict["nodes"]) == \
        ("node", "gpu_hardware", "requeue_exclude", ["node2"])
    assert ended.messages("node_report_missing") == []
    (arrival,) = [m for m in ended.messages("hook_epilog") if "node2" in m]
    assert arrival.startswith("late epilog report from node2 (spooled ")
    assert "3 tries, replayed by the health check" in arrival


def test_the_wait_is_bounded_and_the_timeline_says_it_decided_without(tmp_path):
    ended = Ended(tmp_path)
    ended.until(80)
    assert ended.verdicts() == []
    ended.until(14)                       # 90 s after the end (agent.node_report_wait)
    (verdict,) = ended.verdicts()
    assert verdict["blame"] == "unknown"
    (missing,) = ended.messages("node_report_missing")
    assert missing.startswith("deciding without the epilog report of node2")
    assert len(ended.messages("node_report_wait")) == 1   # said once, not every cycle


def test_the_bound_is_the_config_key(tmp_path):
    from dataclasses import replace
    ended = Ended(tmp_path)
    watcher = ended.watcher
    watcher.cfg = replace(watcher.cfg, agent=replace(watcher.cfg.agent, node_report_wait=40.0))
    ended.until(30)
    assert ended.verdicts() == []
    ended.until(14)
    assert len(ended.verdicts()) == 1 and ended.messages("node_report_missing")


def test_no_wait_for_a_node_that_never_reported_this_attempt(tmp_path):
    ended = Ended(tmp_path, prologs=("node1",))
    ended.until(18)
    assert len(ended.verdicts()) == 1
    assert ended.messages("node_report_wait") == []


def test_no_wait_when_a_fatal_xid_already_blames_a_node(tmp_path):
    ended = Ended(tmp_path, node1_xids=[dict(XID79, raw=XID79["raw"].replace("node2", "node1"))])
    ended.until(18)
    (verdict,) = ended.verdicts()
    assert verdict["nodes"] == ["node1"] and ended.messages("node_report_wait") == []


def test_no_wait_for_node_fail_or_states_policy_leaves_alone(tmp_path):
    for state in ("NODE_FAIL", "COMPLETED", "CANCELLED"):
        root = tmp_path / state
        root.mkdir()
        ended = Ended(root, state=state)
        ended.until(18)
        assert len(ended.verdicts()) == 1, state
        assert ended.messages("node_report_wait") == [], state


def test_all_epilog_reports_in_means_no_wait_at_all(tmp_path):
    ended = Ended(tmp_path)
    ended.ingest.store_report("epilog", hook_report("epilog", "node2", 12))
    ended.until(2)
    assert len(ended.verdicts()) == 1     # not even the grace


def test_a_fatal_xid_arriving_after_the_verdict_counts_against_its_node_once(tmp_path):
    ended = Ended(tmp_path, decider=True)
    ended.until(94)                       # decided without node2's report
    (verdict,) = ended.verdicts()
    assert verdict["blame"] == "unknown"
    late = {"spooled_at": 2010.0, "tries": 5, "by": "prolog"}
    ended.ingest.store_report("epilog", hook_report("epilog", "node2", 12, [XID79], late))
    (arrival,) = [m for m in ended.messages("hook_epilog") if "node2" in m]
    assert arrival.endswith("after this attempt's verdict")
    ended.until(4)
    (note,) = ended.messages("late_evidence")
    assert "fatal XID 79" in note and "counted against node2" in note
    strikes = [s for s in ended.store.strikes("node2") if s["category"] == "gpu_hardware"]
    assert len(strikes) == 1 and strikes[0]["weight"] == 1.0
    assert len(ended.verdicts()) == 1     # the verdict stands
    ended.until(4)
    assert len(ended.store.strikes("node2")) == 1 and len(ended.messages("late_evidence")) == 1


# printenv in a Slurm step, quoted on the Open MPI users list (tests/unit/test_node_naming.py)
SLURM_ENV = ["SLURM_NODELIST=borgo[086,140]", "SLURM_NTASKS_PER_NODE=4", "SLURM_NNODES=2",
             "SLURM_NTASKS=8", "SLURM_TASKS_PER_NODE=4(x2)"]
# dev:vllm6976-watchdog-illegal-memory-access
RANK0_LINE = ("[rank0]:[E1012 11:34:10.718322889 ProcessGroupNCCL.cpp:1515] [PG 3 Rank 0] Process "
              "group watchdog thread terminated with exception: CUDA error: an illegal memory "
              "access was encountered")


def test_the_verdict_knows_the_layout_the_log_states(tmp_path, monkeypatch):
    """The agent's verdict gets the rank -> host map the job's own log states,
    as `patterns score` does offline: a rank-prefixed error names its node."""
    import recovery_agent.watch.verdicts as watch_module
    seen = []
    real = watch_module.attribute
    monkeypatch.setattr(watch_module, "attribute",
                        lambda found, context=None: seen.append(context) or real(found, context))
    nodes = ("borgo086", "borgo140")
    verdict, _ = fail_after(tmp_path, nodes, [*SLURM_ENV, "step 1 loss 2.0"], RANK0_LINE)
    assert verdict["category"] == "cuda_error"
    context = seen[-1]
    assert context.nodes == nodes                 # Slurm's list, not the log's
    assert context.rank_hosts[0] == "borgo086" and context.rank_hosts[7] == "borgo140"


def test_layout_lines_keep_only_what_states_the_layout_and_are_bounded():
    from recovery_agent.detect.context import LayoutLines
    kept = LayoutLines(cap=16)
    for line in ["step 1 loss 2.0", *SLURM_ENV, "epoch 3 done"]:
        kept.feed(line)
    assert kept.lines == [SLURM_ENV[0], SLURM_ENV[1], SLURM_ENV[4]]   # lists, tasks per node
    for _ in range(100):
        kept.feed(RANK0_LINE)            # a chatty rank-prefixed job: at most cap // 8
    assert len(kept.lines) == 3 + 2
    for _ in range(100):
        kept.feed("SLURM_NODELIST=borgo[086,140]")
    assert len(kept.lines) == 16
    assert kept.context(nodes=("a",)).nodes == ("a",)


# NVIDIA/nccl#1182-style IB completion error naming its peer by IP address (the
# rule's own example in etc/patterns/nccl.toml)
PEER_LINE = ("node-2:5776:5902 [0] transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion "
             "from peer 10.2.0.5<33092> with error 12, opcode 0, len")


def peer_failure(tmp_path, nodes):
    """The job runs on the first two of ``nodes`` (which sinfo lists)."""
    return fail_after(tmp_path, tuple(n.name for n in nodes[:2]), ["step 1 loss 2.0"],
                      PEER_LINE, listed=nodes)


def test_an_nccl_peer_address_names_the_node_slurm_gives_that_address(tmp_path):
    from recovery_agent.scheduler.base import Node
    nodes = [Node("node-1", "ALLOCATED", address="10.2.0.5", hostname="node-1.cluster"),
             Node("node-2", "ALLOCATED", address="10.2.0.6", hostname="node-2.cluster")]
    verdict, sched = peer_failure(tmp_path, nodes)
    assert verdict["category"] == "interconnect" and verdict["nodes"] == ["node-1"]
    # the node poll's at the start, then one after the end (for the nodes'
    # drain reasons), which the addresses reuse
    assert sched.node_listings == 2


def test_an_address_slurm_gives_no_job_node_or_several_names_none(tmp_path):
    from recovery_agent.scheduler.base import Node
    # node-3 has the address but is not the job's; a one-machine test cluster
    # gives all its nodes one address: neither may be blamed through it
    for i, nodes in enumerate([
            [Node("node-1", "ALLOCATED", address="10.2.0.7"),
             Node("node-2", "ALLOCATED", address="10.2.0.6"),
             Node("node-3", "IDLE", address="10.2.0.5")],
            [Node("node-1", "ALLOCATED", address="10.2.0.5"),
             Node("node-2", "ALLOCATED", address="10.2.0.5")]]):
        (tmp_path / str(i)).mkdir()
        verdict, _ = peer_failure(tmp_path / str(i), nodes)
        assert "node-3" not in verdict["nodes"] and "node-1" not in verdict["nodes"]


def test_a_node_that_becomes_degraded_gets_its_moves_planned_once(tmp_path):
    from recovery_agent.decide.decider import Decider
    from recovery_agent.scheduler.base import Node
    out = tmp_path / "job-77.out"
    out.write_text("step 1\n")
    clock = [2000.0]
    watcher, store, sched = make(tmp_path, clock)
    watcher.decider = Decider(watcher.cfg, store, sched, clock=lambda: clock[0])
    # 12 nodes: one drain is within max_drained_percent (10%)
    sched.nodes = [Node(f"node{i}", "MIXED", partitions=("gpu",)) for i in range(1, 13)]
    sched.jobs = [job("RUNNING", str(out), comment="recovery=prod,ckpt-signal=USR1")]
    watcher.cycle()
    assert store.recommendations() == []
    store.add_degradation("c1", {"node": "node2", "gpu": "0", "time": 2000.0, "score": 1.0,
                                 "level": "degraded", "previous_level": "watch",
                                 "rules": [{"rule": "row_remap_pending", "weight": 1.0}]})
    clock[0] += 2
    watcher.cycle()
    recs = store.recommendations()
    # the default environment: proactive = monitor, mode monitor -> recorded only
    assert sorted((r.action, r.status) for r in recs) == [("drain_node", "would_have"),
                                                          ("migrate", "would_have")]
    clock[0] += 2
    watcher.cycle()   # the same degradation is not planned for again
    assert len(store.recommendations()) == 2
    assert store.get_state("moves_cursor") > 0

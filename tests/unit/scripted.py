"""A scheduler that replays what a test scripts: the jobs squeue lists and the
nodes sinfo lists (with their Slurm addresses), for the watch loop's tests."""
from __future__ import annotations

from recovery_agent.scheduler.base import Job, Node


class Script:
    def __init__(self, jobs=None) -> None:
        self.jobs: list[Job] = list(jobs or [])
        self.nodes: list[Node] = []
        self.node_listings = 0

    def list_jobs(self, job_ids=None):
        return list(self.jobs)

    def list_nodes(self, names=None):
        self.node_listings += 1
        return [n for n in self.nodes if names is None or n.name in names]


def scripted_watcher(cfg, store, sched, clock=None, watcher_class=None):
    """A watch loop over ``sched`` with the shipped rules (re engine), an
    in-memory tailer and, when ``clock`` (a one-item list) is given, a clock
    that the test moves for both the loop and its decider."""
    from recovery_agent.decide.decider import Decider
    from recovery_agent.detect.patterns import load_rules
    from recovery_agent.detect.scanner import Scanner
    from recovery_agent.inputs.logline import MemoryCursorStore
    from recovery_agent.inputs.tail import Tailer
    from recovery_agent.watch import Watcher

    timed = {} if clock is None else {
        "clock": lambda: clock[0],
        "decider": Decider(cfg, store, None, clock=lambda: clock[0])}
    return (watcher_class or Watcher)(cfg, store, sched, Scanner(load_rules(), engine="re"),
                                      Tailer(MemoryCursorStore()), **timed)

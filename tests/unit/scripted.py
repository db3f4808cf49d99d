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

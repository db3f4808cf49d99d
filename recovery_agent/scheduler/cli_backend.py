"""The scheduler backend that drives Slurm's own client commands.

Reads come from one ``squeue --json`` or ``sinfo --json`` call per request,
whatever the number of jobs or nodes asked for; writes are single ``scontrol``
or ``scancel`` calls. This is the backend CI exercises against a live cluster.
"""
from __future__ import annotations

import json
import re
from typing import Iterable, Sequence

import hostlist

from ..errors import JobNotFound, NodeNotFound, SchedulerError
from .base import Job, ListingCheck, Node, Probe, exact_or_first, select_jobs
from .cli_parse import parse_nodes_text, parse_scontrol_job, parse_squeue_text
from .runner import SlurmRunner

try:   # orjson (the "fast" extra) parses a 10,000-job squeue listing ~3x faster
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - depends on the install
    _loads = json.loads

_JOB_MISSING = re.compile(r"invalid job id|job id .* not found|no such job", re.I)
_NODE_MISSING = re.compile(r"invalid node name|node .* not found", re.I)
REQUIRED_COMMANDS = ("squeue", "sinfo", "scontrol", "scancel")


class CliScheduler:
    """Slurm through ``squeue``/``sinfo``/``scontrol``/``scancel``, via one argv seam."""

    name = "cli"

    def __init__(self, runner: SlurmRunner | None = None) -> None:
        self.runner = runner or SlurmRunner()
        self._parsed: dict = {}   # unchanged squeue records are not parsed twice
        self.listings = ListingCheck()

    # -- viability ---------------------------------------------------------
    def probe(self) -> Probe:
        missing = [c for c in REQUIRED_COMMANDS if self.runner.resolve(c) is None]
        if missing:
            return Probe(self.name, False, f"Slurm client commands not found: "
                         f"{', '.join(missing)} (install slurm-client or set "
                         f"scheduler.bin_dir)")
        try:
            version = self.runner.run(["sinfo", "--version"], timeout=10).stdout.split()[-1]
            self.runner.run(["scontrol", "ping"], timeout=15)
        except SchedulerError as exc:
            return Probe(self.name, False, f"slurmctld not reachable: {exc}")
        except IndexError:
            return Probe(self.name, False, "sinfo --version printed nothing")
        return Probe(self.name, True, "", version)

    # -- reads ---------------------------------------------------------------
    def _parse(self, argv: list[str], parse) -> list:
        """Run a listing command and parse its text; output that is not JSON is
        a SchedulerError naming the command."""
        proc = self.runner.run(argv, binary=True)
        try:
            return parse(proc.stdout)
        except json.JSONDecodeError as exc:   # orjson's error is a subclass
            raise SchedulerError(f"{' '.join(argv)}: output is not JSON "
                                 f"({getattr(exc, 'msg', None) or exc})",
                                 argv=argv, returncode=proc.returncode,
                                 stderr=proc.stderr) from None

    def list_jobs(self, job_ids: Iterable[str] | None = None) -> list[Job]:
        # 22.05 ignores -j with --json, so the filter is always applied here; one
        # call per cycle either way.
        argv = ["squeue", "--json", "--all", "--states=all"]
        try:
            jobs = self._parse(argv, lambda text: parse_squeue_text(text, self._parsed, _loads))
        except ValueError as exc:
            raise SchedulerError(f"squeue --json: {exc}", argv=argv) from None
        self.listings.check(jobs, self.lookup_job)
        return select_jobs(jobs, job_ids)

    def get_job(self, job_id: str) -> Job:
        found = self.list_jobs([job_id])
        if not found:
            raise JobNotFound(f"job {job_id} not found", argv=["squeue", "--json"])
        return exact_or_first(found, job_id)

    def list_nodes(self, names: Iterable[str] | None = None) -> list[Node]:
        argv = ["sinfo", "--json"]
        try:
            nodes = self._parse(argv, lambda text: parse_nodes_text(text, _loads))
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise SchedulerError(f"sinfo --json: unexpected output ({exc})",
                                 argv=argv) from None
        if names is None:
            return nodes
        wanted = set(names)
        return [n for n in nodes if n.name in wanted]

    def lookup_job(self, job_id: str) -> Job:
        """One job by a targeted query (``scontrol show job -o``), not the
        listing: what confirms that a job the listing lacks is really gone."""
        argv = ["scontrol", "show", "job", "-o", str(job_id)]
        try:
            proc = self.runner.run(argv)
        except SchedulerError as exc:
            if _JOB_MISSING.search(exc.stderr or ""):
                raise JobNotFound(f"job {job_id} not found", exc.argv, exc.returncode,
                                  exc.stderr) from None
            raise
        job = parse_scontrol_job(proc.stdout)
        if job is None:
            raise SchedulerError(f"{' '.join(argv)}: no job in the answer", argv=argv,
                                 returncode=proc.returncode, stderr=proc.stderr)
        return job

    def get_node(self, name: str) -> Node:
        found = self.list_nodes([name])
        if not found:
            raise NodeNotFound(f"node {name} not found", argv=["sinfo", "--json"])
        return found[0]

    # -- writes --------------------------------------------------------------
    def _change(self, argv: list[str], missing: re.Pattern[str],
                not_found: type[SchedulerError]) -> None:
        """Run one state-changing command; Slurm's "no such job/node" becomes
        the typed ``not_found`` error."""
        try:
            self.runner.run(argv)
        except SchedulerError as exc:
            if missing.search(exc.stderr):
                raise not_found(str(exc), exc.argv, exc.returncode, exc.stderr) from None
            raise

    def _job_cmd(self, argv: list[str]) -> None:
        self._change(argv, _JOB_MISSING, JobNotFound)

    def _node_cmd(self, argv: list[str]) -> None:
        self._change(argv, _NODE_MISSING, NodeNotFound)

    def requeue_hold(self, job_id: str) -> None:
        self._job_cmd(["scontrol", "requeuehold", str(job_id)])

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        value = hostlist.collect_hostlist(list(nodes)) if nodes else ""
        self._job_cmd(["scontrol", "update", f"jobid={job_id}", f"ExcNodeList={value}"])

    def allow_requeue(self, job_id: str) -> None:
        self._job_cmd(["scontrol", "update", f"jobid={job_id}", "Requeue=1"])

    def release(self, job_id: str) -> None:
        self._job_cmd(["scontrol", "release", str(job_id)])

    def start_now(self, job_id: str) -> None:
        self._job_cmd(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        self._job_cmd([*argv, str(job_id)])

    def signal_job(self, job_id: str, signal: str, batch: bool = False) -> None:
        if not signal:
            raise ValueError("a signal is needed")
        argv = ["scancel", f"--signal={signal}", *(["--batch"] if batch else [])]
        self._job_cmd([*argv, str(job_id)])

    def drain_node(self, name: str, reason: str) -> None:
        if not reason.strip():
            raise ValueError("a drain needs a reason")
        self._node_cmd(["scontrol", "update", f"nodename={name}", "state=DRAIN",
                        f"reason={reason}"])

    def resume_node(self, name: str) -> None:
        self._node_cmd(["scontrol", "update", f"nodename={name}", "state=RESUME"])

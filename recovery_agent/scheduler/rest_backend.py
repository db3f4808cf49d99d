"""The scheduler backend over slurmrestd, Slurm's REST API.

It speaks 22.05's OpenAPI v0.0.38 and the data_parser versions v0.0.40 to
v0.0.45 (24.11 to 26.05), and picks the newest one the server offers. What an
operation uses depends on what that version has, read from the server's own
OpenAPI document (``/openapi/v3``), not from a table of releases:

===================  ===========================  ==================================
operation            v0.0.38 (22.05)              v0.0.40+ (23.11 .. 26.05)
===================  ===========================  ==================================
list/get jobs        ``GET jobs/``                ``GET jobs/``
lookup one job       ``GET job/{id}``             ``GET job/{id}``
nodes                ``GET nodes/``, ``node/{n}``  ``GET nodes/``, ``node/{n}``
exclude, start now,  ``POST job/{id}``            ``POST job/{id}``
release, requeue=1   (``exclude_nodes``,           (``excluded_nodes``, ``begin_time``,
                     ``begin_time``, ``hold``)     ``hold``, ``requeue``)
cancel / signal      ``DELETE job/{id}``          ``DELETE job/{id}``
requeue and hold     none                         ``GET job/{id}/requeue?Hold``
                                                  (only where offered: v0.0.45)
drain / resume       none                         ``POST node/{n}``
===================  ===========================  ==================================

Where the version has no endpoint for an operation, ``scheduler.rest_fallback``
decides: ``cli`` (the default) runs the same step as the CLI backend does,
through the one argv seam (``scontrol requeuehold``, ``scontrol update
nodename=...``), with a log line saying so; ``none`` makes it a
SchedulerError naming the missing endpoint. Nothing is ever silently skipped.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import hostlist

from ..errors import JobNotFound, NodeNotFound, RecoveryError, SchedulerError
from .base import Job, ListingCheck, Node, Probe, exact_or_first, select_jobs
from .cli_backend import CliScheduler
from .cli_parse import parse_nodes, parse_squeue
from .rest_client import RestClient, RestSettings, job_path, node_path
from .runner import SlurmRunner

log = logging.getLogger(__name__)

_JOB_MISSING = re.compile(r"invalid job id|unable to find jobid|job id .* not found|"
                          r"no such job|\(error 2017\)", re.I)
_NODE_MISSING = re.compile(r"invalid node name|node .* not found|failure to query node", re.I)


class Api:
    """The negotiated version and what it offers."""

    def __init__(self, version: str, paths: Mapping[str, Any]) -> None:
        self.version = version
        self.paths = paths

    def offers(self, tail: str, method: str) -> bool:
        entry = self.paths.get(f"/slurm/{self.version}/{tail}")
        return isinstance(entry, Mapping) and method in entry

    @property
    def legacy(self) -> bool:
        """22.05's v0.0.38: job updates go through sbatch's option names."""
        return self.version == "v0.0.38"


class RestScheduler:
    """Slurm through slurmrestd (see the module docstring for the endpoints)."""

    name = "rest"

    def __init__(self, settings: RestSettings, runner: SlurmRunner | None = None,
                 client: RestClient | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.runner = runner or SlurmRunner()
        self._client = client
        self._api: Api | None = None
        self._lock = threading.Lock()
        self._parsed: dict = {}
        self.clock = clock
        self.listings = ListingCheck()
        self.fallback = CliScheduler(self.runner)

    @property
    def client(self) -> RestClient:
        if self._client is None:
            self._client = RestClient(self.settings, self.runner)
        return self._client

    def api(self) -> Api:
        with self._lock:
            if self._api is None:
                version, paths = self.client.choose_version()
                self._api = Api(version, paths)
                log.info("slurmrestd %s: speaking OpenAPI %s", self.settings.url, version)
            return self._api

    def _request(self, method: str, path: str, **kw) -> dict:
        """One call in the negotiated version. A 404 (slurmrestd restarted with
        other versions?) makes the next call ask the server again."""
        api = self.api()
        try:
            return self.client.request(method, path, version=api.version, **kw)
        except SchedulerError as exc:
            if exc.returncode == 404:
                with self._lock:
                    self._api = None
            raise

    def _get(self, path: str, query: Mapping[str, Any] | None = None) -> dict:
        return self._request("GET", f"/slurm/{self.api().version}/{path}", query=query)

    # -- viability -------------------------------------------------------------
    def probe(self) -> Probe:
        if not self.settings.url:
            return Probe(self.name, False, "scheduler.rest_url is not set (the slurmrestd "
                         "to use: http://host:6820 or unix:/path/to/socket)")
        try:
            api = self.api()
            doc = self._get("ping/")
        except SchedulerError as exc:
            with self._lock:
                self._api = None
            return Probe(self.name, False, f"slurmrestd not usable: {exc}")
        except (RecoveryError, OSError, ValueError) as exc:   # bad settings: say so
            return Probe(self.name, False, f"slurmrestd settings: {exc}")
        missing = self._missing_without_fallback(api)
        if missing:
            return Probe(self.name, False, f"slurmrestd OpenAPI {api.version} has no "
                         f"endpoint for {', '.join(missing)} and scheduler.rest_fallback "
                         f"cannot run them: {self._fallback_reason()}")
        return Probe(self.name, True, "", _release(doc) or api.version)

    def _missing_without_fallback(self, api: Api) -> list[str]:
        missing = [what for what, ok in (("requeue", api.offers("job/{job_id}/requeue", "get")),
                                         ("node drain/resume",
                                          api.offers("node/{node_name}", "post")))
                   if not ok]
        if not missing or not self._fallback_reason():
            return []
        return missing

    def _fallback_reason(self) -> str:
        """Why the CLI fallback cannot run here ("" when it can)."""
        if self.settings.fallback != "cli":
            return f"rest_fallback is {self.settings.fallback!r}"
        if self.runner.resolve("scontrol") is None:
            return "scontrol not found (install slurm-client, set scheduler.bin_dir or ssh_host)"
        return ""

    # -- reads -------------------------------------------------------------------
    def list_jobs(self, job_ids: Iterable[str] | None = None) -> list[Job]:
        doc = self._get("jobs/")
        try:
            jobs = parse_squeue(doc, self._parsed)
        except ValueError as exc:
            raise SchedulerError(f"slurmrestd GET jobs/: {exc}",
                                 argv=["GET", f"/slurm/{self.api().version}/jobs/"]) from None
        self.listings.check(jobs, self.lookup_job)
        return select_jobs(jobs, job_ids)

    def get_job(self, job_id: str) -> Job:
        found = self.list_jobs([job_id])
        if not found:
            raise JobNotFound(f"job {job_id} not found",
                              argv=["GET", f"/slurm/{self.api().version}/jobs/"])
        return exact_or_first(found, job_id)

    def lookup_job(self, job_id: str) -> Job:
        """One job by ``GET job/{id}``, never from the listing. The pending
        rest of an array (``12_[3-5%2]``) has no id of its own: it is looked up
        through its array job, whose answer holds every task."""
        job_id = str(job_id)
        asked = job_id.split("_", 1)[0] if "_[" in job_id else job_id
        api = self.api()
        path = job_path(api.version, asked)
        try:
            doc = self._request("GET", path)
        except SchedulerError as exc:
            raise _typed(exc, _JOB_MISSING, JobNotFound) from None
        try:
            jobs = parse_squeue(doc)
        except ValueError as exc:
            raise SchedulerError(f"slurmrestd GET {path}: {exc}", argv=["GET", path]) from None
        if not jobs:
            # not found comes with an error entry; an empty answer proves nothing
            raise SchedulerError(f"slurmrestd GET {path}: no job and no error in the answer",
                                 argv=["GET", path])
        exact = next((j for j in jobs if j.job_id == job_id), None)
        if exact is None and asked != job_id:
            raise JobNotFound(f"job {job_id} not found: array {asked} has no such pending "
                              f"tasks any more", argv=["GET", path])
        if exact is None and "_" in job_id:
            # 23.11+ answers a task's lookup with every task of its array: a task
            # that is not among them is gone, never a sibling (an update would
            # then go to the sibling's own job id)
            raise JobNotFound(f"job {job_id} not found: its array's answer lacks it",
                              argv=["GET", path])
        return exact or jobs[0]

    def list_nodes(self, names: Iterable[str] | None = None) -> list[Node]:
        doc = self._get("nodes/")
        try:
            nodes = parse_nodes(doc)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            raise SchedulerError(f"slurmrestd GET nodes/: unexpected answer ({exc})",
                                 argv=["GET", f"/slurm/{self.api().version}/nodes/"]) from None
        if names is None:
            return nodes
        wanted = set(names)
        return [n for n in nodes if n.name in wanted]

    def get_node(self, name: str) -> Node:
        path = node_path(self.api().version, name)
        try:
            doc = self._request("GET", path)
        except SchedulerError as exc:
            raise _typed(exc, _NODE_MISSING, NodeNotFound) from None
        found = [n for n in parse_nodes(doc) if n.name == name]
        if not found:
            raise NodeNotFound(f"node {name} not found", argv=["GET", path])
        return found[0]

    # -- writes --------------------------------------------------------------------
    def _change(self, method: str, path: str, missing: re.Pattern[str],
                not_found: type[SchedulerError], *, body: Mapping[str, Any] | None = None,
                query: Mapping[str, Any] | None = None, benign=None) -> None:
        try:
            doc = self._request(method, path, body=body, query=query, changes=True,
                                benign=benign)
            refused = _refusals(doc)
            if refused:
                raise SchedulerError(f"slurmrestd {method} {path}: {refused[0]}",
                                     argv=[method, path], stderr="\n".join(refused))
        except SchedulerError as exc:
            raise _typed(exc, missing, not_found) from None

    def _own_id(self, job_id: str) -> str:
        """The id a job update goes to. An array task that runs or ran has a
        job id of its own; 23.11+'s slurmrestd refuses an update addressed as
        ``ARRAY_TASK`` ("Submit job update against Array Job's JobID instead of
        array task id", seen live on 24.11, in 26.05's source too), so it gets
        that id. 22.05 takes the ``ARRAY_TASK`` form, and the pending rest of
        an array has no id of its own: both stay as they are."""
        if self.api().legacy or "_" not in job_id or "_[" in job_id:
            return job_id
        # by number, slurmctld updates that one record, even where the number is
        # also the array's (the task that holds the array's own id)
        job = self.lookup_job(job_id)
        return str(job.numeric_id) if job.numeric_id else job_id

    def _update_job(self, job_id: str, body: Mapping[str, Any]) -> None:
        api = self.api()
        path = job_path(api.version, self._own_id(job_id))
        if not api.offers("job/{job_id}", "post"):
            self._lacking("job update", "POST", path)
        self._change("POST", path, _JOB_MISSING, JobNotFound, body=body,
                     benign=_false_array_report if api.legacy else None)

    def _lacking(self, what: str, method: str, path: str) -> None:
        """The server's version has no endpoint for ``what``: the CLI fallback
        runs it (the caller goes on), or this is a SchedulerError."""
        reason = self._fallback_reason()
        if reason:
            raise SchedulerError(
                f"slurmrestd OpenAPI {self.api().version} has no endpoint for {what} "
                f"({method} {path}), and the CLI fallback is off: {reason}",
                argv=[method, path])
        log.info("slurmrestd OpenAPI %s has no %s: running it through the CLI",
                 self.api().version, what)

    def requeue_hold(self, job_id: str) -> None:
        api = self.api()
        path = job_path(api.version, job_id, "/requeue")
        if api.offers("job/{job_id}/requeue", "get"):
            self._change("GET", path, _JOB_MISSING, JobNotFound, query={"Hold": "true"})
            return
        self._lacking("requeue", "GET", path)
        self.fallback.requeue_hold(job_id)

    def set_excluded_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        value = hostlist.collect_hostlist(list(nodes)) if nodes else ""
        if self.api().legacy:
            # 22.05 refuses "excluded_nodes" (disabled key) and takes sbatch's -x name
            self._update_job(job_id, {"exclude_nodes": value})
        else:
            # a list (24.11 warns that a string is not what it expects); none is
            # "": 24.11 reads an empty list as no change, and "" as no nodes
            self._update_job(job_id, {"excluded_nodes": list(nodes) if nodes else ""})

    def allow_requeue(self, job_id: str) -> None:
        self._update_job(job_id, {"requeue": True})

    def release(self, job_id: str) -> None:
        # "hold": false is a release on both shapes (22.05: sbatch's -H; 23.11+:
        # priority INFINITE), which also clears a requeue hold
        self._update_job(job_id, {"hold": False})

    def start_now(self, job_id: str) -> None:
        begin: Any = "now" if self.api().legacy else int(self.clock())
        self._update_job(job_id, {"begin_time": begin})

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        api = self.api()
        query = {"signal": signal if signal.upper().startswith("SIG") or signal.isdigit()
                 else f"SIG{signal}"} if signal else None
        self._change("DELETE", job_path(api.version, job_id), _JOB_MISSING, JobNotFound,
                     query=query)

    def signal_job(self, job_id: str, signal: str, batch: bool = False) -> None:
        if not batch:
            self.cancel(job_id, signal)   # DELETE with a signal: every step but the batch
            return
        # the job DELETE's signal reaches the steps only; the batch shell alone is
        # scancel's --batch
        self._lacking("a signal to the batch shell", "DELETE",
                      job_path(self.api().version, job_id))
        self.fallback.signal_job(job_id, signal, batch=True)

    def _update_node(self, name: str, body: Mapping[str, Any], fallback) -> None:
        api = self.api()
        path = node_path(api.version, name)
        if api.offers("node/{node_name}", "post"):
            self._change("POST", path, _NODE_MISSING, NodeNotFound, body=body)
            return
        self._lacking("node update", "POST", path)
        fallback()

    def drain_node(self, name: str, reason: str) -> None:
        if not reason.strip():
            raise ValueError("a drain needs a reason")
        self._update_node(name, {"state": ["DRAIN"], "reason": reason},
                          lambda: self.fallback.drain_node(name, reason))

    def resume_node(self, name: str) -> None:
        self._update_node(name, {"state": ["RESUME"]},
                          lambda: self.fallback.resume_node(name))


def _false_array_report(entry: Mapping[str, Any]) -> bool:
    """22.05's slurmrestd reports every update of an array task as failed: it
    tests the pointer to the per-task codes, not the codes. The entry then has
    no error number; a real refusal carries one (both recorded live:
    tests/fixtures/slurm/22.05/rest/update_array_task*.json)."""
    return (entry.get("source") == "_parse_job_list"
            and str(entry.get("description", "")).startswith("job array update from")
            and not entry.get("error_number") and not entry.get("errno"))


def _refusals(doc: Mapping[str, Any]) -> list[str]:
    """Per-job refusals inside an answer whose own ``errors`` list is empty:
    23.11+ reports each job (or array task) of an update, requeue or signal
    apart, in ``results`` (``error_code``, ``error``, ``why``) or in ``status``
    (``error: {code, string, message}``)."""
    said = []
    for entry in doc.get("results") or []:
        if isinstance(entry, Mapping) and entry.get("error_code") not in (None, 0):
            said.append(f"job {entry.get('job_id')}: {entry.get('error') or ''} "
                        f"{entry.get('why') or ''} (error {entry['error_code']})".strip())
    for entry in doc.get("status") or []:
        err = entry.get("error") if isinstance(entry, Mapping) else None
        if isinstance(err, Mapping) and err.get("code") not in (None, 0):
            said.append(f"job {entry.get('job_id')}: {err.get('string') or ''} "
                        f"{err.get('message') or ''} (error {err['code']})".strip())
    return said


def _typed(exc: SchedulerError, missing: re.Pattern[str],
           not_found: type[SchedulerError]) -> SchedulerError:
    """Slurm's "no such job/node" in an answer becomes the typed error."""
    if missing.search(f"{exc.args[0] if exc.args else ''}\n{exc.stderr}"):
        return not_found(str(exc), exc.argv, exc.returncode, exc.stderr)
    return exc


def _release(doc: Mapping[str, Any]) -> str:
    meta = doc.get("meta") if isinstance(doc.get("meta"), Mapping) else {}
    block = meta.get("Slurm") or meta.get("slurm") or {}
    if not isinstance(block, Mapping):
        return ""
    if block.get("release"):
        return str(block["release"])
    ver = block.get("version") or {}
    if isinstance(ver, Mapping) and ver.get("major") is not None:
        return f"{ver.get('major')}.{ver.get('minor')}.{ver.get('micro')}"
    return ""

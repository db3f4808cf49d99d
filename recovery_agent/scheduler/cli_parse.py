"""Pure parsers for ``squeue --json``, ``sinfo --json`` and ``scontrol --json``.

Three shapes are handled, all recorded under ``tests/fixtures/slurm/``:

* Slurm 22.05 (openapi v0.0.38): plain integers, ``job_state`` a string, exit
  codes as raw wait statuses, ``standard_output`` the unexpanded pattern, and
  ``sinfo --json`` a list of nodes.
* Slurm 23.x-24.x (data_parser v0.0.39-v0.0.42): numbers wrapped in
  ``{"set", "infinite", "number"}``, ``job_state`` a list, exit codes as objects,
  ``standard_output`` already expanded, ``sinfo --json`` grouped by state.
* Slurm 25.x-26.x (v0.0.43+): as above, plus ``stdout_expanded``.

Nothing here does I/O; the CLI backend feeds these functions and tests feed
them recorded output.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
import zlib
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping

import hostlist

from .base import UNAVAILABLE_NODE_FLAGS, Job, Node, submit_signal

log = logging.getLogger(__name__)

NO_VAL = 4294967294  # Slurm's NO_VAL, printed for "no array task" in %a
NODE_BASE_STATES = frozenset({"IDLE", "ALLOCATED", "MIXED", "DOWN", "FUTURE", "ERROR",
                              "UNKNOWN", "COMPLETING"})
JOB_BASE_STATES = frozenset({"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED",
                             "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                             "DEADLINE", "OUT_OF_MEMORY"})
# Flags that 22.05 printed as the job's one state word (Slurm's job_state_string puts a
# flag before the base state, in this order). From 23.02 ``job_state`` is a list, and a
# requeued job reads ["PENDING", "COMPLETING"] while its old allocation still winds
# down (24.11: its steps, the epilog; the requeue, which sets BeginTime, lands only
# after that). Read as plain PENDING, the job would look requeued too early.
JOB_TRANSITION_FLAGS = ("COMPLETING", "STAGE_OUT", "CONFIGURING", "RESIZING", "SIGNALING")
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin", "job_requeued_in_held_state",
                          "JobHeld"})


def number(value: Any) -> int | None:
    """An integer from either shape; ``None`` for unset or infinite values."""
    if isinstance(value, Mapping):
        if not value.get("set", False) or value.get("infinite", False):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def timestamp(value: Any) -> int | None:
    """A Unix time; Slurm's 0 means "not set"."""
    n = number(value)
    return n if n else None


def slurm_version(doc: Mapping[str, Any]) -> tuple[int, int, int]:
    """(major, minor, micro) from a JSON document's ``meta`` block; (0, 0, 0) if absent."""
    meta = doc.get("meta") or {}
    block = (meta.get("slurm") or meta.get("Slurm") or {}) if isinstance(meta, Mapping) else {}
    ver = (block.get("version") or {}) if isinstance(block, Mapping) else {}
    try:
        return int(ver.get("major", 0)), int(ver.get("minor", 0)), int(ver.get("micro", 0))
    except (TypeError, ValueError):
        return 0, 0, 0


def expand_nodes(text: str | None) -> tuple[str, ...]:
    """``node[1-3],gpu07`` -> ``('node1', 'node2', 'node3', 'gpu07')``."""
    if not text or text in {"(null)", "None"}:
        return ()
    try:
        return tuple(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist:
        return tuple(part for part in text.split(",") if part)


def split_state(value: Any, base_states: frozenset[str]) -> tuple[str, frozenset[str]]:
    """Split a state given as ``"mixed"``, ``"IDLE+DRAIN"`` or ``["MIXED", "DRAIN"]``
    into its base state and its flags."""
    if isinstance(value, str):
        parts = [p for p in value.upper().split("+") if p]
    else:
        parts = [str(p).upper() for p in (value or [])]
    base = next((p for p in parts if p in base_states), parts[0] if parts else "UNKNOWN")
    flags = frozenset(p for p in parts if p != base)
    return base, flags


def job_state(value: Any) -> tuple[str, frozenset[str]]:
    """A job's state and flags. 22.05's one word is taken as it is; from a list
    (23.02 and later) a transition flag is the state, as 22.05 would have printed
    it, and the base state joins the flags."""
    state, flags = split_state(value, JOB_BASE_STATES)
    if isinstance(value, str):
        return state, flags
    shown = next((f for f in JOB_TRANSITION_FLAGS if f in flags), None)
    if shown is None:
        return state, flags
    return shown, (flags - {shown}) | {state}


def exit_status(value: Any) -> tuple[int | None, int | None]:
    """(exit code, signal number) from a raw wait status (22.05) or an exit-code object."""
    if isinstance(value, Mapping):
        code = number(value.get("return_code"))
        sig = number((value.get("signal") or {}).get("id"))
        return code, sig or None
    raw = number(value)
    if raw is None:
        return None, None
    if raw & 0x7F:
        return None, raw & 0x7F
    return (raw >> 8) & 0xFF, None


_PATTERN = re.compile(r"(\\)?%(\d*)([%AaJjNnstuxb])")


def expand_output_path(pattern: str, job: Job, default: str = "") -> str:
    """Expand Slurm's filename pattern for the batch step of ``job``.

    ``%j %A %a %x %u %N %n %t %s %J %b %%`` as sbatch documents them, with an
    optional zero-padding width (``%4a``). A relative result is taken against
    the job's working directory. An empty pattern falls back to ``default``
    (Slurm's ``slurm-%j.out`` or ``slurm-%A_%a.out``).
    """
    pattern = pattern or default
    if not pattern:
        return ""
    if "\\" in pattern:  # a backslash anywhere turns expansion off in Slurm
        text = pattern.replace("\\", "")
    else:
        text = _PATTERN.sub(lambda m: _expand_one(m.group(2), m.group(3), job), pattern)
    if not os.path.isabs(text) and job.workdir:
        text = os.path.join(job.workdir, text)
    return text


def _expand_one(width: str, code: str, job: Job) -> str:
    if code == "%":
        return "%"
    array_id = job.array_job_id if job.array_job_id else job.numeric_id
    task = job.array_task_id if job.array_task_id is not None else NO_VAL
    values: dict[str, int | str] = {
        "j": job.numeric_id, "A": array_id, "a": task, "J": f"{job.numeric_id}.batch",
        "s": "batch", "n": 0, "t": 0, "b": task % 10,
        "N": job.batch_host or (job.nodes[0] if job.nodes else ""),
        "u": job.user, "x": job.name,
    }
    value = values[code]
    if isinstance(value, int) and width:
        return str(value).zfill(int(width))
    return str(value)


def _job_id_text(raw: Mapping[str, Any], numeric: int) -> tuple[str, int | None, int | None, str]:
    """The job's printable id and its array fields: ``1234``, ``1234_7`` or
    ``1234_[8-15%2]`` for the pending remainder of an array."""
    array_job = number(raw.get("array_job_id")) or None
    task = number(raw.get("array_task_id"))
    spec = raw.get("array_task_string") or ""
    if array_job and task is not None and task != NO_VAL:
        return f"{array_job}_{task}", array_job, task, ""
    if array_job and spec:
        return f"{array_job}_[{spec}]", array_job, None, spec
    return str(numeric), None, None, ""


def job_from_json(raw: Mapping[str, Any], version: tuple[int, int, int]) -> Job:
    """One entry of ``squeue --json``'s ``jobs`` list as a :class:`Job`."""
    numeric = number(raw.get("job_id")) or 0
    job_id, array_job, task, spec = _job_id_text(raw, numeric)
    state, flags = job_state(raw.get("job_state"))
    code, sig = exit_status(raw.get("exit_code"))
    reason = raw.get("state_reason") or ""
    hold = raw.get("hold")
    held = bool(hold) if isinstance(hold, bool) else reason in HELD_REASONS
    job = Job(
        job_id=job_id, numeric_id=numeric, name=raw.get("name") or "", state=state,
        state_flags=flags, reason="" if reason == "None" else reason, exit_code=code,
        exit_signal=sig, nodes=expand_nodes(raw.get("nodes")),
        batch_host=raw.get("batch_host") or "",
        excluded_nodes=expand_nodes(raw.get("excluded_nodes")),
        restart_count=number(raw.get("restart_cnt")) or 0, array_job_id=array_job,
        array_task_id=task, array_task_spec=spec,
        submit_time=timestamp(raw.get("submit_time")),
        start_time=timestamp(raw.get("start_time")), end_time=timestamp(raw.get("end_time")),
        user=raw.get("user_name") or "", user_id=number(raw.get("user_id")),
        group_id=number(raw.get("group_id")), comment=raw.get("comment") or "",
        partition=raw.get("partition") or "", cluster=raw.get("cluster") or "",
        workdir=raw.get("current_working_directory") or "",
        command=raw.get("command") if isinstance(raw.get("command"), str) else "",
        requeue_allowed=bool(raw.get("requeue", True)), held=held,
        signal=submit_signal(raw.get("submit_line")
                             if isinstance(raw.get("submit_line"), str) else ""),
    )
    return _with_output_paths(job, raw, version)


def _with_output_paths(job: Job, raw: Mapping[str, Any], version: tuple[int, int, int]) -> Job:
    if job.array_task_spec:  # the pending rest of an array writes no file of its own
        return job
    default = "slurm-%A_%a.out" if job.array_job_id else "slurm-%j.out"
    already_expanded = version >= (23, 2, 0)
    paths = []
    for expanded_key, key in (("stdout_expanded", "standard_output"),
                              ("stderr_expanded", "standard_error")):
        if raw.get(expanded_key):
            paths.append(raw[expanded_key])
        elif raw.get(key) and already_expanded:
            paths.append(raw[key] if os.path.isabs(raw[key])
                         else os.path.join(job.workdir, raw[key]))
        else:
            paths.append(expand_output_path(raw.get(key) or "", job,
                                            default if key == "standard_output" else ""))
    stdout, stderr = paths
    return replace(job, stdout=stdout, stderr=stderr or stdout)


# Every field job_from_json reads: a record whose values are all unchanged since
# the last listing gives the same Job, so it need not be parsed again.
_JOB_FIELDS = ("job_id", "array_job_id", "array_task_id", "array_task_string", "job_state",
               "exit_code", "state_reason", "hold", "name", "nodes", "batch_host",
               "excluded_nodes", "restart_cnt", "submit_time", "start_time", "end_time",
               "user_name", "user_id", "group_id", "comment", "partition", "cluster",
               "current_working_directory", "command", "submit_line",
               "requeue", "standard_output", "standard_error", "stdout_expanded",
               "stderr_expanded")


def _job_record(raw: Any, version: tuple[int, int]) -> Job | None:
    """One job record as a Job, or None (with a log line) when it is unusable:
    one malformed record must not blind the agent to every other job."""
    if not isinstance(raw, Mapping):
        log.warning("squeue --json: skipped a job record that is not an object")
        return None
    try:
        job = job_from_json(raw, version)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        log.warning("squeue --json: skipped job record %r: %s",
                    str(raw.get("job_id"))[:40], exc)
        return None
    if not job.numeric_id:
        log.warning("squeue --json: skipped a job record without a job id")
        return None
    return job


class ListingError(ValueError):
    """The listing says slurmctld failed to answer (its ``errors`` list): its
    jobs or nodes, usually none, are not the cluster's."""


def listing_errors(doc: Mapping[str, Any], what: str) -> None:
    """Raise ListingError when a ``--json`` document carries errors. Slurm 22.05
    prints ``"jobs": []`` with exit 0 and an errors entry when slurmctld does
    not answer (tests/fixtures/slurm/22.05/squeue_ctld_frozen.json); an empty
    list there is no evidence that the jobs are gone."""
    errors = doc.get("errors") if isinstance(doc, Mapping) else None
    if not errors:
        return
    said = []
    for err in errors if isinstance(errors, list) else [errors]:
        if isinstance(err, Mapping):
            parts = [str(err[k]) for k in ("source", "description", "error") if err.get(k)]
            said.append(": ".join(parts) or str(dict(err)))
        else:
            said.append(str(err))
    raise ListingError(f"{what} reported errors from slurmctld: {'; '.join(said)[:300]}")


def parse_squeue(doc: Mapping[str, Any], cache: dict | None = None) -> list[Job]:
    """Every job in a ``squeue --json`` (or ``scontrol --json show job``) document.

    With ``cache`` (a dict the caller keeps between calls), records unchanged
    since the previous call are not parsed again; the cache is left holding
    this call's records only."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("jobs", []), list):
        raise ValueError("not a squeue --json document (no 'jobs' list)")
    listing_errors(doc, "squeue --json")
    version = slurm_version(doc)
    jobs, fresh = [], {}
    for raw in doc.get("jobs", []):
        if isinstance(raw, Mapping):
            key = (version, *[raw.get(f) for f in _JOB_FIELDS])
            try:
                hash(key)
            except TypeError:   # 23.x+ wraps numbers in dicts
                key = repr(key)
        else:
            key = None
        job = cache.get(key) if cache is not None and key is not None else None
        if job is None:
            job = _job_record(raw, version)
            if job is None:
                continue
        fresh[key] = job
        jobs.append(job)
    return _renewed(cache, fresh, jobs)


def _renewed(cache: dict | None, fresh: dict, jobs: list[Job]) -> list[Job]:
    """Leave the caller's cache holding this listing's records only."""
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    return jobs


# Slurm prints its JSON with two-space indents, so in a listing each record of
# the top-level list starts and ends on its own line at four spaces, and no
# newline occurs inside a JSON string. That lets a listing be cut into records
# without parsing it: at 10,000 jobs parsing the whole document was half of a
# watch cycle's CPU and most of its peak memory, and between two polls nearly
# every record is byte-for-byte the same.
_RECORD_SEP = "\n    },\n    {"


def split_listing(data: str | bytes, key: str) -> tuple[str | bytes, Iterator] | None:
    """``(the document with an empty list under key, an iterator over the text
    inside each record's braces)``, or None when the data is not laid out as
    Slurm lays it out (the caller then parses the whole document). Records of
    ``bytes`` come as zero-copy memoryviews, one at a time."""
    enc = (lambda t: t) if isinstance(data, str) else (lambda t: t.encode())
    opener = enc(f'\n  "{key}": [\n')
    start = data.find(opener)
    if start < 0:
        return None
    body_start = start + len(opener)
    # the list's end is searched from the document's end: what follows it is a
    # few top-level keys, where a forward search would read the whole list. A
    # later top-level list of objects (24.11's warnings) ends the same way;
    # then the last piece holds the rest of the document, does not parse as
    # one record, and the caller parses the whole listing instead
    end = data.rfind(enc("\n  ]"), body_start - 1)
    if end < 0:
        return None
    rest = data[:start] + enc(f'\n  "{key}": []') + data[end + 4:]
    if end < body_start:
        return rest, iter(())
    first, last = enc("    {"), enc("\n    }")
    if not (data.startswith(first, body_start) and data.endswith(last, body_start, end)):
        return None
    return rest, _records(data, body_start + len(first), end - len(last), enc(_RECORD_SEP))


def _records(data: str | bytes, pos: int, stop: int, sep: str | bytes) -> Iterator:
    view = memoryview(data) if isinstance(data, bytes) else data
    while True:
        cut = data.find(sep, pos, stop)
        if cut < 0:
            yield view[pos:stop]
            return
        yield view[pos:cut]
        pos = cut + len(sep)


def _braced(piece) -> str | bytes:
    return "{" + piece + "}" if isinstance(piece, str) else b"{" + piece + b"}"


def _digest(piece) -> tuple:
    """A record's identity between two listings: its length and two unrelated
    checksums (96 bits, a fraction of a cryptographic digest's cost at 40 MB)."""
    data = piece.encode() if isinstance(piece, str) else piece
    return len(data), hash(data), zlib.crc32(data)


def parse_squeue_text(text: str | bytes, cache: dict | None = None,
                      loads: Callable[[Any], Any] = json.loads) -> list[Job]:
    """:func:`parse_squeue` from the command's output: each record is known by
    a digest of its text and only new or changed records are parsed. Output
    laid out any other way is parsed whole (same result, more work)."""
    split = split_listing(text, "jobs")
    if split is None:
        return parse_squeue(loads(text), cache)
    rest, pieces = split
    head = loads(rest)
    if not isinstance(head, Mapping):
        raise ValueError("not a squeue --json document (no 'jobs' list)")
    listing_errors(head, "squeue --json")
    version = slurm_version(head)
    jobs, fresh = [], {}
    for piece in pieces:
        key = ("text", version, _digest(piece))
        job = cache.get(key) if cache is not None else None
        if job is None:
            try:
                raw = loads(_braced(piece))
            except ValueError:
                # the layout fooled the cut: fall back to the whole document
                log.debug("squeue --json: record split failed, parsing whole listing")
                return parse_squeue(loads(text), cache)
            job = _job_record(raw, version)
            if job is None:
                continue
        fresh[key] = job
        jobs.append(job)
    return _renewed(cache, fresh, jobs)


# the states in which a node's reason says why it is out of service
_REASON_STATES = frozenset({"DOWN", "FAIL", "ERROR", "UNKNOWN", "FUTURE"})
_REASON_FLAGS = UNAVAILABLE_NODE_FLAGS | {"MAINT", "REBOOT_ISSUED", "POWER_DOWN",
                                         "POWERING_DOWN"}


def _reason_holds(state: str, flags: frozenset[str]) -> bool:
    """Does the node's reason still describe it? 24.11's slurmctld keeps the
    reason of a drain after ``state=RESUME`` (``scontrol show node`` still
    prints it on an IDLE node; seen live): on a node back in service it is a
    leftover, and reads as none, as 22.05 reported it."""
    return state in _REASON_STATES or bool(flags & _REASON_FLAGS)


def _state_key(value: Any) -> Any:
    """``value`` (a state or a flag list as printed) in a hashable form that
    keeps apart what :func:`split_state` tells apart; None when it has none."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, list) and not value:
        return ()    # split_state reads None and [] alike
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return tuple(value)
    return None


@functools.lru_cache(maxsize=512)
def _node_state(state: Any, state_flags: Any) -> tuple[str, frozenset[str], bool]:
    """(base state, flags, whether the reason holds) of a node's ``state`` and
    ``state_flags`` in :func:`_state_key`'s form. A cluster's nodes share a
    handful of states, so each is worked out once, and its nodes share one
    frozenset of flags."""
    base, flags = split_state(list(state) if isinstance(state, tuple) else state,
                              NODE_BASE_STATES)
    flags = flags | frozenset(str(f).upper() for f in state_flags)
    return base, flags, _reason_holds(base, flags)


def _once(shared: dict, value: Any) -> Any:
    """``value``, or the equal value ``shared`` holds already."""
    try:
        return shared.setdefault(value, value)
    except TypeError:   # unhashable (not a shape Slurm prints): kept as it is
        return value


def node_from_json(raw: Mapping[str, Any], shared: dict | None = None) -> Node:
    """One entry of a per-node list (22.05 ``sinfo --json``, ``scontrol --json show node``).
    ``shared``: a dict that one listing's calls pass along, so that values
    its nodes repeat (an address, gres, a partition list) are held once."""
    value, listed = raw.get("state"), raw.get("state_flags") or []
    key, flags_key = _state_key(value), _state_key(listed)
    if key is None or flags_key is None:   # an odd shape: worked out here, not kept
        state, flags = split_state(value, NODE_BASE_STATES)
        flags = flags | frozenset(str(f).upper() for f in listed)
        held = _reason_holds(state, flags)
    else:
        state, flags, held = _node_state(key, flags_key)
    partitions = tuple(raw.get("partitions") or ())
    gres, address = raw.get("gres") or "", raw.get("address") or ""
    if shared is not None:
        partitions, gres, address = (_once(shared, partitions), _once(shared, gres),
                                     _once(shared, address))
    return Node(name=raw.get("name") or "", state=state, flags=flags,
                reason=(raw.get("reason") or "") if held else "",
                reason_user=(raw.get("reason_set_by_user") or "") if held else "",
                reason_time=timestamp(raw.get("reason_changed_at")) if held else None,
                partitions=partitions, gres=gres,
                address=address, hostname=raw.get("hostname") or "")


def nodes_from_sinfo_groups(groups: Iterable[Mapping[str, Any]]) -> list[Node]:
    """Nodes from the grouped ``sinfo`` list of Slurm 23.02+.

    sinfo groups nodes that share state, reason and partition; a node in two
    partitions shows up in two groups, so partitions are merged by name.
    """
    found: dict[str, Node] = {}
    for group in groups:
        state, flags = split_state((group.get("node") or {}).get("state"), NODE_BASE_STATES)
        reason = group.get("reason") or {}
        if isinstance(reason, str):
            reason = {"description": reason}
        held = _reason_holds(state, flags)
        if not held:
            reason = {}
        user = (reason.get("user") or group.get("reason_set_by_user") or "") if held else ""
        partition = (group.get("partition") or {}).get("name") or ""
        gres = (group.get("gres") or {}).get("total") or ""
        members = group.get("nodes") or {}
        names = members.get("nodes") or []
        # the addresses and hostnames lists pair with the names when sinfo fills them
        addresses = members.get("addresses") or []
        hostnames = members.get("hostnames") or []
        for i, name in enumerate(names):
            previous = found.get(name)
            parts = previous.partitions if previous else ()
            if partition and partition not in parts:
                parts = (*parts, partition)
            found[name] = Node(name=name, state=state, flags=flags,
                               reason=reason.get("description") or "", reason_user=user,
                               reason_time=timestamp(reason.get("time")), partitions=parts,
                               gres=gres,
                               address=addresses[i] if len(addresses) == len(names) else "",
                               hostname=hostnames[i] if len(hostnames) == len(names) else "")
    return list(found.values())


def parse_nodes(doc: Mapping[str, Any]) -> list[Node]:
    """Nodes from any shape of ``sinfo --json`` or ``scontrol --json show node``."""
    listing_errors(doc, "sinfo --json")
    if "nodes" in doc:
        shared: dict = {}
        return [node_from_json(raw, shared) for raw in doc.get("nodes") or []]
    return nodes_from_sinfo_groups(doc.get("sinfo") or [])


def parse_nodes_text(text: str | bytes, loads: Callable[[Any], Any] = json.loads) -> list[Node]:
    """:func:`parse_nodes` from the command's text, one record at a time when
    it is laid out as Slurm prints it, so a 20,000-node listing never exists as
    one tree of Python objects."""
    split = split_listing(text, "nodes")
    if split is None:
        return parse_nodes(loads(text))
    rest, pieces = split
    head = loads(rest)
    if not isinstance(head, Mapping):
        raise ValueError("not a sinfo --json document")
    listing_errors(head, "sinfo --json")
    nodes, shared = [], {}
    for piece in pieces:
        try:
            raw = loads(_braced(piece))
        except ValueError:
            return parse_nodes(loads(text))
        nodes.append(node_from_json(raw, shared))
    return nodes


# -- scontrol show job -o (a targeted query; 22.05's scontrol has no --json) ----------

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"


def parse_scontrol_job(text: str) -> Job | None:
    """The first job of ``scontrol show job -o ID`` (one ``key=value`` line per
    job), with what a check of its existence needs: id, state, restart count,
    submit time, user, nodes. None for output that holds no job."""
    line = next((ln for ln in text.splitlines() if ln.startswith("JobId=")), None)
    if line is None:
        return None
    fields: dict[str, str] = {}
    for word in line.split(" "):
        key, eq, value = word.partition("=")
        if eq and key not in fields:
            fields[key] = value
    numeric = int(fields["JobId"]) if fields.get("JobId", "").isdigit() else 0
    array_job, task = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
    job_id = f"{array_job}_{task}" if array_job and task and task.isdigit() else str(numeric)
    state, flags = split_state(fields.get("JobState", "UNKNOWN"), JOB_BASE_STATES)
    try:
        submit = int(time.mktime(time.strptime(fields.get("SubmitTime", ""), _TIME_FORMAT)))
    except ValueError:
        submit = None
    user = fields.get("UserId", "")
    restarts = fields.get("Restarts", "0")
    return Job(job_id=job_id, numeric_id=numeric, name=fields.get("JobName", ""),
               state=state, state_flags=flags,
               restart_count=int(restarts) if restarts.isdigit() else 0,
               submit_time=submit, user=user.split("(", 1)[0],
               nodes=expand_nodes(fields.get("NodeList")),
               array_job_id=int(array_job) if array_job and array_job.isdigit() else None,
               array_task_id=int(task) if task and task.isdigit() else None)

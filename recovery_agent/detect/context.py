"""What attribution knows besides the log detections (:class:`AttributionContext`),
and what a job's log states about itself: its placement (nodes, rank -> host,
srun task -> host, step node index -> host: :func:`parse_layout`, kept as the log streams past by
:class:`LayoutLines`) and the addresses it may name a node by
(:func:`node_addresses`, :func:`read_node_addresses`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import hostlist

from .attempts import PriorAttempt
from .model import Detection
from .origin import line_origin, names_no_node

__all__ = ["AttributionContext", "Layout", "LayoutLines", "context_from_lines", "node_addresses",
           "parse_layout", "read_node_addresses", "with_host"]


@dataclass(frozen=True)
class AttributionContext:
    """What attribution knows besides the log detections (every field optional)."""

    nodes: tuple[str, ...] = ()                       # the job's nodes, expanded
    rank_hosts: Mapping[int, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)   # IP, alias -> host
    task_hosts: Mapping[int, str] = field(default_factory=dict)  # srun task id -> host
    node_index: Mapping[int, str] = field(default_factory=dict)  # srun step node index -> host
    node_events: tuple[Detection, ...] = ()           # node reports (host set)
    node_fail: tuple[str, ...] = ()                   # NODE_FAIL nodes from Slurm
    node_states: Mapping[str, str] = field(default_factory=dict)  # host -> state
    previous: tuple[PriorAttempt, ...] = ()
    window: tuple[float, float] | None = None         # the attempt's start, end
    printers: tuple[str, ...] = ()                    # hosts the log's line prefixes name


# -- layout from the log ----------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Placement facts a job log states about itself."""

    nodes: tuple[str, ...] = ()
    rank_hosts: Mapping[int, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)
    task_hosts: Mapping[int, str] = field(default_factory=dict)
    node_index: Mapping[int, str] = field(default_factory=dict)
    printers: tuple[str, ...] = ()   # the hosts line prefixes name as the printer, in order


_ALLOC = re.compile(r"\b(?:Allocate JobId=\d+\S* NodeList=|SLURM_(?:JOB_|STEP_)?NODELIST[=:] ?)"
                    r"([A-Za-z0-9][\w.\[\],-]*)")
_TASKS_PER_NODE = re.compile(r"\bSLURM_(?:STEP_|JOB_)?TASKS_PER_NODE[=:] ?(\d+(?:\(x\d+\))?"
                             r"(?:,\d+(?:\(x\d+\))?)*)")
_SRUN_LAUNCH = re.compile(r"launching (?:StepId=)?(\S+) on host ([A-Za-z0-9][\w.-]*), \d+ tasks?: "
                          r"\[?([\d,-]+)\]?")
# srun -v (launch.c _task_start): "Node %s, %d tasks started", once per node of
# the step: a node the job ran on
_SRUN_STARTED = re.compile(r"\bsrun: Node ([A-Za-z0-9][\w.-]*), \d+ tasks? started")
_STEP_NODELIST = re.compile(r"\bSLURM_STEP_NODELIST[=:] ?([A-Za-z0-9][\w.\[\],-]*)")
_NCCL_RANK = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO .*?"
                        r"\bcomm 0x[0-9a-f]+ rank (\d+) n[Rr]anks (\d+)")
_NCCL_ADDR = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO "
                        r"(?:NET/\w+ ?: Using .*?OOB |Bootstrap ?: Using |NET/Socket ?: Using )"
                        r"(?:\[\d+\])?[\w.-]+:(\d{1,3}(?:\.\d{1,3}){3})<")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_SUMMARY = re.compile(r"^\s*(?:\[\w+\]:\s*)?(host|rank)\s*:\s*([\w.-]+)")
# torchrun's failure summary (torch/distributed/elastic/multiprocessing/errors:
# its template pads each field name to "host      : ", "rank      : ") behind a
# prefix of the log's own (a collector's timestamp), and the same summary with
# its line breaks lost, "host : H rank : R (local_rank: L)" on one line
_SUMMARY_PADDED = re.compile(r"(?:^|\s)(host|rank) {3,}: ([\w.-]+)")
_SUMMARY_FLAT = re.compile(r"\bhost\s+:\s+([\w.-]+)\s+rank\s+:\s+(\d+)\s+\(local_rank:")
# nccl-tests' device table (src/common.cu): "#  Rank R Group G Pid P on HOST device D [bus] name"
# (older releases print no Group): rank R runs on HOST
_NCCL_TESTS_RANK = re.compile(r"#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+"
                              r"([A-Za-z0-9][\w.-]*)\s+device\s+\d+")
# the node a job's script or task runs on, as an environment dump prints it
_NODENAME = re.compile(r"\bSLURMD_NODENAME[=:] ?['\"]?([A-Za-z0-9][\w.-]*)")
_PRINTERS_KEPT = 64   # printers past this many say nothing about which one a line is


def summary_fields(line: str) -> tuple[tuple[str, str], ...]:
    """The ``host`` and ``rank`` fields of torchrun's failure summary on
    ``line``, in order: its own line ("  host      : H", or after a ``[N]:``),
    the padded field behind a prefix, or the flattened "host : H rank : R
    (local_rank: L)"."""
    match = _SUMMARY.match(line)
    if match:
        return ((match.group(1), match.group(2)),)
    if "(local_rank:" in line and (match := _SUMMARY_FLAT.search(line)):
        return (("host", match.group(1)), ("rank", match.group(2)))
    if "   : " in line and (match := _SUMMARY_PADDED.search(line)):
        return ((match.group(1), match.group(2)),)
    return ()


def parse_layout(lines: Iterable[str]) -> Layout:
    """Nodes, rank -> host, IP -> host and srun task -> host from lines the job
    itself printed: slurmctld/``SLURM_JOB_NODELIST`` node lists (with
    ``SLURM_TASKS_PER_NODE``, ranks in block order), ``srun -v`` launch lines
    (and its "Node X, N tasks started": a node of the job),
    NCCL's communicator init and bootstrap lines (the widest communicator
    wins), nccl-tests' device table (``#  Rank R … on HOST``), torchrun's
    failure summaries (``host :`` then ``rank :``), and the line prefixes
    (:func:`~.origin.line_origin`) that put an srun ``--label`` task, a
    ``[rankN]:`` rank or a pdsh/Ray IP address on a line naming its host: a
    task seen on a host is on it, so are the ranks seen on that task.
    A step's node index -> host comes from its ``srun -v`` launch lines and
    ``SLURM_STEP_NODELIST`` (:func:`_node_index`); srun task ids from the
    launch lines and the ``--label`` prefixes. ``printers`` are the hosts the
    lines' prefixes name as where each line was printed, the node an
    environment dump's ``SLURMD_NODENAME`` names and the host of torchrun's
    failure summary, in order."""
    nodes: list[str] = []
    ranks: dict[int, str] = {}
    nccl: dict[int, tuple[int, str]] = {}
    addresses: dict[str, str] = {}
    tasks: dict[int, str] = {}
    task_ranks: set[tuple[int, int]] = set()
    per_node: list[int] = []
    steps: dict[str, list[str]] = {}    # a step (id, or its node list) -> its nodes, in order
    step_tasks: dict[str, dict[int, str]] = {}   # a step -> its task ids' hosts
    printers: list[str] = []
    summary_host = None
    for line in lines:
        printer = line_origin(line).host
        if printer is None and "SLURMD_NODENAME" in line and (match := _NODENAME.search(line)):
            printer = None if names_no_node(match.group(1)) else match.group(1)
        if printer and printer not in printers and len(printers) < _PRINTERS_KEPT:
            printers.append(printer)
        if "NodeList=" in line or "NODELIST" in line:
            for match in _ALLOC.finditer(line):
                nodes.extend(n for n in _expand(match.group(1)) if n not in nodes)
        if "TASKS_PER_NODE" in line and not per_node:
            match = _TASKS_PER_NODE.search(line)
            per_node = _tasks_per_node(match.group(1)) if match else []
        if "launching" in line:
            match = _SRUN_LAUNCH.search(line)
            if match:
                step, host = match.group(1), match.group(2)
                if host not in steps.setdefault(step, []):
                    steps[step].append(host)
                for task in _ranks(match.group(3)):
                    ranks.setdefault(task, host)
                    step_tasks.setdefault(step, {})[task] = host
        if "tasks started" in line or "task started" in line:
            match = _SRUN_STARTED.search(line)
            if match and match.group(1) not in nodes:
                nodes.append(match.group(1))
        if "SLURM_STEP_NODELIST" in line:
            for match in _STEP_NODELIST.finditer(line):
                steps.setdefault("env:" + match.group(1), _expand(match.group(1)))
        if "NCCL" in line or "[rank" in line or "MPICH ERROR" in line:
            _prefix_facts(line, tasks, task_ranks, addresses, ranks)
        if "NCCL INFO" in line:
            _nccl_line(line, nccl, addresses)
        if "#  Rank" in line and (match := _NCCL_TESTS_RANK.search(line)) \
                and not names_no_node(match.group(2)):
            ranks.setdefault(int(match.group(1)), match.group(2))
        for field, value in summary_fields(line) if ":" in line else ():
            if field == "host":
                summary_host = value
                if summary_host not in printers and not names_no_node(summary_host) \
                        and len(printers) < _PRINTERS_KEPT:
                    printers.append(summary_host)   # the failed rank's node
            elif summary_host and value.isdigit():
                ranks.setdefault(int(value), summary_host)
                summary_host = None
    widest = max((size for size, _ in nccl.values()), default=0)
    for rank, (size, host) in nccl.items():
        if size == widest:
            ranks.setdefault(rank, host)
    _ranks_from_tasks(ranks, tasks, task_ranks)
    _ranks_from_blocks(ranks, nodes, per_node)
    for task, host in _agreed(step_tasks.values()).items():   # after what --label showed
        tasks.setdefault(task, host)
    return Layout(tuple(nodes), ranks, addresses, tasks, _node_index(steps.values()),
                  tuple(printers))


def _node_index(steps: Iterable[Sequence[str]]) -> dict[int, str]:
    """Step node index -> host: srun numbers a step's nodes by their place in
    the step's node list (``srun -v`` prints its launch lines in that order;
    ``SLURM_STEP_NODELIST`` is the list). An error line names the index, not
    the step, so an index counts only where every step the log shows puts
    the same host there."""
    return _agreed(dict(enumerate(hosts)) for hosts in steps)


def _agreed(steps: Iterable[Mapping[int, str]]) -> dict[int, str]:
    """Number -> host over several steps' maps, where no two steps disagree."""
    out: dict[int, str] = {}
    clash: set[int] = set()
    for numbered in steps:
        for number, host in numbered.items():
            if out.setdefault(number, host) != host:
                clash.add(number)
    return {number: host for number, host in out.items() if number not in clash}


def _prefix_facts(line: str, tasks: dict, task_ranks: set, addresses: dict,
                  ranks: dict) -> None:
    origin = line_origin(line)
    named = origin.host if origin.host != origin.address else None
    if origin.task is not None and named:
        tasks.setdefault(origin.task, named)
    if origin.rank is not None and named:     # a rank's own line, naming its node
        ranks.setdefault(origin.rank, named)
    if origin.task is not None and origin.rank is not None:
        task_ranks.add((origin.task, origin.rank))
    if origin.address and named:
        addresses.setdefault(origin.address, named)


def _ranks_from_tasks(ranks: dict, tasks: Mapping[int, str], pairs: set) -> None:
    """Ranks printed under a task's label run where the task does; when every
    label seen with a rank equals it, the labels are the ranks."""
    for task, rank in sorted(pairs):
        if task in tasks:
            ranks.setdefault(rank, tasks[task])
    if pairs and all(task == rank for task, rank in pairs):
        for task, host in tasks.items():
            ranks.setdefault(task, host)


def _tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``4(x2),2``) as one count per node."""
    out: list[int] = []
    for part in text.split(","):
        count, _, times = part.partition("(x")
        out.extend([int(count)] * int(times.rstrip(")") or 1))
    return out


def _ranks_from_blocks(ranks: dict, nodes: Sequence[str], per_node: Sequence[int]) -> None:
    """Slurm's default block distribution: node i holds the next per_node[i]
    ranks. Only when several tasks share a node (one task per node is the
    torchrun case, whose ranks are not Slurm tasks) and the counts fit."""
    if len(per_node) != len(nodes) or not nodes or max(per_node) < 2:
        return
    rank = 0
    for node, count in zip(nodes, per_node):
        for _ in range(count):
            ranks.setdefault(rank, node)
            rank += 1


def _nccl_line(line: str, nccl: dict, addresses: dict) -> None:
    match = _NCCL_RANK.search(line)
    if match:
        host, rank, size = match.group(1), int(match.group(2)), int(match.group(3))
        if rank not in nccl or nccl[rank][0] < size:
            nccl[rank] = (size, host)
    match = _NCCL_ADDR.search(line)
    if match:
        addresses.setdefault(match.group(2), match.group(1))


def _ranks(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.extend(range(int(low), int(high or low) + 1))
    return out


def _expand(hosts: str) -> list[str]:
    if "[" not in hosts and "," not in hosts:
        return [hosts]
    try:
        return list(hostlist.expand_hostlist(hosts))
    except Exception:   # a malformed list: keep it as one name
        return [hosts]


class LayoutLines:
    """The lines of a job's log that state its layout (:func:`parse_layout`'s
    input: node lists, ``srun -v`` launch lines, NCCL init and bootstrap lines,
    rank-prefixed and Cray MPICH lines, torchrun's failure summary), kept as the
    log streams past so the agent's verdict knows the same rank -> host and
    address -> host maps as ``patterns score`` does offline. A cheap test on
    each line; at most ``cap`` lines of at most ``LONGEST`` characters (under
    1 MiB an attempt), ``cap // 8`` of them rank-prefixed or summary lines,
    which a chatty job prints on every step."""

    MARKERS = ("NCCL INFO", "NodeList=", "NODELIST", "TASKS_PER_NODE", "launching ",
               "MPICH ERROR", "#  Rank")   # (NODELIST: SLURM_STEP_NODELIST too; nccl-tests)
    LONGEST = 480

    def __init__(self, cap: int = 2048) -> None:
        self.cap = cap
        self.lines: list[str] = []
        self._ranked = 0

    def feed(self, text: str) -> None:
        if len(self.lines) >= self.cap:
            return
        for marker in self.MARKERS:   # (a plain loop: this runs on every line)
            if marker in text:
                self.lines.append(text[:self.LONGEST])
                return
        if self._ranked < self.cap // 8 and ("[rank" in text or (
                ("host" in text or "rank" in text) and summary_fields(text))):
            self._ranked += 1
            self.lines.append(text[:self.LONGEST])

    def context(self, **known) -> AttributionContext:
        """:func:`context_from_lines` on the kept lines, ``known`` winning."""
        return context_from_lines(self.lines, **known)


def context_from_lines(lines: Iterable[str], **known) -> AttributionContext:
    """An AttributionContext from what the log states (:func:`parse_layout`),
    with ``known`` fields (from Slurm, the store, a nodes file) taking
    precedence. ``addresses`` maps what the text may name a node by (an IP
    address: NCCL peers, pdsh/Ray prefixes; a hostname or FQDN) to the node:
    the agent passes each job node's Slurm ``NodeAddr`` and ``NodeHostname``."""
    layout = parse_layout(lines)
    merged = {"nodes": layout.nodes, "rank_hosts": layout.rank_hosts,
              "addresses": layout.addresses, "task_hosts": layout.task_hosts,
              "node_index": layout.node_index, "printers": layout.printers}
    for key in ("rank_hosts", "addresses", "task_hosts", "node_index"):
        if key in known:
            merged[key] = {**merged[key], **known.pop(key)}
    merged.update(known)
    return AttributionContext(**merged)


def read_node_addresses(text: str) -> dict[str, str]:
    """Address -> node from a nodes file: one node a line, ``name address...``
    (IP addresses, hostnames, FQDNs; commas also separate), or Slurm's own
    ``NodeName=n ... NodeAddr=a NodeHostName=h`` (``scontrol show node``,
    multi-line or ``-o``, or slurm.conf lines); ``#`` starts a comment. The
    aliases are read as :func:`node_addresses` reads them."""
    records: dict[str, list[str]] = {}
    current = None
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].replace(",", " ").split()
        if not words:
            continue
        if any("=" in w for w in words):   # Slurm's Key=Value form
            pairs = dict(w.split("=", 1) for w in words if "=" in w)
            current = pairs.get("NodeName", current)
            aliases = [v for k, v in pairs.items()
                       if k in ("NodeAddr", "NodeHostName", "NodeHostname")]
        else:
            current, aliases = words[0], words[1:]
        if current:
            records.setdefault(current, []).extend(aliases)
    return node_addresses((name, *aliases) for name, aliases in records.items())


def node_addresses(records: Iterable[Sequence[str]]) -> dict[str, str]:
    """Address -> node from node records, each ``(name, alias...)`` (Slurm's
    ``NodeAddr`` and ``NodeHostname``: IP addresses, hostnames, FQDNs; a
    hostname's short form is an alias too). A node's name is its own. An
    alias two nodes share (every node of a one-machine test cluster at
    127.0.0.1, a front-end name) names neither: text that says it says
    nothing about which node it meant."""
    owners: dict[str, set[str]] = {}
    names = set()
    for name, *aliases in records:
        names.add(name)
        for alias in [name, *aliases]:
            if not alias:
                continue
            owners.setdefault(alias, set()).add(name)
            if not _IPV4.fullmatch(alias) and "." in alias:
                owners.setdefault(alias.split(".")[0], set()).add(name)
    out = {}
    for alias, nodes in owners.items():
        if alias in names:
            out[alias] = alias
        elif len(nodes) == 1:
            out[alias] = next(iter(nodes))
    return out


def with_host(detections: Iterable[Detection], host: str) -> list[Detection]:
    """``detections`` of a log that came from one node: those no prefix or
    rule placed elsewhere are that node's."""
    return [d if d.host else replace(d, host=host) for d in detections]

"""Attribution: from detections to a verdict -- a node, the application, or unknown.

``attribute(detections, context)`` weighs what the scanner found in a job's
logs together with what the context adds: the job's nodes, a rank -> host map,
XIDs and GPU faults from the node reports in the job's window, Slurm's
NODE_FAIL and node states, and the verdicts of the job's earlier attempts.

How the winning detection is chosen (roles are model.ROLES):

1. A ``root`` detection that excludes a node (a fatal XID, a GPU off the bus,
   a node failure) explains everything else, whatever the order.
2. Else the earliest ``cause``: the first error in the log is the one the
   others follow from (an application error before the NCCL timeouts it
   causes; an IB error before the tracebacks it provokes).
3. Else the earliest ``symptom`` (timeouts, peers that went away), then the
   earliest ``exit`` report (exit codes, aborts). Info-level lines never win.

Within the winner's tier, the strongest action among detections of its
category is taken (two XIDs: the one asking to requeue beats the one asking
to stop). A ``requeue_exclude`` verdict names the hosts the evidence names
(ranks mapped to hosts, peer addresses to names); a single-node job names its
node. A failure that names no node, repeated over attempts that share exactly
one node, blames that node.

``rests_on`` indexes :func:`all_detections` (the input detections, then the
context's own), which equals the input list when the context adds nothing.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from .model import Detection, Evidence, Verdict
from .patterns import xid_action
from .scanner import line_origin

__all__ = ["AttributionContext", "Layout", "LayoutLines", "PriorAttempt", "across_attempts", "all_detections",
           "attribute", "context_from_lines", "node_addresses", "parse_layout",
           "read_node_addresses",
           "with_host"]

_STRENGTH = {"none": 0, "stop": 1, "requeue": 2, "kill_requeue": 3, "requeue_exclude": 4}
_TIER_CONFIDENCE = {0: 0.9, 1: 0.8, 2: 0.6, 3: 0.5, 4: 0.4}
_APPLICATION = {"application", "oom", "segfault", "cuda_error", "nccl_timeout_hang",
                "gpu_hardware"}
_BAD_STATE = re.compile(r"DOWN|FAIL|NOT_RESPONDING|NO_RESPOND|\*")


@dataclass(frozen=True)
class PriorAttempt:
    """An earlier attempt of the same job: where it ran and what was decided."""

    nodes: tuple[str, ...] = ()
    verdict: Verdict | None = None
    attempt: int | None = None         # its number (Slurm's restart count), when known


@dataclass(frozen=True)
class AttributionContext:
    """What attribution knows besides the log detections (every field optional)."""

    nodes: tuple[str, ...] = ()                       # the job's nodes, expanded
    rank_hosts: Mapping[int, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)   # IP, alias -> host
    task_hosts: Mapping[int, str] = field(default_factory=dict)  # srun --label task -> host
    node_events: tuple[Detection, ...] = ()           # node reports (host set)
    node_fail: tuple[str, ...] = ()                   # NODE_FAIL nodes from Slurm
    node_states: Mapping[str, str] = field(default_factory=dict)  # host -> state
    previous: tuple[PriorAttempt, ...] = ()
    window: tuple[float, float] | None = None         # the attempt's start, end


# -- layout from the log ----------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Placement facts a job log states about itself."""

    nodes: tuple[str, ...] = ()
    rank_hosts: Mapping[int, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)
    task_hosts: Mapping[int, str] = field(default_factory=dict)


_ALLOC = re.compile(r"\b(?:Allocate JobId=\d+\S* NodeList=|SLURM_(?:JOB_|STEP_)?NODELIST[=:] ?)"
                    r"([A-Za-z0-9][\w.\[\],-]*)")
_TASKS_PER_NODE = re.compile(r"\bSLURM_(?:STEP_|JOB_)?TASKS_PER_NODE[=:] ?(\d+(?:\(x\d+\))?"
                             r"(?:,\d+(?:\(x\d+\))?)*)")
_SRUN_LAUNCH = re.compile(r"launching (?:StepId=)?\S+ on host ([A-Za-z0-9][\w.-]*), \d+ tasks?: "
                          r"\[?([\d,-]+)\]?")
_NCCL_RANK = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO .*?"
                        r"\bcomm 0x[0-9a-f]+ rank (\d+) n[Rr]anks (\d+)")
_NCCL_ADDR = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO "
                        r"(?:NET/\w+ ?: Using .*?OOB |Bootstrap ?: Using |NET/Socket ?: Using )"
                        r"(?:\[\d+\])?[\w.-]+:(\d{1,3}(?:\.\d{1,3}){3})<")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_SUMMARY = re.compile(r"^\s*(?:\[\w+\]:\s*)?(host|rank)\s*:\s*([\w.-]+)")


def parse_layout(lines: Iterable[str]) -> Layout:
    """Nodes, rank -> host, IP -> host and srun task -> host from lines the job
    itself printed: slurmctld/``SLURM_JOB_NODELIST`` node lists (with
    ``SLURM_TASKS_PER_NODE``, ranks in block order), ``srun -v`` launch lines,
    NCCL's communicator init and bootstrap lines (the widest communicator
    wins), torchrun's failure summaries (``host :`` then ``rank :``), and the
    line prefixes (:func:`~.scanner.line_origin`) that put an srun ``--label``
    task, a ``[rankN]:`` rank or a pdsh/Ray IP address on a line naming its
    host: a task seen on a host is on it, so are the ranks seen on that task."""
    nodes: list[str] = []
    ranks: dict[int, str] = {}
    nccl: dict[int, tuple[int, str]] = {}
    addresses: dict[str, str] = {}
    tasks: dict[int, str] = {}
    task_ranks: set[tuple[int, int]] = set()
    per_node: list[int] = []
    summary_host = None
    for line in lines:
        if "NodeList=" in line or "NODELIST" in line:
            for match in _ALLOC.finditer(line):
                nodes.extend(n for n in _expand(match.group(1)) if n not in nodes)
        if "TASKS_PER_NODE" in line and not per_node:
            match = _TASKS_PER_NODE.search(line)
            per_node = _tasks_per_node(match.group(1)) if match else []
        if "launching" in line:
            match = _SRUN_LAUNCH.search(line)
            if match:
                for rank in _ranks(match.group(2)):
                    ranks.setdefault(rank, match.group(1))
        if "NCCL" in line or "[rank" in line or "MPICH ERROR" in line:
            _prefix_facts(line, tasks, task_ranks, addresses, ranks)
        if "NCCL INFO" in line:
            _nccl_line(line, nccl, addresses)
        match = _SUMMARY.match(line) if ":" in line else None
        if match and match.group(1) == "host":
            summary_host = match.group(2)
        elif match and summary_host and match.group(2).isdigit():
            ranks.setdefault(int(match.group(2)), summary_host)
            summary_host = None
    widest = max((size for size, _ in nccl.values()), default=0)
    for rank, (size, host) in nccl.items():
        if size == widest:
            ranks.setdefault(rank, host)
    _ranks_from_tasks(ranks, tasks, task_ranks)
    _ranks_from_blocks(ranks, nodes, per_node)
    return Layout(tuple(nodes), ranks, addresses, tasks)


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
        import hostlist
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
               "MPICH ERROR")
    LONGEST = 480

    def __init__(self, cap: int = 2048) -> None:
        self.cap = cap
        self.lines: list[str] = []
        self._ranked = 0

    def feed(self, text: str) -> None:
        if len(self.lines) >= self.cap:
            return
        if any(marker in text for marker in self.MARKERS):
            self.lines.append(text[:self.LONGEST])
        elif self._ranked < self.cap // 8 and ("[rank" in text or (
                text.lstrip()[:4] in ("host", "rank") and _SUMMARY.match(text))):
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
              "addresses": layout.addresses, "task_hosts": layout.task_hosts}
    for key in ("rank_hosts", "addresses", "task_hosts"):
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


# -- evidence ---------------------------------------------------------------------

def all_detections(detections: Sequence[Detection],
                   context: AttributionContext | None = None) -> list[Detection]:
    """The detections attribution weighs: the input ones with hosts filled in
    (rank -> host, address -> host), then the context's node reports, NODE_FAIL
    nodes and bad node states as detections of their own."""
    context = context or AttributionContext()
    out = [_vetted(_fill_host(d, context), context) for d in detections]
    for event in context.node_events:
        if _in_window(event, context.window):
            out.append(_node_event(_fill_host(event, context)))
    for node in context.node_fail:
        out.append(_slurm_detection("slurm.node_fail", node, f"NODE_FAIL {node}"))
    for node, state in sorted(context.node_states.items()):
        if (not context.nodes or node in context.nodes) and _BAD_STATE.search(state.upper()):
            out.append(_slurm_detection("slurm.node_state", node, f"{node} state {state}"))
    return out


def _fill_host(d: Detection, context: AttributionContext) -> Detection:
    host = d.host
    if host is None and d.rank is not None:
        host = context.rank_hosts.get(d.rank)
    if host is None and context.task_hosts and d.evidence:
        task = line_origin(d.evidence[0].text).task
        host = context.task_hosts.get(task) if task is not None else None
    if host is not None:
        host = _node_name(host, context)
    return d if host == d.host else replace(d, host=host)


def _node_name(host: str, context: AttributionContext) -> str:
    """The node a name in the text stands for: through the address map (IP
    addresses, hostnames), else its short name when that is one of the job's
    nodes (NCCL prints short names, torchrun's summary the FQDN)."""
    if host in context.addresses:
        return context.addresses[host]
    if context.nodes and host not in context.nodes and "[" not in host:
        short = host.split(".")[0]
        if short in context.nodes or short in context.addresses:
            return context.addresses.get(short, short)
    return host


def _vetted(d: Detection, context: AttributionContext) -> Detection:
    """What a line the job wrote itself may prove. A kernel, driver or daemon
    message (``emitter = "system"``) there proves nothing about a node: the
    user may have printed it, so it only informs. A host it names counts only
    when it is one of the job's own nodes (none, while those are not known)."""
    if d.origin != "job":
        return d
    if d.emitter == "system":
        return replace(d, severity="info", host=None, role="symptom",
                       detail=f"{d.detail} [a system message in the job's own output: "
                              "not node evidence]")
    if d.host is None:
        return d
    own = [h for h in _expand(d.host) if h in context.nodes]
    if len(own) == len(_expand(d.host)):
        return d
    return replace(d, host=",".join(own) or None,
                   detail=f"{d.detail} [names {d.host}, outside the job's nodes: ignored]")


def _in_window(d: Detection, window: tuple[float, float] | None) -> bool:
    times = [e.time for e in d.evidence if e.time is not None]
    return window is None or not times or any(window[0] <= t <= window[1] for t in times)


def _node_event(d: Detection) -> Detection:
    """A node-report detection; an XID without an action gets the catalog's."""
    if d.xid is None:
        return d
    action = d.action_hint
    if action == "none":
        text = d.detail or (d.evidence[0].text if d.evidence else "")
        action = xid_action(d.xid, text, "sxid" if "SXid" in text else "xid")
    return replace(d, action_hint=action, role="root", category="gpu_hardware")


def _slurm_detection(rule: str, node: str, text: str) -> Detection:
    return Detection(rule=rule, category="system_software", severity="critical",
                     action_hint="requeue_exclude", role="root", host=node, origin="system",
                     evidence=(Evidence(text, "slurm"),), detail=text)


# -- the verdict ------------------------------------------------------------------

# What the chosen lines say, read off the emitters' own wording (CUDA runtime
# strings, errno texts, PyTorch's store and launcher messages), whichever rule
# surfaced the line. These decide what a verdict is, not whether a line fires.
_FULL_DISK = re.compile(r"No space left on device|\[Errno 28\]|\bENOSPC\b|Disk quota exceeded"
                        r"|\[Errno 122\]|\bEDQUOT\b")
_QUOTA = re.compile(r"Disk quota exceeded|\[Errno 122\]|\bEDQUOT\b")
_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|unexpected pos \d+ vs \d+"
                           r"|Input/output error|\[Errno 5\]|\bEIO\b")
# cudaGetErrorString() of the errors a failing GPU causes as well as a bad kernel
# (700, 719, 46, 214, 999, with the driver's CUDA_ERROR_* names; THC's old
# "cuda runtime error (N) : <string>" too)
_GPU_MAYBE = (("illegal_address", re.compile(r"an illegal memory access was encountered"
                                             r"|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS")),
              ("launch_failure", re.compile(r"unspecified launch failure|cudaErrorLaunchFailure"
                                            r"|CUDA_ERROR_LAUNCH_FAILED")),
              ("ecc", re.compile(r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable"
                                 r"|CUDA_ERROR_ECC_UNCORRECTABLE")),
              ("busy", re.compile(r"busy or unavailable|cudaErrorDevicesUnavailable"
                                  r"|CUDA_ERROR_DEVICE_UNAVAILABLE")),
              ("unknown", re.compile(r"\bunknown error\b|cudaErrorUnknown|CUDA_ERROR_UNKNOWN")))
# c10d's TCPStore, its socket and the rendezvous on top (torch/csrc/distributed/c10d,
# torch/distributed/elastic/rendezvous): the store host, not a node's fabric. The
# store side (a broken or timed-out store connection, a store key never set, a
# rendezvous that timed out) is a collective setup timeout; a client that cannot
# connect to the store endpoint at all keeps its rule's category.
_STORE = re.compile(r"\[c10d\]|TCPStore|C10d store|c10d key-value store|store->get\("
                    r"|Rendezvous(?:Connection|Timeout|Closed)Error|SocketImpl\(|clients joined"
                    r"|The client socket has (?:timed out|failed to connect)")
_DEVICE_STATE = ("ecc", "busy", "unknown")     # the device's own state, not a kernel's fault
_STORE_SIDE = re.compile(r"TCPStore|c10d key-value store|store->get\(|SocketImpl\("
                         r"|clients joined|RendezvousTimeoutError|wait timeout after \d+ms")
# The work was done: the frameworks' own end-of-training messages
_DONE = re.compile(r"`Trainer\.fit` stopped: `max_(?:epochs|steps|time)=[^`]*` reached"
                   r"|worker group successfully finished"
                   r"|Training completed\. Do not forget to share your model"
                   r"|End time of running main:")
# A stack frame (Open MPI / glibc "path(sym+0x..)[0x..]", UCX " N 0x.. sym()  file:line"
# or " N path(sym+0x..) [0x..]", gdb "#N 0x.. in sym () from path") and the kernel's
# "segfault at .. in <object>[..]": the object or symbol a fault was in.
_FRAME = re.compile(r"(?:^|\]\s*|\s)(?:\[\s*\d+\]\s+|\d+\s+(?:0x[0-9a-f]+\s+)?|#\d+\s+0x[0-9a-f]+ in )"
                    r"(?P<where>[^\s(]+)\s?\(")
_GDB_FROM = re.compile(r"#\d+\s+0x[0-9a-f]+ in \S+ \(.*?\) from (?P<where>\S+)")
_KERNEL_IN = re.compile(r"(?:segfault at|general protection(?: fault)?|traps:).*? in "
                        r"(?P<where>[^\s\[]+)\[")
# frames of the signal handler itself (UCX's, glibc's trampoline): not where it crashed
# (UCX's handler lives in libucs: a fault in UCX itself shows libuct/libucp frames)
_HANDLER = re.compile(r"ucs_handle_error|ucs_error_signal_handler|__sigaction|__restore_rt"
                      r"|_sigtramp|<signal handler called>|(?:^|/)libc\.so|(?:^|/)libpthread\.so"
                      r"|(?:^|/)ld-linux|(?:^|/)libucs\.so|libSegFault|\bbacktrace\b")
# NCCL, the CUDA driver, NVIDIA's user-space driver libraries, verbs and its
# providers, UCX, libfabric/EFA, Open MPI's transport components, PSM2, HCOLL, SHARP
_SYSTEM_CODE = re.compile(r"lib(?:nccl|rccl|cuda|nvidia-[\w-]+|nvcuda|ibverbs|mlx[45]|rdmacm"
                          r"|efa|fabric|ucs|ucp|uct|ucm|psm2|hcoll|sharp)\b"
                          r"|\bmca_(?:btl|pml|mtl|coll|osc)_|\bp?nccl[A-Z]\w*|\bibv_\w+"
                          r"|\bmlx[45]_\w+|\bu(?:ct|cp)_\w+|\bcu[A-Z][A-Za-z]+(?:_v\d)?\b")
_BUS = re.compile(r"Bus error|SIGBUS|[Ss]ignal 7\b")
_FRAME_WINDOW = 40          # lines after a fault report where its backtrace is read


def attribute(detections: Sequence[Detection],
              context: AttributionContext | None = None) -> Verdict:
    """The verdict the detections (and the context) support; see the module doc."""
    context = context or AttributionContext()
    combined = all_detections(detections, context)
    weighed = [(i, d) for i, d in enumerate(combined) if d.severity != "info"]
    if not weighed:
        reason = "no failure evidence" if not combined else "only informational lines"
        return Verdict(blame="unknown", category=None, action="none", confidence=0.0,
                       reason=reason)
    tier = min(_tier(d) for _, d in weighed)
    pool = [(i, d) for i, d in weighed if _tier(d) == tier]
    win_index, winner = pool[0]
    if tier == 0:
        chosen = pool
        action = "requeue_exclude"
    else:
        chosen = [(i, d) for i, d in pool if d.category == winner.category]
        action = max((d.action_hint for _, d in chosen), key=_STRENGTH.__getitem__)
    if tier in (2, 3):
        verdict = _unexplained(winner, chosen, action, tier, combined, context)
    else:
        verdict = _blame(winner, chosen, action, tier, context)
        if tier == 1:
            verdict = _read_cause(verdict, winner, chosen, weighed, combined, context)
    verdict = replace(verdict, where=_where_named(d for _, d in chosen))
    return across_attempts(verdict, context.nodes, context.previous)


def straggler_verdict(found: Sequence[Detection], slow: Sequence[Detection]) -> Verdict:
    """The verdict on a running attempt whose step times lag: ``slow`` are the
    straggler detections just made (not empty), the last ``len(slow)`` of
    ``found``, the attempt's detections so far. The hosts they name are blamed
    (none named: unknown), and the attempt is killed and requeued."""
    hosts = tuple(d.host for d in slow if d.host)
    return Verdict(blame="node" if hosts else "unknown", category="straggler",
                   action="kill_requeue", confidence=0.6, nodes=hosts,
                   rests_on=tuple(range(len(found) - len(slow), len(found))),
                   reason=slow[0].detail)


def _where_named(detections: Iterable[Detection]) -> tuple[str, ...]:
    """The hosts and PCI addresses the lines name, in order, each once."""
    found = list(detections)
    return tuple(_unique([*_hosts(found), *(d.pci for d in found)]))


def _tier(d: Detection) -> int:
    if d.role == "root" and d.action_hint == "requeue_exclude":
        return 0
    if d.action_hint == "none":
        return 4
    return {"root": 1, "cause": 1, "symptom": 2, "exit": 3}.get(d.role, 1)


def _where(d: Detection) -> str:
    return f"{d.rule}" + (f" at line {d.line}" if d.line else "")


def _blame(winner: Detection, chosen: list[tuple[int, Detection]], action: str, tier: int,
           context: AttributionContext) -> Verdict:
    category = winner.category
    rests_on = tuple(sorted(i for i, _ in chosen))[:20]
    confidence = _TIER_CONFIDENCE[tier] + (0.05 if len(chosen) > 1 else 0.0)
    where = _where(winner)
    node_side = action == "requeue_exclude" or (category == "gpu_hardware" and action != "stop")
    if not node_side:
        blame = "application" if action == "stop" and category in _APPLICATION else "unknown"
        return Verdict(blame=blame, category=category, action=action,
                       confidence=round(min(confidence, 0.95), 2), rests_on=rests_on,
                       reason=f"{where}: {winner.detail}".strip(": "),
                       suspects=tuple(_peers((d for _, d in chosen), context)))
    hosts = _hosts(d for _, d in chosen)
    if not hosts and len(context.nodes) == 1 and action == "requeue_exclude":
        hosts = list(context.nodes)
    gpus = _unique(d.pci or d.gpu for _, d in chosen if d.category == "gpu_hardware")
    links = _unique(d.pci for _, d in chosen if d.category == "interconnect")
    if action == "requeue_exclude" and not (hosts or gpus or links):
        confidence -= 0.15
    return Verdict(blame="node", category=category, action=action,
                   confidence=round(min(confidence + (0.05 if hosts else 0), 0.97), 2),
                   nodes=tuple(hosts), gpus=tuple(gpus), links=tuple(links),
                   rests_on=rests_on, reason=f"{where}: {winner.detail}".strip(": "))


def _unexplained(winner: Detection, chosen: list[tuple[int, Detection]], action: str,
                 tier: int, combined: Sequence[Detection],
                 context: AttributionContext) -> Verdict:
    """A verdict made of symptoms (timeouts, peers that went away, store errors)
    and exit reports (task exits, aborts, launcher summaries) alone. These are
    what any failure leaves behind: no blame, no stop, no exclusion. The
    category is the symptom's layer (a store or rendezvous timeout is a
    collective setup timeout, not a node's fabric); an exit code has none.
    Policy requeues it within ``unknown_max_restarts``."""
    rests_on = tuple(sorted(i for i, _ in chosen))[:20]
    texts = [_text(d) for _, d in chosen]
    store = any(_STORE.search(t) for t in texts)
    # an exit code says nothing about the layer; a signal (SIGKILL, SIGSEGV) does
    category = None if tier == 3 and winner.category == "application" else winner.category
    if category in ("interconnect", "system_software", None) and any(
            _STORE_SIDE.search(t) for t in texts):
        category = "nccl_timeout_hang"
    if store:
        suspects = [h for h in _hosts(d for _, d in chosen) if h in context.nodes]
        kind = "a store or rendezvous failure (the store host went away, or the job raced at start)"
    else:
        suspects = _peers((d for _, d in chosen), context)
        kind = "only symptoms and exit reports, what any failure leaves behind"
    reason = f"{_where(winner)}: {winner.detail}".strip(": ")
    done = _finished_before(winner, combined)
    if done is not None:
        return Verdict(blame="unknown", category=category, action="none",
                       confidence=_TIER_CONFIDENCE[tier], rests_on=rests_on,
                       signature="done",
                       reason=f"{reason}; the work had finished before it "
                              f"({_where(done)}: {_text(done)[:120]}): nothing to redo")
    return Verdict(blame="unknown", category=category,
                   action="kill_requeue" if action == "kill_requeue" else "requeue",
                   confidence=_TIER_CONFIDENCE[tier], rests_on=rests_on, unexplained=True,
                   suspects=tuple(suspects),
                   reason=f"{reason}; unexplained: {kind}")


def _read_cause(verdict: Verdict, winner: Detection, chosen: list[tuple[int, Detection]],
                weighed: list[tuple[int, Detection]], combined: Sequence[Detection],
                context: AttributionContext) -> Verdict:
    """A first-hand cause read for what it says about the node or the code:
    a full disk, a write failure, a CUDA error a GPU may cause, a segfault and
    where it happened, a store failure."""
    texts = [_text(d) for _, d in chosen]
    if winner.category == "system_software":
        full = next((d for _, d in chosen if _FULL_DISK.search(_text(d))), None)
        if full is not None:
            what = ("over its quota" if _QUOTA.search(_text(full))
                    else "full (no space left on device)")
            return replace(verdict, action="stop", blame="unknown", nodes=(), gpus=(),
                           links=(), reason=f"{_where(full)}: the filesystem is {what}: "
                           f"free space or raise the quota, a retry fails the same way "
                           f"({_text(full)[:160]})")
        if verdict.action == "stop" and any(_WRITE_FAILED.search(t) for t in texts):
            return replace(verdict, action="requeue", blame="unknown",
                           signature="io:write",
                           reason=f"{verdict.reason}; an I/O error without a full disk "
                                  "or quota: retried (stopped if it comes back)")
    if winner.category == "cuda_error":
        kind = next((name for name, rx in _GPU_MAYBE if any(rx.search(t) for t in texts)), "")
        if kind:
            return _gpu_maybe(verdict, kind, chosen, weighed, context)
    if winner.category == "segfault":
        return _segfault(verdict, winner, chosen, combined, context)
    if any(_STORE.search(t) for t in texts) and verdict.category in ("interconnect",
                                                                     "system_software"):
        hosts = [h for h in verdict.nodes if h in context.nodes]
        if verdict.action == "requeue_exclude":
            return replace(verdict, blame="unknown", action="requeue", nodes=(), gpus=(),
                           links=(), suspects=tuple(hosts),
                           reason=f"{verdict.reason}; a store or rendezvous failure: not a "
                                  "node's fabric")
    return verdict


def _gpu_maybe(verdict: Verdict, kind: str, chosen: list[tuple[int, Detection]],
               weighed: list[tuple[int, Detection]], context: AttributionContext) -> Verdict:
    """A CUDA error that a failing GPU causes as well as a bad kernel. With a
    GPU fault that node-level evidence reports (an XID, a GPU gone: not one the
    application causes), the node; without, the first one is requeued (policy
    stops it once it follows the job onto fresh nodes, and excludes the node it
    stays with)."""
    faults = [(i, d) for i, d in weighed if d.category == "gpu_hardware"
              and d.action_hint in ("requeue", "requeue_exclude", "kill_requeue")
              and (d.host or d.pci or d.gpu)]
    suspects = tuple(_hosts(d for _, d in chosen))
    if suspects and any(d.host for _, d in faults):    # the fault must be where it happened
        faults = [(i, d) for i, d in faults if d.host in suspects]
    signature = f"cuda:{kind}"
    where = f"CUDA error ({kind.replace('_', ' ')})"
    if faults:
        hosts = _hosts(d for _, d in faults)
        gpus = _unique(d.pci or d.gpu for _, d in faults)
        return replace(verdict, blame="node", category="gpu_hardware",
                       action="requeue_exclude", nodes=tuple(hosts), gpus=tuple(gpus),
                       rests_on=tuple(sorted({*verdict.rests_on, *(i for i, _ in faults)}))[:20],
                       signature=signature, confidence=0.85,
                       reason=f"{verdict.reason}; with a GPU fault on "
                              f"{', '.join(hosts or gpus)} ({_where(faults[0][1])}): the GPU")
    if kind in _DEVICE_STATE and verdict.action != "stop":   # the device reports itself
        return replace(verdict, signature=signature, suspects=suspects)
    return replace(verdict, blame="unknown", action="requeue", nodes=(), gpus=(), links=(),
                   signature=signature, suspects=suspects,
                   reason=f"{verdict.reason}; {where} may be the GPU or the code: requeued "
                          "once, stopped if it follows the job to other nodes")


def _segfault(verdict: Verdict, winner: Detection, chosen: list[tuple[int, Detection]],
              combined: Sequence[Detection], context: AttributionContext) -> Verdict:
    """Where a segfault happened, from its backtrace or the kernel's report:
    inside NCCL, the CUDA driver or a fabric library it is not the job's bug
    (requeue; exclude the node it names); elsewhere (the job's code, its
    framework, or not known) it stops, as before."""
    where = _fault_object(winner, chosen, combined)
    if where is None or not _SYSTEM_CODE.search(where):
        return replace(verdict, signature="segfault:code" if where else "segfault",
                       reason=verdict.reason + (f"; in {where}" if where else ""))
    # a bus error there is most often shared memory the container or the job
    # sized too small (NCCL's /dev/shm segments): not the node's fault either
    bus = any(_BUS.search(_text(d)) for _, d in chosen)
    hosts = [] if bus else _hosts(d for _, d in chosen)
    reason = (f"{verdict.reason}; the fault is in {where} (a communication or driver "
              "library), not the job's code")
    if hosts:
        return replace(verdict, blame="node", action="requeue_exclude", nodes=tuple(hosts),
                       signature="segfault:library", reason=reason)
    return replace(verdict, blame="unknown", action="requeue", signature="segfault:library",
                   reason=reason + ": requeued, stopped if it follows the job to other nodes")


def _fault_object(winner: Detection, chosen: list[tuple[int, Detection]],
                  combined: Sequence[Detection]) -> str | None:
    """The object (library, binary) or symbol the fault was in: the kernel's
    ``in <object>`` on a fault report, else the first frame of the backtrace
    printed with it that is not the signal handler's own (frames that a rule
    surfaced, as a cause or as context)."""
    for _, d in chosen:
        match = _KERNEL_IN.search(_text(d))
        if match:
            return match.group("where")
    start, source = winner.line, winner.evidence[0].source if winner.evidence else ""
    near = [d for _, d in chosen]
    if start is not None:
        near += [d for d in combined if d.line is not None
                 and start <= d.line <= start + _FRAME_WINDOW
                 and d.evidence and d.evidence[0].source == source]
    for text in dict.fromkeys(_text(d) for d in sorted(near, key=lambda d: d.line or 0)):
        match = _GDB_FROM.search(text) or _FRAME.search(text) or _KERNEL_IN.search(text)
        if match and not _HANDLER.search(match.group("where")) and not _HANDLER.search(text):
            return match.group("where")
    return None


def _finished_before(winner: Detection, combined: Sequence[Detection]) -> Detection | None:
    """A line saying the work was done (the trainer reached its last epoch or
    step, torchrun's workers succeeded) before the first symptom."""
    source = winner.evidence[0].source if winner.evidence else ""
    for d in combined:
        if (d.line is not None and winner.line is not None and d.line < winner.line
                and d.evidence and d.evidence[0].source == source and _DONE.search(_text(d))):
            return d
    return None


def _text(d: Detection) -> str:
    return " ".join(e.text for e in d.evidence[:3])


def _peers(detections: Iterable[Detection], context: AttributionContext) -> list[str]:
    """Hosts the lines name as the other side (a peer address, a remote
    host), not the node that printed them."""
    out: list[str] = []
    for d in detections:
        if not d.host or not d.evidence or "," in d.host:
            continue
        origin = line_origin(d.evidence[0].text)
        printed = {origin.host, context.rank_hosts.get(d.rank) if d.rank is not None else None,
                   context.task_hosts.get(origin.task) if origin.task is not None else None}
        printed |= {_node_name(h, context) for h in printed if h}
        if d.host not in printed and d.host not in out:
            out.append(d.host)
    return out


def _hosts(detections: Iterable[Detection]) -> list[str]:
    out: list[str] = []
    for d in detections:
        for host in _expand(d.host) if d.host else ():
            if host not in out:
                out.append(host)
    return out


def _unique(values: Iterable[str | None]) -> list[str]:
    out: list[str] = []
    for value in values:
        if value and value not in out:
            out.append(value)
    return out


# -- across attempts --------------------------------------------------------------

def across_attempts(verdict: Verdict, nodes: Sequence[str],
                    previous: Sequence[PriorAttempt]) -> Verdict:
    """The verdict read together with the job's earlier attempts (``nodes``:
    where this one ran). Pure: policy calls it with the store's history.

    * A CUDA error or a segfault (``signature``) that follows the job onto
      nodes none of whose earlier occurrences ran on is the code: ``stop``.
      One that stays with one node is that node: exclude it.
    * An I/O failure without a full disk, a second time: ``stop``.
    * A host named as a suspect (a peer, a store host) that an earlier
      attempt's failure named too: exclude it.
    * A failure naming no node (with evidence: not one with none at all),
      repeated over attempts that share exactly one node, blames that node.
    """
    if not previous or verdict.action == "stop" or verdict.signature == "done":
        return verdict
    family = verdict.signature.partition(":")[0]
    # not when node-level evidence blames the GPU, nor for uncorrectable ECC
    # (memory the code cannot corrupt: two bad GPUs are two bad GPUs)
    if (family in ("cuda", "segfault") and verdict.category != "gpu_hardware"
            and verdict.signature != "cuda:ecc"):
        reread = _recurring(verdict, family, nodes, previous)
        if reread is not None:
            return reread
    if family == "io":
        again = [p for p in previous if p.verdict and p.verdict.signature.startswith("io")]
        if again:
            return replace(verdict, action="stop", blame="unknown",
                           reason=f"{verdict.reason}; the same I/O failure ended "
                                  f"{_attempts(again)} too: a full disk, a quota or a "
                                  "filesystem fault that a retry does not clear")
    if verdict.blame != "node" and verdict.suspects:
        named = [s for s in verdict.suspects if (not nodes or s in nodes) and any(
            p.verdict and (s in p.verdict.suspects or s in p.verdict.nodes) for p in previous)]
        if named:
            again = [p for p in previous if p.verdict and set(named) & set(
                p.verdict.suspects + p.verdict.nodes)]
            return replace(verdict, blame="node", action="requeue_exclude",
                           nodes=tuple(named), unexplained=False, confidence=0.7,
                           reason=f"{verdict.reason}; {', '.join(named)} named by the "
                                  f"failure of {_attempts(again)} too: excluded")
    if verdict.blame != "application" and not verdict.nodes and verdict.action != "none":
        return _repeated(verdict, nodes, previous) or verdict
    return verdict


def _recurring(verdict: Verdict, family: str, nodes: Sequence[str],
               previous: Sequence[PriorAttempt]) -> Verdict | None:
    same = [p for p in previous if p.verdict and p.nodes
            and p.verdict.signature.partition(":")[0] == family]
    if not same or not nodes:
        return None
    what = "CUDA error" if family == "cuda" else "segfault"
    fresh = [p for p in same if not set(p.nodes) & set(nodes)]
    if fresh:
        return replace(verdict, blame="application", action="stop", nodes=(), gpus=(),
                       links=(), unexplained=False, confidence=0.8,
                       reason=f"{verdict.reason}; the same {what} ended "
                              f"{_attempts(fresh)} on {', '.join(fresh[0].nodes)} and now "
                              f"this one on other nodes ({', '.join(nodes)}): it follows the "
                              "job, so it is the code or its setup, not a node")
    common = set(nodes).intersection(*(set(p.nodes) for p in same))
    if len(common) > 1:
        pointed = set(verdict.suspects).intersection(*(set(p.verdict.suspects) for p in same))
        common &= pointed
    if len(common) != 1:
        return None
    node = common.pop()
    return replace(verdict, blame="node", action="requeue_exclude", nodes=(node,),
                   unexplained=False, confidence=0.7,
                   reason=f"{verdict.reason}; the same {what} ended {_attempts(same)} on "
                          f"{node} too: it stays with that node")


def _attempts(previous: Sequence[PriorAttempt]) -> str:
    numbers = [str(p.attempt) for p in previous if p.attempt is not None]
    if not numbers:
        return "an earlier attempt" if len(previous) == 1 else f"{len(previous)} earlier attempts"
    return ("attempt " if len(numbers) == 1 else "attempts ") + ", ".join(numbers)


def _repeated(verdict: Verdict, nodes: Sequence[str],
              previous: Sequence[PriorAttempt]) -> Verdict | None:
    """Blame the one node common to this failure and earlier failed attempts."""
    failed = [p for p in previous
              if p.nodes and (p.verdict is None or p.verdict.blame != "application")]
    if not failed or not nodes:
        return None
    common = set(nodes).intersection(*(set(p.nodes) for p in failed))
    named = Counter(n for p in failed if p.verdict for n in p.verdict.nodes if n in nodes)
    if len(common) == 1:
        node = common.pop()
    elif named:
        node = named.most_common(1)[0][0]
    else:
        return None
    return replace(verdict, blame="node", nodes=(node,), action="requeue_exclude",
                   unexplained=False, confidence=0.6 if len(failed) == 1 else 0.7,
                   reason=f"{verdict.reason}; {node} is common to {len(failed) + 1} "
                          "failed attempts")

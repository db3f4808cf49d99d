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

__all__ = ["AttributionContext", "Layout", "PriorAttempt", "all_detections", "attribute",
           "context_from_lines", "parse_layout"]

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


@dataclass(frozen=True)
class AttributionContext:
    """What attribution knows besides the log detections (every field optional)."""

    nodes: tuple[str, ...] = ()                       # the job's nodes, expanded
    rank_hosts: Mapping[int, str] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)   # IP -> host
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


_ALLOC = re.compile(r"\b(?:Allocate JobId=\d+\S* NodeList=|SLURM_(?:JOB_)?NODELIST=)"
                    r"([A-Za-z0-9][\w.\[\],-]*)")
_SRUN_LAUNCH = re.compile(r"launching (?:StepId=)?\S+ on host ([A-Za-z0-9][\w.-]*), \d+ tasks?: "
                          r"\[?([\d,-]+)\]?")
_NCCL_RANK = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO .*?"
                        r"\bcomm 0x[0-9a-f]+ rank (\d+) nranks (\d+)")
_NCCL_ADDR = re.compile(r"(?:^|\s)([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO "
                        r"(?:NET/\w+ ?: Using .*?OOB |Bootstrap ?: Using )\w+:"
                        r"(\d{1,3}(?:\.\d{1,3}){3})<")
_SUMMARY = re.compile(r"^\s*(?:\[\w+\]:\s*)?(host|rank)\s*:\s*([\w.-]+)")


def parse_layout(lines: Iterable[str]) -> Layout:
    """Nodes, rank -> host and IP -> host from lines the job itself printed:
    slurmctld/SLURM_JOB_NODELIST node lists, ``srun -v`` launch lines, NCCL's
    communicator init and bootstrap lines (the widest communicator wins), and
    torchrun's failure summaries (``host :`` then ``rank :``)."""
    nodes: list[str] = []
    ranks: dict[int, str] = {}
    nccl: dict[int, tuple[int, str]] = {}
    addresses: dict[str, str] = {}
    summary_host = None
    for line in lines:
        if "NodeList=" in line or "NODELIST=" in line:
            for match in _ALLOC.finditer(line):
                nodes.extend(n for n in _expand(match.group(1)) if n not in nodes)
        if "launching" in line:
            match = _SRUN_LAUNCH.search(line)
            if match:
                for rank in _ranks(match.group(2)):
                    ranks.setdefault(rank, match.group(1))
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
    return Layout(tuple(nodes), ranks, addresses)


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


def context_from_lines(lines: Iterable[str], **known) -> AttributionContext:
    """An AttributionContext from what the log states (:func:`parse_layout`),
    with ``known`` fields (from Slurm, the store) taking precedence."""
    layout = parse_layout(lines)
    merged = {"nodes": layout.nodes, "rank_hosts": layout.rank_hosts,
              "addresses": layout.addresses}
    for key in ("rank_hosts", "addresses"):
        if key in known:
            merged[key] = {**merged[key], **known.pop(key)}
    merged.update(known)
    return AttributionContext(**merged)


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
    if host is not None and host in context.addresses:
        host = context.addresses[host]
    return d if host == d.host else replace(d, host=host)


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
    verdict = _blame(winner, chosen, action, tier, context)
    if verdict.blame != "application" and not verdict.nodes and verdict.action != "stop":
        verdict = _repeated(verdict, context) or verdict
    return verdict


def _tier(d: Detection) -> int:
    if d.role == "root" and d.action_hint == "requeue_exclude":
        return 0
    if d.action_hint == "none":
        return 4
    return {"root": 1, "cause": 1, "symptom": 2, "exit": 3}.get(d.role, 1)


def _blame(winner: Detection, chosen: list[tuple[int, Detection]], action: str, tier: int,
           context: AttributionContext) -> Verdict:
    category = winner.category
    rests_on = tuple(sorted(i for i, _ in chosen))[:20]
    confidence = _TIER_CONFIDENCE[tier] + (0.05 if len(chosen) > 1 else 0.0)
    where = f"{winner.rule}" + (f" at line {winner.line}" if winner.line else "")
    node_side = action == "requeue_exclude" or (category == "gpu_hardware" and action != "stop")
    if not node_side:
        blame = "application" if action == "stop" and category in _APPLICATION else "unknown"
        return Verdict(blame=blame, category=category, action=action,
                       confidence=round(min(confidence, 0.95), 2), rests_on=rests_on,
                       reason=f"{where}: {winner.detail}".strip(": "))
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


def _repeated(verdict: Verdict, context: AttributionContext) -> Verdict | None:
    """Blame the one node common to this failure and earlier failed attempts."""
    failed = [p for p in context.previous
              if p.nodes and (p.verdict is None or p.verdict.blame != "application")]
    if not failed or not context.nodes:
        return None
    common = set(context.nodes).intersection(*(set(p.nodes) for p in failed))
    named = Counter(n for p in failed if p.verdict for n in p.verdict.nodes
                    if n in context.nodes)
    if len(common) == 1:
        node = common.pop()
    elif named:
        node = named.most_common(1)[0][0]
    else:
        return None
    return replace(verdict, blame="node", nodes=(node,), action="requeue_exclude",
                   confidence=0.6 if len(failed) == 1 else 0.7,
                   reason=f"{verdict.reason}; {node} is common to {len(failed) + 1} "
                          "failed attempts")
